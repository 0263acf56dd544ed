"""The MTP formats: DeepSeek-V3's and Qwen3-Next's native layouts; import from a checkpoint, write, load.

Layouts (docs/formats.md §3; names checked against vLLM ``deepseek_mtp.py`` and
``qwen3_next_mtp.py``):

- ``deepseek_v3``: module d is ``model.layers.{N+d}.*`` (N = the target's layer count): ``enorm``,
  ``hnorm``, ``eh_proj`` [H, 2H] (no bias), the block's usual Llama names (``input_layernorm``,
  ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``), then
  ``shared_head.norm`` and ``shared_head.head`` (the target's lm_head).  A per-layer ``embed_tokens`` (the
  target's, shared) is ignored on import and never exported.
- ``qwen3_next``: ``mtp.fc`` [H, 2H], ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden`` (one of
  each for all depths), ``mtp.layers.{d}.*`` (block names as above), ``mtp.norm``; the lm_head is the
  target's ``lm_head.weight`` (written too, optional on import).

Both sets of names are the target checkpoint's own, so an exported file can be merged into it.  A
published MTP draft is one folder like an EAGLE-3 one (config.json, model.safetensors, manifest.json with
sha256 of both files), manifest ``format: draft_align.mtp``, ``layout``, and the full ``mtp_config``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from draft_align.heads.layers import Rotary
from draft_align.heads.mtp import LAYOUTS, MTPConfig, MTPDraft
from draft_align.publish.config_json import (
    block_config_fields,
    check_config_json,
    check_rope,
    special_token_ids,
)
from draft_align.publish.folder import (
    MANIFEST_FILE,
    MTP_FORMAT,
    RESERVED_KEYS,
    ExportError,
    ExportRequest,
    check_destination,
    check_finite,
    draft_manifest,
    final_hidden_aux,
    float_dtype_name,
    publish_folder,
    read_head_config,
    read_weights,
    stored_itemsize,
)
from draft_align.publish.formats import (
    HeadFormat,
    TapCapture,
    check_built_for,
    check_positions,
    refuse_dialect,
)

MTP_FORMAT_VERSION = 1
ARCHITECTURES = {"deepseek_v3": "DeepSeekMTPModel", "qwen3_next": "Qwen3NextMTP"}
_BLOCK = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
)
_FUSE = {
    "enorm.weight": "pre_fc_norm_embedding.weight",
    "hnorm.weight": "pre_fc_norm_hidden.weight",
    "eh_proj.weight": "fc.weight",
}  # ours (per depth) → Qwen3-Next (shared by all depths)


# --------------------------------------------------------------------------------------- name maps
def layout_names(cfg: MTPConfig, layout: str) -> dict[str, str]:
    """Our module name → the layout's tensor name, for every tensor of the head (lm_head included)."""
    if layout not in LAYOUTS:
        raise ExportError(f"unknown MTP layout {layout!r}: expected one of {LAYOUTS}")
    out: dict[str, str] = {}
    n = cfg.target_num_layers
    for d in range(cfg.depth):
        ours = f"layers.{d}."
        if layout == "deepseek_v3":
            theirs = f"model.layers.{n + d}."
            for name in (*_FUSE, *_BLOCK):
                out[ours + name] = theirs + name
        else:
            for name in _BLOCK:
                out[ours + name] = f"mtp.layers.{d}.{name}"
            if d == 0:
                for name, q in _FUSE.items():
                    out[ours + name] = "mtp." + q
    if layout == "deepseek_v3":
        out["norm.weight"] = f"model.layers.{n}.shared_head.norm.weight"
        out["lm_head.weight"] = f"model.layers.{n}.shared_head.head.weight"
    else:
        out["norm.weight"] = "mtp.norm.weight"
        out["lm_head.weight"] = "lm_head.weight"
    return out


