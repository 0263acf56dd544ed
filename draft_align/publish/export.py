"""Engine-format EAGLE-3 checkpoints: export, load, compatibility checks and the ``latest`` pointer.

A published draft is one folder (DESIGN.md "Checkpoints")::

    run_dir/drafts/v0007/config.json        what vLLM / SGLang read (HF or speculators dialect)
    run_dir/drafts/v0007/model.safetensors  exactly the engine tensors (REFERENCE.md §1)
    run_dir/drafts/v0007/manifest.json      sha256 + size of both files, versions, target, metrics,
                                            the full Eagle3Config (``load_draft`` rebuilds from it)
    run_dir/latest                          text file: "drafts/v0007"

A folder is written under a ``.tmp-*`` name beside its final place, fsynced, then renamed: a reader sees
either no folder or a complete one.  ``load_draft`` re-hashes every file the manifest lists.

Aux-layer ids.  ``Eagle3Config.aux_layer_ids`` are HF ``output_hidden_states`` indices k (hidden_states[0]
is the embedding output).  Both engines capture the pre-norm residual stream entering decoder layer k, so
for a target of L layers the usable range is 1..L-1.  vLLM reads id k as that same stream; SGLang adds one
to the ids it reads, so it must be given k-1.  When the ids equal the engines' default (2, L//2, L-3) the
config leaves them out and both engines agree without any convention.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import safetensors.torch
import torch

import draft_align
from draft_align.heads.eagle3 import (
    ARCHITECTURE,
    DraftConfigError,
    Eagle3Config,
    Eagle3Draft,
    check_engine_aux_ids,
)
from draft_align.heads.layers import Rotary
from draft_align.heads.vocab import check_d2t

FORMAT = "draft_align.eagle3"
MTP_FORMAT = "draft_align.mtp"  # written by publish/mtp_export.py
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
DRAFTS_DIR = "drafts"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"  # speculators' Eagle3SpeculatorConfig.architectures default

Dialect = Literal["hf", "speculators"]
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_VERSION_RE = re.compile(r"^v(\d{4,})$")
# Both engines build fc as Linear(3·target_hidden_size, H): vLLM llama_eagle3.py `target_hidden_size * 3`,
# SGLang llama_eagle3.py `self.hidden_size_in * 3`.


class ExportError(ValueError):
    """A draft that must not be published, or a checkpoint that does not fit the given target."""


class CorruptCheckpointError(ExportError):
    """A checkpoint folder whose files do not match its manifest (or that has no readable manifest)."""


# --------------------------------------------------------------------------------------- aux-layer ids
def aux_id_conventions(aux_layer_ids: tuple[int, ...] | list[int], num_layers: int) -> dict[str, Any]:
    """The same capture points in each convention, and whether config.json must spell them out.

    hf: HF ``hidden_states`` indices k; vllm: k (vLLM captures the stream entering layer k);
    sglang: k-1 (SGLang adds one to the ids it reads); engine_default: ids == (2, L//2, L-3).
    """
    hf = [int(i) for i in aux_layer_ids]
    default = hf == list(Eagle3Config.default_aux_layer_ids(num_layers))
    return {
        "hf": hf,
        "vllm": list(hf),
        "sglang": [i - 1 for i in hf],
        "engine_default": default,
        "in_config": not default,
    }


def _check_aux_ids(ids: tuple[int, ...], num_layers: int) -> None:
    try:
        check_engine_aux_ids(ids, num_layers)
    except DraftConfigError as e:
        raise ExportError(str(e)) from e


# --------------------------------------------------------------------------------------- validation
def _expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    a = "midlayer.self_attn."
    m = "midlayer.mlp."
    return {
        "fc.weight": (h, cfg.fc_in_features),
        a + "q_proj.weight": (q, 2 * h),
        a + "k_proj.weight": (kv, 2 * h),
        a + "v_proj.weight": (kv, 2 * h),
        a + "o_proj.weight": (h, q),
        m + "gate_proj.weight": (inter, h),
        m + "up_proj.weight": (inter, h),
        m + "down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


_QKV = {f"midlayer.self_attn.{p}_proj.weight" for p in "qkv"}


def _check_tensors(tensors: Mapping[str, torch.Tensor], cfg: Eagle3Config) -> None:
    """Names exactly the engine set, shapes consistent with ``cfg``, finite floats, a valid vocab map."""
    expected = _expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ExportError(
            f"tensor names differ from the engine set: missing {missing}, unexpected {unexpected}"
        )
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got == shape:
            continue
        if name == "fc.weight":
            raise ExportError(
                f"fc width mismatch: fc.weight is {list(got)}, expected {list(shape)} = [hidden_size, "
                f"len(aux_layer_ids)·target_hidden_size = {len(cfg.aux_layer_ids)}·{cfg.target_hidden_size}]"
            )
        if name in _QKV:
            raise ExportError(
                f"{name} is {list(got)}, expected {list(shape)} (q/k/v read 2·hidden_size inputs)"
            )
        if name == "lm_head.weight":
            raise ExportError(
                f"lm_head.weight is {list(got)}, expected [draft_vocab_size, hidden_size] = {list(shape)}"
            )
        raise ExportError(f"{name} has shape {list(got)}, expected {list(shape)}")
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ExportError(f"non-finite values (NaN/Inf) in {name}")
    try:
        check_d2t(tensors["d2t"].cpu(), tensors["t2d"].cpu())
    except ValueError as e:
        raise ExportError(f"d2t/t2d: {e}") from e


def _target_rope(tc: Any) -> dict[str, Any]:
    """The target's RoPE as a transformers-5 ``rope_parameters`` dict (also from 4.x rope_theta/rope_scaling)."""
    rp = getattr(tc, "rope_parameters", None)
    if rp:
        return dict(rp)
    scaling = dict(getattr(tc, "rope_scaling", None) or {})
    out: dict[str, Any] = {
        "rope_type": scaling.pop("rope_type", scaling.pop("type", "default")),
        "rope_theta": float(getattr(tc, "rope_theta", 10000.0)),
    }
    out.update(scaling)
    return out


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _rope_mismatch(draft: Mapping[str, Any], target: Mapping[str, Any]) -> list[str]:
    d = {k: v for k, v in draft.items() if v is not None}
    t = {k: v for k, v in target.items() if v is not None}
    return sorted(k for k in set(d) | set(t) if k not in d or k not in t or not _same_value(d[k], t[k]))


def validate_draft(draft: Eagle3Draft, target_config: Any) -> None:
    """Raise ExportError unless ``draft`` is a loadable EAGLE-3 head for ``target_config``.

    Checks: aux ids (distinct, ascending, three, capturable), target hidden/vocab/layers, RoPE equal to the
    target's, ``max_position_embeddings`` ≥ the target's, engine tensor names and shapes, finite weights,
    d2t/t2d semantics.
    """
    cfg = draft.cfg
    n_layers = int(target_config.num_hidden_layers)
    _check_aux_ids(tuple(cfg.aux_layer_ids), n_layers)
    if cfg.target_hidden_size != int(target_config.hidden_size):
        raise ExportError(
            f"hidden size mismatch: draft target_hidden_size {cfg.target_hidden_size} != target hidden_size "
            f"{target_config.hidden_size}"
        )
    if cfg.vocab_size != int(target_config.vocab_size):
        raise ExportError(
            f"vocab size mismatch: draft vocab_size {cfg.vocab_size} != target vocab_size {target_config.vocab_size}"
        )
    if cfg.target_num_layers != n_layers:
        raise ExportError(
            f"num layers mismatch: draft was built for a {cfg.target_num_layers}-layer target, this target has "
            f"{n_layers}"
        )
    target_max = int(target_config.max_position_embeddings)
    if cfg.max_position_embeddings < target_max:
        raise ExportError(
            f"max_position_embeddings {cfg.max_position_embeddings} is smaller than the target's {target_max}: "
            f"acceptance collapses past it"
        )
    diff = _rope_mismatch(cfg.rope_parameters, _target_rope(target_config))
    if diff:
        raise ExportError(
            f"rope mismatch in {diff}: draft {cfg.rope_parameters} vs target {_target_rope(target_config)}"
        )
    if cfg.hidden_act != "silu":
        raise ExportError(f"hidden_act {cfg.hidden_act!r}: engines run silu")
    _check_tensors(draft.engine_state_dict(), cfg)


# --------------------------------------------------------------------------------------- config.json
def _rope_fields(rope: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta (transformers 4 and engines), rope_scaling when not default, rope_parameters (transformers 5)."""
    if "rope_theta" not in rope:
        raise ExportError(f"rope_parameters {dict(rope)} has no rope_theta")
    out: dict[str, Any] = {"rope_theta": float(rope["rope_theta"])}
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_parameters"] = dict(rope)
    return out


def block_config_fields(cfg: Any) -> dict[str, Any]:
    """config.json's shape fields of a Llama decoder block (Eagle3Config or MTPConfig), in HF's names."""
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        **_rope_fields(cfg.rope_parameters),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
    }


def special_token_ids(target_config: Any) -> dict[str, Any]:
    """The target's bos/eos token ids that it sets (config.json copies them)."""
    return {key: value for key in ("bos_token_id", "eos_token_id")
            if (value := getattr(target_config, key, None)) is not None}


def _llama_fields(cfg: Eagle3Config, target_config: Any, dtype_name: str) -> dict[str, Any]:
    """The Llama decoder-layer fields both dialects carry (top level for HF, transformer_layer_config else)."""
    fields: dict[str, Any] = {
        "model_type": "llama",
        "num_hidden_layers": 1,
        **block_config_fields(cfg),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        **special_token_ids(target_config),
    }
    return fields


def hf_config(cfg: Eagle3Config, target_config: Any, dtype_name: str) -> dict[str, Any]:
    """config.json in the HF dialect that vLLM and SGLang load as ``LlamaForCausalLMEagle3``.

    Non-default aux ids are written twice, each where and how its engine reads them (checked in source):
    - vLLM ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py::get_eagle3_aux_layers_from_config`` reads the
      top-level ``hf_config.eagle_aux_hidden_state_layer_ids`` (id k = HF hidden_states[k]); a nested
      ``eagle_config`` is consulted only for ``layer_ids`` / ``use_aux_hidden_state``, never for these ids.
    - SGLang ``srt/model_executor/model_runner.py`` reads
      ``draft hf_config.eagle_config["eagle_aux_hidden_state_layer_ids"]`` and its models'
      ``set_eagle3_layers_to_capture`` add one to each id ("for the ith layer, it takes the output of the
      (i-1)th layer"), so the nested copy holds k-1.
    """
    aux = aux_id_conventions(cfg.aux_layer_ids, cfg.target_num_layers)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        **_llama_fields(cfg, target_config, dtype_name),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
    }
    if aux["in_config"]:
        out["eagle_aux_hidden_state_layer_ids"] = aux["vllm"]
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux["sglang"]}
    return out


