"""The native MTP format: a model's own MTP layers (``heads/native_mtp.py``) written under the family's own
tensor names, in a folder vLLM's MTP drafter loads as ``speculative_config={"method": "mtp", "model": folder}``
(docs/mtp.md).

The folder holds the target's own ``config.json`` (vLLM derives the drafter's config from it:
``MiMoForCausalLM`` → ``MiMoMTPModel``, ``Glm4MoeForCausalLM`` → ``Glm4MoeMTPModel``), ``model.safetensors``
with the MTP tensors plus the two the drafter shares with the target (``model.embed_tokens.weight``, and
``lm_head.weight`` for a family without a per-depth head copy: vLLM's loader refuses a draft folder that leaves
any drafter parameter unwritten), and ``manifest.json`` (format ``draft_align.native_mtp``, the family, sha256
of both files).  The head carries the target's embedding (a frozen buffer) and head for this.  A hot
refresh (``engines/vllm/worker_rpc.rpc_load_draft``) loads only the MTP tensors, never the shared ones.

:func:`from_target_checkpoint` builds the head from a target checkpoint folder (its safetensors, where
transformers leaves the MTP tensors it drops when it loads the trunk).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from draft_align.heads.draft_head import DraftConfigError
from draft_align.heads.native_mtp import (
    EMBED,
    NativeMTPConfig,
    NativeMTPDraft,
    StepsRun,
    family_of,
    from_checkpoint,
    to_checkpoint,
)
from draft_align.publish.folder import (
    CONFIG_FILE,
    MANIFEST_FILE,
    NATIVE_MTP_FORMAT,
    RESERVED_KEYS,
    CorruptCheckpointError,
    ExportError,
    ExportRequest,
    check_destination,
    check_finite,
    draft_manifest,
    final_hidden_aux,
    plain_file,
    publish_folder,
    read_head_config,
    read_weights,
    stored_itemsize,
)
from draft_align.publish.formats import HeadFormat, TapCapture, check_built_for, refuse_dialect

NATIVE_MTP_FORMAT_VERSION = 1
LM_HEAD = "lm_head.weight"


def shared_names(draft: NativeMTPDraft) -> tuple[str, ...]:
    """The target tensors the drafter shares and vLLM's loader still wants in the folder."""
    return (EMBED,) if draft.cfg.spec.head is not None else (EMBED, LM_HEAD)