def _expected_shapes(cfg: MTPConfig) -> dict[str, tuple[int, ...]]:
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    block = {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    out = {f"layers.{d}.{k}": v for d in range(cfg.depth) for k, v in block.items()}
    out["norm.weight"] = (h,)
    out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def to_layout(draft: MTPDraft, layout: str | None = None) -> dict[str, torch.Tensor]:
    """The head's tensors under ``layout``'s names (default: the head's own layout).

    Raises ExportError when the layout cannot hold the head: another layout than the head was trained
    for (the chained hidden and position-0 embedding differ; convert with :func:`with_layout`), or
    ``qwen3_next`` with depths whose fc / pre-fc norms differ (Qwen3-Next shares them).
    """
    cfg = draft.cfg
    layout = layout or cfg.layout
    if layout != cfg.layout:
        raise ExportError(
            f"this MTP head runs the {cfg.layout} semantics; exporting it as {layout} would change its "
            f"outputs after the first draft step: convert explicitly with with_layout(draft, {layout!r})"
        )
    sd = draft.engine_state_dict()
    if layout == "qwen3_next":
        for d in range(1, cfg.depth):
            for name in _FUSE:
                if not torch.equal(sd[f"layers.{d}.{name}"], sd[f"layers.0.{name}"]):
                    raise ExportError(
                        f"qwen3_next shares mtp.fc and the pre-fc norms across depths, but layers.{d}.{name} "
                        f"differs from layers.0.{name}"
                    )
    out = {theirs: sd[ours] for ours, theirs in layout_names(cfg, layout).items()}
    for first, copy in head_copies(cfg, layout):  # vLLM reads each depth's own shared_head
        out[copy] = out[first].clone()  # a real copy: safetensors refuses shared storage
    return out


def head_copies(cfg: MTPConfig, layout: str) -> list[tuple[str, str]]:
    """DeepSeek-V3 stores ``shared_head.{norm,head}`` in every MTP layer (vLLM's ``compute_logits`` uses
    layer N+d's for step d): (depth-0 name, depth-d name) pairs for d ≥ 1."""
    if layout != "deepseek_v3":
        return []
    n = cfg.target_num_layers
    return [
        (f"model.layers.{n}.shared_head.{part}.weight", f"model.layers.{n + d}.shared_head.{part}.weight")
        for d in range(1, cfg.depth)
        for part in ("norm", "head")
    ]


def with_layout(draft: MTPDraft, layout: str) -> MTPDraft:
    """A copy of ``draft`` with the same weights that runs (and exports as) ``layout``."""
    out = MTPDraft(dataclasses.replace(draft.cfg, layout=layout))
    out.load_state_dict(draft.state_dict())
    return out.to(next(draft.parameters()).device)


def from_layout(
    tensors: Mapping[str, torch.Tensor], cfg: MTPConfig, lm_head: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Our module-named state dict from a checkpoint's tensors in ``cfg.layout`` (other names ignored).

    ``tensors`` may be a whole model's state dict: only the MTP namespace is read (DeepSeek:
    ``model.layers.{i}`` with i ≥ N; Qwen3-Next: ``mtp.*``, plus ``lm_head.weight``).  ``lm_head``: the
    target's lm_head [V, H] when the checkpoint has none.  Raises ExportError naming the problem: no MTP
    weights, another depth, another hidden size, missing or unexpected names, wrong shapes.
    """
    layout = cfg.layout
    n = cfg.target_num_layers
    if layout == "deepseek_v3":
        pat = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
        ns = {k: v for k, v in tensors.items() if (m := pat.match(k)) and int(m.group(1)) >= n}
        found = sorted({int(pat.match(k).group(1)) for k in ns})  # type: ignore[union-attr]
        ns = {k: v for k, v in ns.items() if not k.endswith(".embed_tokens.weight")}  # the target's, shared
        depth_found = len(found)
        hint = "model.layers.{N+d}.eh_proj.weight"
        if found and found != list(range(n, n + len(found))):
            raise ExportError(
                f"MTP layers {found} are not numbered from the target's {n} layers on: wrong "
                f"target_num_layers ({n}) or not a DeepSeek-V3 MTP layout"
            )
    else:
        ns = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
        if "lm_head.weight" in tensors:
            ns["lm_head.weight"] = tensors["lm_head.weight"]
        found = sorted({int(m.group(1)) for k in ns if (m := re.match(r"^mtp\.layers\.(\d+)\.", k))})
        depth_found = len(found)
        hint = "mtp.fc.weight"
    if not ns or depth_found == 0:
        other = "qwen3_next" if layout == "deepseek_v3" else "deepseek_v3"
        looks_other = (
            any(k.startswith("mtp.") for k in tensors)
            if layout == "deepseek_v3"
            else any(re.match(r"^model\.layers\.(\d+)\.eh_proj", k) for k in tensors)
        )
        raise ExportError(
            f"no MTP weights in the {layout} layout (expected {hint} and its block)"
            + (f"; the checkpoint looks like the {other} layout" if looks_other else "")
        )
    if depth_found != cfg.depth:
        raise ExportError(
            f"MTP depth mismatch: the checkpoint has {depth_found} MTP layers, the config expects {cfg.depth}"
        )
    names = layout_names(cfg, layout)
    inverse = {theirs: ours for ours, theirs in names.items()}
    head_name = names["lm_head.weight"]
    extra_dup: dict[str, list[str]] = {}
    for first, copy in head_copies(cfg, layout):  # every depth's copy must agree with depth 0's
        extra_dup.setdefault(first, []).append(copy)
    dup_names = {x for v in extra_dup.values() for x in v}
    expected = set(names.values())
    if lm_head is not None or head_name not in ns:
        expected.discard(head_name)
    missing = sorted(expected - set(ns))
    unexpected = sorted(
        set(ns) - set(names.values()) - dup_names - ({head_name} if lm_head is not None else set())
    )
    if head_name not in ns and lm_head is None:
        raise ExportError(f"the checkpoint has no {head_name}: pass the target's lm_head")
    if missing or unexpected:
        raise ExportError(
            f"MTP tensor names differ from the {layout} layout: missing {missing}, unexpected {unexpected}"
        )
    for first, copies in extra_dup.items():
        for c in copies:
            if c in ns and not torch.equal(ns[c], ns[first]):
                raise ExportError(
                    f"{c} differs from {first}: this head shares one final norm and head across depths"
                )
    shapes = _expected_shapes(cfg)
    eh = names["layers.0.eh_proj.weight"]
    if tuple(ns[eh].shape) != shapes["layers.0.eh_proj.weight"]:
        raise ExportError(
            f"hidden size mismatch: {eh} is {list(ns[eh].shape)} (hidden {ns[eh].shape[0]}), the config expects "
            f"[H, 2H] = {list(shapes['layers.0.eh_proj.weight'])}"
        )
    out: dict[str, torch.Tensor] = {}
    for theirs, ours in inverse.items():
        if theirs == head_name and (lm_head is not None or theirs not in ns):
            t = lm_head
        else:
            t = ns[theirs]
        assert t is not None
        if tuple(t.shape) != shapes[ours]:
            if ours.endswith("eh_proj.weight"):
                raise ExportError(
                    f"hidden size mismatch: {theirs} is {list(t.shape)}, expected [H, 2H] = {list(shapes[ours])}"
                )
            raise ExportError(f"{theirs} has shape {list(t.shape)}, expected {list(shapes[ours])}")
        out[ours] = t
    if layout == "qwen3_next":
        for d in range(1, cfg.depth):
            for name in _FUSE:
                out[f"layers.{d}.{name}"] = out[f"layers.0.{name}"]
    return out


def import_mtp(
    tensors: Mapping[str, torch.Tensor],
    cfg: MTPConfig,
    *,
    lm_head: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> MTPDraft:
    """An :class:`MTPDraft` holding the native MTP weights of ``tensors`` (see :func:`from_layout`)."""
    state = {k: v.detach().to("cpu", dtype).clone() for k, v in from_layout(tensors, cfg, lm_head).items()}
    with torch.device("meta"):
        draft = MTPDraft(cfg)
    draft.load_state_dict(state, strict=True, assign=True)
    draft.lm_head.weight.requires_grad_(False)
    draft.rotary = Rotary(cfg)  # built on meta: recompute for real
    v = cfg.vocab_size
    draft.register_buffer("d2t", torch.zeros(v, dtype=torch.long), persistent=False)
    draft.register_buffer("t2d", torch.ones(v, dtype=torch.bool), persistent=False)
    return draft.to(device)


def import_mtp_from_folder(
    path: Path,
    layout: str,
    *,
    depth: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> MTPDraft:
    """The native MTP head of an HF checkpoint folder (config.json + ``*.safetensors`` shards).

    Only the MTP namespace (and the lm_head) is read from the shards, tensor by tensor, so a large
    checkpoint is never loaded whole.  ``depth`` defaults to config.json's ``num_nextn_predict_layers``.
    The block must be a dense Llama-style layer: a checkpoint whose MTP block is MoE or MLA fails with the
    names it has that this head lacks.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    path = Path(path)
    try:
        tc = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: no readable config.json ({e})") from e
    n = int(getattr(tc, "num_nextn_predict_layers", 0) or 0) if depth is None else int(depth)
    if n < 1:
        raise ExportError(
            f"{path}: config.json declares no MTP layers (num_nextn_predict_layers); pass depth"
        )
    cfg = MTPConfig.from_target(tc, depth=n, layout=layout)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ExportError(f"{path}: no *.safetensors shards")
    pat = re.compile(r"^model\.layers\.(\d+)\.")

    def wanted(name: str) -> bool:
        if name == "lm_head.weight":
            return True
        if layout == "qwen3_next":
            return name.startswith("mtp.")
        m = pat.match(name)
        return m is not None and int(m.group(1)) >= cfg.target_num_layers

    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if wanted(name):
                    tensors[name] = f.get_tensor(name)
    lm_head = tensors.pop("lm_head.weight", None) if layout == "deepseek_v3" else None
    if (
        layout == "deepseek_v3"
        and f"model.layers.{cfg.target_num_layers}.shared_head.head.weight" not in tensors
    ):
        return import_mtp(tensors, cfg, lm_head=lm_head, device=device, dtype=dtype)
    return import_mtp(tensors, cfg, device=device, dtype=dtype)


# --------------------------------------------------------------------------------------- validation
def validate_mtp(draft: MTPDraft, target_config: Any) -> None:
    """Raise ExportError unless ``draft`` fits ``target_config`` (hidden, vocab, layers, RoPE, positions)
    and its weights are finite."""
    cfg = draft.cfg
    check_built_for("MTP head built for", _sizes(cfg.to_dict(), target_config))
    check_positions(cfg.max_position_embeddings, target_config)
    check_rope(cfg.rope_parameters, target_config)
    for name, t in draft.engine_state_dict().items():
        check_finite(name, t)


def mtp_config_json(cfg: MTPConfig, target_config: Any, dtype_name: str) -> dict[str, Any]:
    """config.json: the target-shaped fields an MTP loader reads (``num_hidden_layers`` = N so that the
    DeepSeek names ``model.layers.{N+d}`` line up, ``num_nextn_predict_layers`` = depth)."""
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.layout]],
        "model_type": f"{cfg.layout}_mtp",
        "num_hidden_layers": cfg.target_num_layers,
        "num_nextn_predict_layers": cfg.depth,
        **block_config_fields(cfg),
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        "mtp_block": "llama",
        **special_token_ids(target_config),
    }
    return out


