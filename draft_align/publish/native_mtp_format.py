"""The native MTP format: a model's own MTP layers (``heads/native_mtp.py``) written under the family's own
tensor names, in a folder vLLM's MTP drafter loads as ``speculative_config={"method": "mtp", "model": folder}``
(docs/mtp.md).

The folder holds the target's own ``config.json`` (vLLM derives the drafter's config from it:
``MiMoForCausalLM`` → ``MiMoMTPModel``, ``Glm4MoeForCausalLM`` → ``Glm4MoeMTPModel``), ``model.safetensors``
with the MTP tensors plus the two the drafter shares with the target (``model.embed_tokens.weight``, and
``lm_head.weight`` for a family without a per-depth head copy: vLLM's loader refuses a draft folder that leaves
any drafter parameter unwritten), and ``manifest.json`` (format ``draft_align.native_mtp``, the family, sha256
of both files).  A refresh sends only the MTP tensors, never the shared ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from draft_align.heads.eagle3 import DraftConfigError
from draft_align.heads.native_mtp import NativeMTPConfig, NativeMTPDraft, from_checkpoint, to_checkpoint
from draft_align.publish.folder import (
    CONFIG_FILE,
    MANIFEST_FILE,
    RESERVED_KEYS,
    ExportError,
    ExportRequest,
    check_destination,
    check_finite,
    draft_manifest,
    publish_folder,
    read_weights,
)

NATIVE_MTP_FORMAT = "draft_align.native_mtp"
NATIVE_MTP_FORMAT_VERSION = 1
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def shared_names(draft: NativeMTPDraft) -> tuple[str, ...]:
    """The target tensors the drafter shares and vLLM's loader still wants in the folder."""
    return (EMBED,) if draft.cfg.spec.head is not None else (EMBED, LM_HEAD)


def engine_tensors(
    draft: NativeMTPDraft, shared: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The MTP tensors under the family's names plus the shared ones (``shared``: the target's state dict or
    at least :func:`shared_names`), cast to ``dtype``."""
    out = to_checkpoint(draft)
    v, h = draft.cfg.vocab_size, draft.cfg.hidden_size
    for name in shared_names(draft):
        if name not in shared:
            raise ExportError(f"the target's {name} is needed in the draft folder (vLLM loads it there)")
        t = shared[name]
        if tuple(t.shape) != (v, h):
            raise ExportError(f"target {name} has shape {tuple(t.shape)}, the head expects {(v, h)}")
        out[name] = t
    return {k: t.detach().to(dtype).contiguous() for k, t in out.items()}


def write_native_mtp(
    draft: NativeMTPDraft, out_dir: Path, req: ExportRequest, shared: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
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
    tensors = engine_tensors(draft, shared, req.dtype)
    for name, t in tensors.items():
        check_finite(name, t, req.dtype)
    config = req.target_config.to_dict()
    config["torch_dtype"] = str(req.dtype).removeprefix("torch.")
    manifest = draft_manifest(
        {"format": NATIVE_MTP_FORMAT, "format_version": NATIVE_MTP_FORMAT_VERSION, "family": cfg.family},
        req,
        architecture=cfg.spec.architecture,
        aux_layer_ids={
            "hf": list(cfg.aux_layer_ids),
            "note": "MTP reads the final post-norm hidden (HF index L)",
        },
        draft_vocab_size=cfg.vocab_size,
        head_config={"native_mtp_config": {"family": cfg.family, "depth": cfg.depth}},
    )
    publish_folder(out_dir, tensors, manifest, config=config, overwrite=req.overwrite)
    return manifest


def load_native_mtp(path: Path, dtype: torch.dtype = torch.float32) -> NativeMTPDraft:
    """The head published at ``path`` (its config.json and MTP tensors)."""
    from transformers import AutoConfig

    path = Path(path)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    if manifest.get("format") != NATIVE_MTP_FORMAT:
        raise ExportError(
            f"{path / MANIFEST_FILE}: format {manifest.get('format')!r} is not {NATIVE_MTP_FORMAT}"
        )
    try:
        cfg = NativeMTPConfig.from_target(AutoConfig.from_pretrained(path / CONFIG_FILE))
        return from_checkpoint(cfg, read_weights(path), dtype=dtype)
    except DraftConfigError as e:
        raise ExportError(f"{path}: {e}") from e