def engine_tensors(draft: NativeMTPDraft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The MTP tensors under the family's names plus the shared ones (the head's copies of the target's
    embedding and lm_head), cast to ``dtype``: exactly what model.safetensors holds."""
    out = draft.checkpoint_tensors()  # the transformers- or megatron-core-built head alike
    shared = {EMBED: draft.embed_tokens, LM_HEAD: draft.lm_head.weight}
    for name in shared_names(draft):
        out[name] = shared[name]
    cast = {k: t.detach().to(dtype).contiguous() for k, t in out.items()}
    # one tensor under several names (GLM/DeepSeek at depth ≥ 2: every shared_head.head is the lm_head) would be
    # refused by safetensors when no cast copied it: each name gets its own storage
    seen: set[int] = set()
    for k, t in cast.items():
        if t.data_ptr() in seen:
            cast[k] = t.clone()
        seen.add(t.data_ptr())
    return cast


def write_native_mtp(draft: NativeMTPDraft, out_dir: Path, req: ExportRequest) -> dict[str, Any]:
    """Write ``draft`` at ``out_dir`` (atomically) for vLLM's MTP drafter; returns the manifest.

    ``req.target_config`` must be the HF config the head was built from (same family, layers, hidden size,
    vocabulary): it becomes the folder's config.json.
    """
    out_dir = Path(out_dir)
    check_destination(
        out_dir, req.overwrite, req.extra_manifest, RESERVED_KEYS | {"family", "native_mtp_config"}
    )
    ours = NativeMTPConfig.from_target(req.target_config)
    cfg = draft.cfg
    for key in ("family", "depth", "target_num_layers", "hidden_size", "vocab_size"):
        if getattr(ours, key) != getattr(cfg, key):
            raise ExportError(
                f"target config has {key}={getattr(ours, key)}, the MTP head was built for {getattr(cfg, key)}"
            )
    refuse_dialect(req, "a native MTP head is written under its model's names")
    tensors = engine_tensors(draft, req.dtype)
    for name, t in tensors.items():
        check_finite(name, t, req.dtype)
    config = req.target_config.to_dict()
    config["torch_dtype"] = str(req.dtype).removeprefix("torch.")
    manifest = draft_manifest(
        {"format": NATIVE_MTP_FORMAT, "format_version": NATIVE_MTP_FORMAT_VERSION, "family": cfg.family},
        req,
        architecture=cfg.spec.architecture,
        aux_layer_ids=final_hidden_aux(cfg.aux_layer_ids),
        draft_vocab_size=cfg.vocab_size,
        head_config={
            "native_mtp_config": {"family": cfg.family, "depth": cfg.depth, "steps_run": cfg.steps_run}
        },
    )
    publish_folder(out_dir, tensors, manifest, config=config, overwrite=req.overwrite)
    return manifest


def _folder_config(path: Path, steps_run: StepsRun = "first") -> NativeMTPConfig:
    from transformers import AutoConfig

    try:
        target = AutoConfig.from_pretrained(path / CONFIG_FILE)
        return NativeMTPConfig.from_target(target, steps_run=steps_run)
    except DraftConfigError as e:
        raise ExportError(f"{path}: {e}") from e


def weights_data_bytes(path: Path, manifest: Mapping[str, Any]) -> int:
    """The tensor bytes model.safetensors holds for the folder's config.json (head built on the meta device)."""
    with torch.device("meta"):
        draft = NativeMTPDraft(_folder_config(Path(path)))
    mtp = sum(math.prod(t.shape) for t in to_checkpoint(draft).values())
    shared = len(shared_names(draft)) * draft.cfg.vocab_size * draft.cfg.hidden_size
    return (mtp + shared) * stored_itemsize(path, manifest)


