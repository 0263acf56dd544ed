"""Published drafts: one folder per version that vLLM / SGLang load, checksummed, written atomically.

:func:`export_draft` and :func:`load_draft` look the format up in ``registry``: by the head's ``kind`` when
writing (EAGLE-3 → ``eagle3_format``, MTP → ``mtp_format``, a model's own MTP layers → ``native_mtp_format``),
by the manifest's ``format`` when reading.  The folder mechanics are in ``folder``, run versions and ``latest``
in ``versions``, compatibility checks in ``compat``, adapter-only deltas in ``lora_delta`` (docs/formats.md).

- ``folder.py``: atomic folders, the manifest, verification; ``versions.py``: ``drafts/vNNNN``, ``latest``;
- ``formats.py``: what a format is (``DraftFormat``, ``HeadFormat``); ``registry.py``: the formats by head kind
  and by manifest format;
- ``eagle3_format.py`` (with its ``hf`` and ``speculators`` config dialects), ``mtp_format.py``: the engine
  formats; ``config_json.py``: the config.json fields both write;
- ``compat.py``: whether a draft fits a target; ``tap_spec.py``: what a Tap needs to know of a published draft;
- ``lora_delta.py``: adapter-only deltas;
- ``native_mtp_format.py``: a model's own MTP layers under its own tensor names, the folder vLLM's MTP drafter
  loads (docs/mtp.md);
- ``sglang.py``: SGLang's loader rules as a check; ``sglang_client.py``, ``speculators.py``: those libraries as
  clients of our folders.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from draft_align.heads.draft_head import DraftHead
from draft_align.publish.folder import (
    WEIGHTS_FILE,
    Dialect,
    ExportRequest,
    check_sizes,
    read_manifest,
    read_verified_weights,
    read_weights,
    verify_file,
    verify_files,
)
from draft_align.publish.registry import format_for, format_of


def write_draft(draft: DraftHead, out_dir: Path, req: ExportRequest) -> dict[str, Any]:
    """:func:`export_draft` with its provenance and dialect in one :class:`ExportRequest`; returns the manifest
    as written (``files`` holds each file's sha256 and size).  LoRA adapters are merged first."""
    return format_for(draft).write(draft, Path(out_dir), req)


def export_draft(
    draft: DraftHead,
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
    An MTP head is written in its own layout (``dialect`` must stay ``hf``).
    LoRA adapters are merged first (engines load plain weights).
    """
    req = ExportRequest(
        target_config=target_config,
        target_name=target_name,
        metrics=metrics,
        draft_version=draft_version,
        policy_version=policy_version,
        tokenizer_fingerprint=tokenizer_fingerprint,
        dtype=dtype,
        extra_manifest=extra_manifest,
        overwrite=overwrite,
        dialect=dialect,
        speculative_tokens=speculative_tokens,
    )
    write_draft(draft, out_dir, req)
    return Path(out_dir)


def checked_manifest(path: Path, *, verify: bool = True) -> dict[str, Any]:
    """The manifest of the draft folder ``path`` with every listed file's size checked against what its head
    config implies before anything is hashed (an 8 GiB file is refused at once), no file a link out of the
    folder; with ``verify`` then every file's sha256.  CorruptCheckpointError / ExportError otherwise."""
    path = Path(path)
    manifest = read_manifest(path, verify=False)
    check_sizes(path, manifest, format_of(manifest).weights_data_bytes(path, manifest))
    if verify:
        verify_files(path, manifest)
    return manifest


def load_draft(
    path: Path,
    *,
    verify: bool = True,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, dict[str, Any]]:
    """Rebuild the draft saved at ``path`` (either format, either dialect); returns (module, manifest):
    :func:`load_verified_draft` without the tensors."""
    draft, manifest, _ = load_verified_draft(path, verify=verify, device=device, dtype=dtype)
    return draft, manifest


def load_verified_draft(
    path: Path,
    *,
    verify: bool = True,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, dict[str, Any], dict[str, torch.Tensor]]:
    """(module, manifest, model.safetensors' tensors) of the draft saved at ``path``.

    File sizes are checked against the head config first (:func:`checked_manifest`).  With ``verify``, the
    weights file is read once, its bytes hashed against the manifest and parsed from that very buffer, and the
    module is built from those tensors (verify-then-use: a file swapped after the check is never what loads);
    every other file the manifest lists is hashed too.  The module is built on the ``meta`` device and the
    tensors are assigned to it (float tensors cast to ``dtype``), then moved to ``device``.
    """
    path = Path(path)
    manifest = checked_manifest(path, verify=False)
    if verify:
        weights = read_verified_weights(path, manifest)
        for name, info in manifest["files"].items():
            if name != WEIGHTS_FILE:
                verify_file(path, name, info)
    else:
        weights = read_weights(path)
    draft = format_of(manifest).load(path, manifest, device=device, dtype=dtype, weights=weights)
    return draft, manifest, weights


def engine_tensors(draft: DraftHead, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Exactly the tensors a publish of this (plain) draft writes to model.safetensors (HF dialect);
    DraftConfigError for a draft that still carries LoRA adapters."""
    return format_for(draft).engine_tensors(draft, dtype)


def engine_sha256(draft: DraftHead, dtype: torch.dtype = torch.bfloat16) -> str:
    """sha256 of the model.safetensors a publish of ``draft`` writes (same serializer and metadata)."""
    data = safetensors.torch.save(engine_tensors(draft, dtype), metadata={"format": "pt"})
    return hashlib.sha256(data).hexdigest()


__all__ = [
    "checked_manifest",
    "engine_sha256",
    "engine_tensors",
    "export_draft",
    "load_draft",
    "load_verified_draft",
    "write_draft",
]