def speculators_config(
    cfg: Eagle3Config,
    target_config: Any,
    dtype_name: str,
    target_name: str,
    speculative_tokens: int,
) -> dict[str, Any]:
    """config.json in the speculators dialect (vLLM loads it natively).

    Field names checked against vLLM ``transformers_utils/configs/speculators/base.py`` (requires
    ``speculators_model_type``, ``transformer_layer_config`` dict, ``speculators_config.proposal_methods[0]
    .speculative_tokens``, ``speculators_config.verifier.name_or_path``) and ``.../algos.py::update_eagle3``
    (reads top-level ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` and
    ``norm_before_residual`` — defaulting the latter to True, hence written explicitly), and against
    speculators ``models/eagle3/config.py`` (``architectures: ["Eagle3Speculator"]``) / ``config.py``
    (``algorithm``, ``proposal_methods``, ``default_proposal_method``, ``verifier{name_or_path,
    architectures}``; greedy proposals carry ``speculative_tokens``, ``verifier_accept_k``,
    ``accept_tolerance``).
    """
    aux = aux_id_conventions(cfg.aux_layer_ids, cfg.target_num_layers)
    out: dict[str, Any] = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _llama_fields(cfg, target_config, dtype_name),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": target_name,
                "architectures": list(getattr(target_config, "architectures", None) or []),
            },
        },
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": False,
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": dtype_name,
    }
    if aux["in_config"]:
        out["eagle_aux_hidden_state_layer_ids"] = aux["vllm"]
    return out