def engine_tensors(draft: MTPDraft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors model.safetensors holds: the head's own layout (:func:`to_layout`), cast to ``dtype``."""
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in to_layout(draft).items()}


# --------------------------------------------------------------------------------------- write / load
def write_mtp(draft: MTPDraft, out_dir: Path, req: ExportRequest) -> dict[str, Any]:
    """Write the plain (LoRA-merged) MTP ``draft`` at ``out_dir`` in its own layout; returns the manifest.

    Same guarantees as the EAGLE-3 format: validated first, floats stored in ``req.dtype``, the folder
    appears atomically (temp + rename).  ``req.dialect`` must stay ``hf``.
    """
    refuse_dialect(req, "an MTP head is written in its own layout")
    out_dir = Path(out_dir)
    dtype_name = float_dtype_name(req.dtype)
    check_destination(out_dir, req.overwrite, req.extra_manifest, RESERVED_KEYS | {"layout", "mtp_config"})
    validate_mtp(draft, req.target_config)
    layout = draft.cfg.layout
    tensors = engine_tensors(draft, req.dtype)
    for name, t in tensors.items():
        check_finite(name, t, req.dtype)
    cfg = dataclasses.replace(draft.cfg, torch_dtype=dtype_name)
    config = mtp_config_json(cfg, req.target_config, dtype_name)
    manifest = draft_manifest(
        {"format": MTP_FORMAT, "format_version": MTP_FORMAT_VERSION, "layout": layout},
        req,
        architecture=config["architectures"][0],
        aux_layer_ids=final_hidden_aux(cfg.aux_layer_ids),
        draft_vocab_size=cfg.vocab_size,
        head_config={"mtp_config": cfg.to_dict()},
    )
    publish_folder(out_dir, tensors, manifest, config=config, overwrite=req.overwrite)
    return manifest