def load_native_mtp(
    path: Path,
    manifest: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> NativeMTPDraft:
    """The head published at ``path`` (its config.json, MTP and shared tensors); ``manifest``: already read;
    ``weights``: model.safetensors' verified tensors (None: read)."""
    path = Path(path)
    if manifest is None:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    if manifest.get("format") != NATIVE_MTP_FORMAT:
        raise ExportError(
            f"{path / MANIFEST_FILE}: format {manifest.get('format')!r} is not {NATIVE_MTP_FORMAT}"
        )
    head = read_head_config(path, manifest, "native_mtp_config", dict)
    cfg = _folder_config(path, head.get("steps_run", "first"))
    if head.get("family") != cfg.family or head.get("depth") != cfg.depth:
        raise ExportError(
            f"{path / MANIFEST_FILE}: native_mtp_config {head} does not match config.json "
            f"(family {cfg.family}, depth {cfg.depth})"
        )
    try:
        tensors = read_weights(path) if weights is None else dict(weights)
        return from_checkpoint(cfg, tensors, dtype=dtype).to(device)
    except DraftConfigError as e:
        raise ExportError(f"{path}: {e}") from e


def check_target(manifest: Mapping[str, Any], target_config: Any) -> None:
    """ExportError unless the MTP layers ``manifest`` describes are this target's: its architecture, hidden
    size, vocab size and depth."""
    target = manifest["target"]
    arch = (getattr(target_config, "architectures", None) or ["?"])[0]
    if manifest.get("architecture") != arch:
        raise ExportError(
            f"architecture mismatch: the MTP layers are {manifest.get('architecture')}'s, the target is {arch}"
        )
    check_built_for(
        "MTP layers built for",
        tuple(
            (what, target[key], int(getattr(target_config, key)))
            for what, key in (
                ("hidden size", "hidden_size"),
                ("vocab size", "vocab_size"),
                ("num layers", "num_hidden_layers"),
            )
        ),
    )


def tap_capture(path: Path, manifest: Mapping[str, Any]) -> TapCapture:
    """A model's own MTP layers read the final hidden state (HF index L) and propose over the full target
    vocabulary: both from the manifest's ``target``, no weights read."""
    target = dict(manifest["target"])
    vocab, layers = int(target["vocab_size"]), int(target["num_hidden_layers"])
    return (layers,), torch.arange(vocab)


def from_target_checkpoint(
    model_dir: Path,
    target_config: Any,
    dtype: torch.dtype = torch.float32,
    steps_run: StepsRun = "first",
    impl: str = "transformers",
) -> NativeMTPDraft:
    """The head with the MTP layers of the target checkpoint at ``model_dir`` (its ``*.safetensors``; only the
    MTP tensors, the lm_head and the embedding are read), built with transformers' layers or (``impl``
    "megatron") megatron-core's MTP layers.  One-line errors: a family not supported, a config with no MTP
    layers, a folder without safetensors or without MTP tensors, a tensor the config does not imply (hidden
    size, vocabulary); for megatron, megatron-core missing or a layer it is not mapped for."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = NativeMTPConfig.from_target(target_config, steps_run=steps_run)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise DraftConfigError(
            f"{model_dir}: no *.safetensors files: the native MTP head is read from the target checkpoint's "
            f"safetensors (set target.model to a local checkpoint folder)"
        )
    fam, n = cfg.spec, cfg.target_num_layers
    prefixes = tuple(fam.prefix.format(d=d, n=n + d) for d in range(cfg.depth))
    tensors: dict[str, torch.Tensor] = {}
    found_in: dict[str, str] = {}
    for f in files:
        try:
            plain_file(model_dir, f.name)  # a regular file (a FIFO would block the read), no link out
        except (CorruptCheckpointError, OSError) as e:
            raise DraftConfigError(f"{f}: {e}") from None
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                    if k.startswith(prefixes) or k in (EMBED, LM_HEAD):
                        if k in found_in:  # a later shard must not silently replace a tensor
                            raise DraftConfigError(
                                f"{k} is in both {found_in[k]} and {f.name}: which one is meant?"
                            )
                        found_in[k] = f.name
                        tensors[k] = fh.get_tensor(k)
                        if tensors[k].is_floating_point() and not bool(torch.isfinite(tensors[k]).all()):
                            raise DraftConfigError(f"{f.name}: {k} holds NaN or Inf")
        except DraftConfigError:
            raise
        except Exception as e:  # safetensors' own errors: bad header, offsets out of the file...
            raise DraftConfigError(f"{f}: unreadable safetensors ({type(e).__name__}: {e})") from None
    if EMBED in tensors and LM_HEAD not in tensors and getattr(target_config, "tie_word_embeddings", False):
        tensors[LM_HEAD] = tensors[EMBED]
    try:
        if impl == "megatron":
            from draft_align.heads import megatron_mtp

            return megatron_mtp.from_checkpoint(cfg, tensors, dtype=dtype)
        return from_checkpoint(cfg, tensors, dtype=dtype)
    except DraftConfigError as e:
        raise DraftConfigError(f"{model_dir}: {e}") from e


FORMAT = HeadFormat(
    name=NATIVE_MTP_FORMAT,
    kind="native_mtp",
    head=NativeMTPDraft,
    write_head=write_native_mtp,
    head_tensors=engine_tensors,
    load=load_native_mtp,
    weights_data_bytes=weights_data_bytes,
    check_target=check_target,
    tap_capture=tap_capture,
)


__all__ = [
    "FORMAT",
    "NATIVE_MTP_FORMAT",
    "check_target",
    "engine_tensors",
    "family_of",
    "from_target_checkpoint",
    "load_native_mtp",
    "shared_names",
    "tap_capture",
    "weights_data_bytes",
    "write_native_mtp",
]