# --------------------------------------------------------------------------------------- file helpers
def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _digest(path: Path) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file, streamed."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item") and callable(obj.item):  # torch / numpy scalars
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=_json_default) + "\n"


def _engine_tensors(draft: Eagle3Draft, dtype: torch.dtype, dialect: Dialect) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in draft.engine_state_dict().items():
        t = t.detach().to("cpu")
        if name == "d2t":
            t = t.to(torch.long)
        elif name == "t2d":
            t = t.to(torch.bool)
        else:
            t = t.to(dtype)
            if not bool(torch.isfinite(t).all()):
                raise ExportError(f"non-finite values (NaN/Inf) in {name} after casting to {dtype}")
        if dialect == "speculators" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer.") :]
        out[name] = t.contiguous()
    return out


def _publish_dir(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the complete ``tmp`` folder to ``out_dir``; with ``overwrite``, swap out the old one."""
    parent = out_dir.parent
    if not os.path.lexists(out_dir):
        os.replace(tmp, out_dir)
        _fsync_path(parent)
        return
    if not overwrite:
        raise ExportError(f"{out_dir} already exists; pass overwrite=True to replace it")
    # No atomic directory exchange in the stdlib: rename the old one away first.  A crash between the two
    # renames leaves no out_dir (and a complete ``.old-*`` folder), never a half-written one.
    old = parent / f".old-{out_dir.name}-{uuid.uuid4().hex[:8]}"
    os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old, out_dir)
        raise
    _fsync_path(parent)
    shutil.rmtree(old, ignore_errors=True)


def check_destination(out_dir: Path, overwrite: bool, extra_manifest: dict[str, Any] | None,
                      reserved: set[str]) -> None:
    """Refuse an ``out_dir`` that exists (unless ``overwrite`` and it is a real folder) and
    ``extra_manifest`` keys that would shadow the manifest's own ``reserved`` keys."""
    if os.path.lexists(out_dir):
        if not overwrite:
            raise ExportError(f"{out_dir} already exists; pass overwrite=True to replace it")
        if not out_dir.is_dir() or out_dir.is_symlink():
            raise ExportError(f"{out_dir} exists and is not a checkpoint folder; refusing to replace it")
    clash = sorted(set(extra_manifest or {}) & reserved)
    if clash:
        raise ExportError(f"extra_manifest keys {clash} would shadow manifest fields")


def draft_manifest(
    identity: dict[str, Any],
    *,
    architecture: str,
    draft_version: int,
    policy_version: int,
    target_name: str,
    target_config: Any,
    aux_layer_ids: dict[str, Any],
    draft_vocab_size: int,
    tokenizer_fingerprint: str,
    dtype_name: str,
    metrics: dict[str, Any],
    head_config: dict[str, Any],
    extra_manifest: dict[str, Any] | None,
) -> dict[str, Any]:
    """A published draft's manifest: ``identity`` (format, format_version and the dialect or layout) first,
    then provenance and the target's shape, ``head_config`` (``{"eagle3_config": …}`` or
    ``{"mtp_config": …}``) and ``extra_manifest`` last; ``files`` is filled in by :func:`publish_folder`."""
    return {
        **identity,
        "architecture": architecture,
        "files": {},
        "draft_version": int(draft_version),
        "policy_version": int(policy_version),
        "target": {
            "name": target_name,
            "num_hidden_layers": int(target_config.num_hidden_layers),
            "hidden_size": int(target_config.hidden_size),
            "vocab_size": int(target_config.vocab_size),
            "max_position_embeddings": int(target_config.max_position_embeddings),
        },
        "aux_layer_ids": aux_layer_ids,
        "draft_vocab_size": draft_vocab_size,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "draft_align_version": draft_align.__version__,
        "dtype": dtype_name,
        "metrics": metrics,
        **head_config,
        **(extra_manifest or {}),
    }


def publish_folder(
    out_dir: Path,
    tensors: dict[str, torch.Tensor],
    manifest: dict[str, Any],
    *,
    weights_file: str = WEIGHTS_FILE,
    config: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> None:
    """Write ``config`` (config.json, when given), ``tensors`` (``weights_file``) and ``manifest``
    (manifest.json, with each file's sha256 and size under ``files``) into a temp folder beside ``out_dir``,
    fsync'd, then rename it into place: ``out_dir`` appears complete or not at all."""
    try:
        config_text = None if config is None else _dumps(config)
        _dumps(manifest)  # fail on unserialisable metrics before touching the disk
    except (TypeError, ValueError) as e:
        raise ExportError(f"manifest/config not JSON serialisable: {e}") from e
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; engines may run as another user
        names = [weights_file]
        if config_text is not None:
            _write_text(tmp / CONFIG_FILE, config_text)
            names.insert(0, CONFIG_FILE)
        safetensors.torch.save_file(tensors, str(tmp / weights_file), metadata={"format": "pt"})
        _fsync_path(tmp / weights_file)
        for name in names:
            sha, size = _digest(tmp / name)
            manifest["files"][name] = {"sha256": sha, "bytes": size}
        _write_text(tmp / MANIFEST_FILE, _dumps(manifest))
        _fsync_path(tmp)
        _publish_dir(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------------------- export
_RESERVED = {
    "format", "format_version", "dialect", "architecture", "files", "draft_version", "policy_version",
    "target", "aux_layer_ids", "draft_vocab_size", "tokenizer_fingerprint", "created", "draft_align_version",
    "dtype", "metrics", "eagle3_config",
}  # fmt: skip


def export_draft(
    draft: Eagle3Draft,
    out_dir: Path,
    *,
    dialect: Dialect = "hf",
    target_config: Any,
    target_name: str,
    metrics: dict[str, Any],
    draft_version: int,
    policy_version: int,
    tokenizer_fingerprint: str,
    dtype: torch.dtype = torch.bfloat16,
    extra_manifest: dict[str, Any] | None = None,
    overwrite: bool = False,
    speculative_tokens: int = 3,
) -> Path:
    """Write ``draft`` as an engine-loadable folder at ``out_dir`` and return ``out_dir``.

    ``target_config``: the target's HF config (num_hidden_layers, hidden_size, vocab_size,
    max_position_embeddings, RoPE fields).  Floating tensors are stored in ``dtype``; d2t int64, t2d bool.
    Everything is validated before anything is written; the folder appears atomically (temp + rename).
    ``extra_manifest`` keys are merged into the manifest's top level (they may not shadow its own keys).
    ``speculative_tokens`` is the speculators dialect's default proposal length.
    An MTP head (``shares_target_head``) is written by :func:`mtp_export.export_mtp_draft` in its own layout.
    LoRA adapters are merged first (engines load plain weights).
    """
    from draft_align.heads.lora import is_lora, merged

    if is_lora(draft):
        draft = merged(draft)
    if draft.shares_target_head:
        from draft_align.publish.mtp_export import export_mtp_draft

        if dialect != "hf":
            raise ExportError(f"dialect {dialect!r} is an EAGLE-3 dialect: an MTP head is written in its own layout")
        return export_mtp_draft(
            draft, out_dir, target_config=target_config, target_name=target_name, metrics=metrics,  # type: ignore[arg-type]
            draft_version=draft_version, policy_version=policy_version,
            tokenizer_fingerprint=tokenizer_fingerprint, dtype=dtype, extra_manifest=extra_manifest,
            overwrite=overwrite,
        )
    out_dir = Path(out_dir)
    if dialect not in ("hf", "speculators"):
        raise ExportError(f"unknown dialect {dialect!r}: expected 'hf' or 'speculators'")
    if dtype not in _DTYPES:
        raise ExportError(f"dtype {dtype} not supported: use one of {list(_DTYPES)}")
    check_destination(out_dir, overwrite, extra_manifest, _RESERVED)
    validate_draft(draft, target_config)

    dtype_name = _DTYPES[dtype]
    cfg = dataclasses.replace(draft.cfg, torch_dtype=dtype_name)
    if dialect == "hf":
        config = hf_config(cfg, target_config, dtype_name)
    else:
        config = speculators_config(cfg, target_config, dtype_name, target_name, speculative_tokens)
    tensors = _engine_tensors(draft, dtype, dialect)
    aux = aux_id_conventions(cfg.aux_layer_ids, cfg.target_num_layers)
    manifest = draft_manifest(
        {"format": FORMAT, "format_version": FORMAT_VERSION, "dialect": dialect},
        architecture=config["architectures"][0], draft_version=draft_version, policy_version=policy_version,
        target_name=target_name, target_config=target_config,
        aux_layer_ids={
            **aux,
            "note": "hf = HF hidden_states indices = vLLM ids; SGLang reads ids k-1 (it adds one). "
            "in_config false: config.json omits them and both engines use their default (2, L//2, L-3).",
        },
        draft_vocab_size=cfg.draft_vocab_size, tokenizer_fingerprint=tokenizer_fingerprint, dtype_name=dtype_name,
        metrics=metrics, head_config={"eagle3_config": cfg.to_dict()}, extra_manifest=extra_manifest,
    )
    publish_folder(out_dir, tensors, manifest, config=config, overwrite=overwrite)
    return out_dir


# --------------------------------------------------------------------------------------- load
def read_manifest(path: Path, *, verify: bool = True) -> dict[str, Any]:
    """The manifest of checkpoint folder ``path``; with ``verify``, every listed file's size and sha256.

    Raises CorruptCheckpointError when the manifest is missing or unparsable, or a file is missing,
    truncated or modified.
    """
    path = Path(path)
    mpath = path / MANIFEST_FILE
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CorruptCheckpointError(
            f"{mpath} is missing: half-written or not a draft_align checkpoint"
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(
            f"{mpath} is unparsable ({e}): half-written or not a draft_align checkpoint"
        ) from e
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, MTP_FORMAT):
        raise CorruptCheckpointError(f"{mpath}: not a draft_align checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{mpath}: format_version {manifest.get('format_version')} unsupported")
    files = manifest.get("files")
    if not isinstance(files, dict) or not {CONFIG_FILE, WEIGHTS_FILE} <= set(files):
        raise CorruptCheckpointError(f"{mpath}: files must list {CONFIG_FILE} and {WEIGHTS_FILE}")
    if verify:
        for name, info in files.items():
            if Path(name).name != name:
                raise CorruptCheckpointError(f"{mpath}: file name {name!r} is not a plain name")
            fpath = path / name
            if not fpath.is_file():
                raise CorruptCheckpointError(f"{name} is listed in the manifest but missing from {path}")
            sha, size = _digest(fpath)
            if size != info.get("bytes"):
                raise CorruptCheckpointError(
                    f"{name}: {size} bytes, manifest says {info.get('bytes')} (truncated or modified)"
                )
            if sha != info.get("sha256"):
                raise CorruptCheckpointError(
                    f"{name}: sha256 mismatch with the manifest (corrupt or modified)"
                )
    return manifest


def _engine_name(name: str) -> str:
    """speculators' ``layers.0.*`` → our ``midlayer.*``."""
    return "midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name


def load_draft(
    path: Path,
    *,
    verify: bool = True,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Rebuild the draft saved at ``path`` (either dialect); returns (module, manifest).

    The module is built on the ``meta`` device and the checkpoint tensors are assigned to it (float
    tensors cast to ``dtype``; d2t int64, t2d bool), then moved to ``device``.  An MTP draft's folder
    (manifest format ``draft_align.mtp``) is rebuilt by :func:`mtp_export.load_mtp_draft`.
    """
    path = Path(path)
    manifest = read_manifest(path, verify=verify)
    if manifest.get("format") == MTP_FORMAT:
        from draft_align.publish.mtp_export import load_mtp_draft

        return load_mtp_draft(path, verify=False, device=device, dtype=dtype)  # type: ignore[return-value]
    try:
        cfg = Eagle3Config.from_dict(dict(manifest["eagle3_config"]))
    except (KeyError, TypeError, DraftConfigError) as e:
        raise ExportError(f"{path / MANIFEST_FILE}: eagle3_config unusable: {e}") from e
    try:
        raw = safetensors.torch.load_file(str(path / WEIGHTS_FILE), device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated headers / data
        raise CorruptCheckpointError(f"{WEIGHTS_FILE}: unreadable ({e}); truncated or corrupt") from e
    tensors = {_engine_name(k): v for k, v in raw.items()}
    _check_tensors(tensors, cfg)
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    draft.load_state_dict(state, strict=True, assign=True)
    draft.rotary = Rotary(cfg)  # non-persistent RoPE buffers were built on meta; recompute them for real
    draft.to(device)
    return draft, manifest


# --------------------------------------------------------------------------------------- compatibility
def check_compatible(
    manifest: Mapping[str, Any], target_config: Any, tokenizer_fingerprint: str | None
) -> None:
    """Raise ExportError unless the draft described by ``manifest`` fits ``target_config``.

    Checks hidden size, vocab size, max_position_embeddings, that the aux layers are capturable on this
    target's depth (and, when config.json relies on the engines' default ids, that the default for this depth
    is what the draft was trained on), and the tokenizer fingerprint when one is given.
    """
    if manifest.get("format") == MTP_FORMAT:
        from draft_align.publish.mtp_export import check_mtp_compatible

        check_mtp_compatible(manifest, target_config, tokenizer_fingerprint)
        return
    target = manifest["target"]
    hidden, vocab = int(target_config.hidden_size), int(target_config.vocab_size)
    if int(target["hidden_size"]) != hidden:
        raise ExportError(
            f"hidden size mismatch: draft trained for {target['hidden_size']}, target has {hidden}"
        )
    if int(target["vocab_size"]) != vocab:
        raise ExportError(
            f"vocab size mismatch: draft trained for {target['vocab_size']}, target has {vocab}"
        )
    draft_max = int(manifest["eagle3_config"]["max_position_embeddings"])
    target_max = int(target_config.max_position_embeddings)
    if draft_max < target_max:
        raise ExportError(f"max_position_embeddings {draft_max} is smaller than the target's {target_max}")
    n_layers = int(target_config.num_hidden_layers)
    aux = manifest["aux_layer_ids"]
    ids = [int(i) for i in aux["hf"]]
    bad = [i for i in ids if not 1 <= i <= n_layers - 1]
    if bad:
        raise ExportError(
            f"num layers mismatch: aux_layer_ids {ids} out of range for a {n_layers}-layer target "
            f"(capturable: 1..{n_layers - 1})"
        )
    default = list(Eagle3Config.default_aux_layer_ids(n_layers))
    if not aux["in_config"] and default != ids:
        raise ExportError(
            f"num layers mismatch: config.json relies on the engines' default aux layers, which for a "
            f"{n_layers}-layer target are {default}, but the draft was trained on {ids}"
        )
    if tokenizer_fingerprint is not None and tokenizer_fingerprint != manifest["tokenizer_fingerprint"]:
        raise ExportError(
            f"tokenizer fingerprint mismatch: draft {manifest['tokenizer_fingerprint']}, "
            f"target {tokenizer_fingerprint}"
        )


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """First 16 hex chars of sha256 over the sorted (token, id) vocabulary plus the special tokens and roles."""
    vocab = sorted((str(tok), int(i)) for tok, i in tokenizer.get_vocab().items())
    special = sorted(str(t) for t in (getattr(tokenizer, "all_special_tokens", None) or []))
    roles = getattr(tokenizer, "special_tokens_map", None) or {}
    payload = json.dumps(
        {"vocab": vocab, "special_tokens": special, "special_tokens_map": roles},
        sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str,
    )  # fmt: skip
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


# --------------------------------------------------------------------------------------- versions
def version_dir(run_dir: Path, version: int) -> Path:
    """``run_dir/drafts/v{version:04d}``."""
    return Path(run_dir) / DRAFTS_DIR / f"v{int(version):04d}"


def next_version(run_dir: Path) -> int:
    """One more than the highest ``drafts/vNNNN`` folder (1 when there is none; ``.tmp-*`` are ignored)."""
    drafts = Path(run_dir) / DRAFTS_DIR
    if not drafts.is_dir():
        return 1
    found = [int(m.group(1)) for p in drafts.iterdir() if p.is_dir() and (m := _VERSION_RE.match(p.name))]
    return max(found, default=0) + 1


def write_latest(run_dir: Path, version_dir: Path) -> None:
    """Point ``run_dir/latest`` at ``version_dir`` (which must be a checkpoint inside ``run_dir``).

    ``latest`` is a one-line text file holding the folder's path relative to ``run_dir``, replaced
    atomically (temp file + fsync + ``os.replace``).  A symlink is not used: symlinks are fragile across
    filesystems (object-store mounts, some network filesystems, copies to another machine or into a
    container at another path) and a relative text pointer survives all of them.
    """
    run_dir, version_dir = Path(run_dir), Path(version_dir)
    try:
        rel = version_dir.resolve().relative_to(run_dir.resolve())
    except ValueError as e:
        raise ExportError(f"{version_dir} is not inside {run_dir}") from e
    if not (version_dir / MANIFEST_FILE).is_file():
        raise ExportError(f"{version_dir} is not a published checkpoint (no {MANIFEST_FILE})")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{LATEST_FILE}.tmp-", dir=run_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(rel.as_posix() + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, run_dir / LATEST_FILE)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    _fsync_path(run_dir)


def read_latest(run_dir: Path) -> Path | None:
    """The folder ``run_dir/latest`` names, or None when nothing has been published yet."""
    run_dir = Path(run_dir)
    try:
        text = (run_dir / LATEST_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    rel = Path(text)
    if not text or rel.is_absolute() or ".." in rel.parts:
        raise ExportError(
            f"{run_dir / LATEST_FILE} holds {text!r}: expected a folder path relative to {run_dir}"
        )
    target = run_dir / rel
    if not target.is_dir():
        raise ExportError(f"{run_dir / LATEST_FILE} names {text!r}, which does not exist")
    return target


def resolve_draft_dir(path: Path) -> Path:
    """A published draft folder, or the folder a run folder's ``latest`` names (ExportError otherwise)."""
    path = Path(path)
    if (path / MANIFEST_FILE).is_file():
        return path
    latest = read_latest(path) if path.is_dir() else None
    if latest is None:
        raise ExportError(f"{path} is neither a draft folder (no {MANIFEST_FILE}) nor a run with a `latest`")
    return latest