def weights_data_bytes(path: Path, manifest: Mapping[str, Any]) -> int:
    """The tensor bytes model.safetensors holds for the manifest's ``mtp_config`` (its own layout, with
    DeepSeek-V3's per-depth head copies) at the manifest's stored float size."""
    cfg = read_head_config(path, manifest, "mtp_config", MTPConfig.from_dict)
    shapes = _expected_shapes(cfg)
    theirs = {t: math.prod(shapes[ours]) for ours, t in layout_names(cfg, cfg.layout).items()}
    ours_of = {t: o for o, t in layout_names(cfg, cfg.layout).items()}
    copies = sum(math.prod(shapes[ours_of[first]]) for first, _ in head_copies(cfg, cfg.layout))
    return (sum(theirs.values()) + copies) * stored_itemsize(path, manifest)


def load_mtp(
    path: Path,
    manifest: Mapping[str, Any],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> MTPDraft:
    """Rebuild the MTP head published at ``path`` from its (already read) ``manifest``; names, depth and
    shapes are checked against the manifest's ``mtp_config`` (``weights``: the verified tensors, else read)."""
    path = Path(path)
    cfg = read_head_config(path, manifest, "mtp_config", MTPConfig.from_dict)
    if manifest.get("layout") != cfg.layout:
        raise ExportError(
            f"{path / MANIFEST_FILE}: layout {manifest.get('layout')!r} ≠ mtp_config.layout {cfg.layout!r}"
        )
    draft = import_mtp(
        read_weights(path) if weights is None else dict(weights), cfg, device=device, dtype=dtype
    )
    extra = {"num_hidden_layers": cfg.target_num_layers, "num_nextn_predict_layers": cfg.depth}
    check_config_json(path, cfg, extra)
    return draft


# --------------------------------------------------------------------------------------- against a target
def _sizes(cfg: Mapping[str, Any], target_config: Any) -> tuple[tuple[str, Any, int], ...]:
    """(what, the head's, the target's) for the sizes an MTP head must share with its target."""
    return (
        ("hidden size", cfg["hidden_size"], int(target_config.hidden_size)),
        ("vocab size", cfg["vocab_size"], int(target_config.vocab_size)),
        ("num layers", cfg["target_num_layers"], int(target_config.num_hidden_layers)),
    )


def check_target(manifest: Mapping[str, Any], target_config: Any) -> None:
    """ExportError unless the MTP draft ``manifest`` describes fits ``target_config``: hidden size, vocab size,
    the target's depth, positions."""
    cfg = manifest["mtp_config"]
    check_built_for("MTP draft built for", _sizes(cfg, target_config))
    check_positions(cfg["max_position_embeddings"], target_config)


def tap_capture(path: Path, manifest: Mapping[str, Any]) -> TapCapture:
    """The aux layers of ``mtp_config`` (the final hidden state) and the full target vocabulary; no weights read."""
    mtp = MTPConfig.from_dict(dict(manifest["mtp_config"]))
    return tuple(mtp.aux_layer_ids), torch.arange(mtp.vocab_size)


FORMAT = HeadFormat(
    name=MTP_FORMAT,
    kind="llama_block_mtp",
    head=MTPDraft,
    write_head=write_mtp,
    head_tensors=engine_tensors,
    load=load_mtp,
    weights_data_bytes=weights_data_bytes,
    check_target=check_target,
    tap_capture=tap_capture,
)
