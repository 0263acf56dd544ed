"""Adapter-only deltas: the LoRA tensors of a draft trained over a published base, as their own folder.

A delta is a folder (docs/formats.md §4)::

    adapter.safetensors   the LoRA A/B tensors (float32), named by module path
    manifest.json         format draft_align.lora_delta; the base draft's model.safetensors sha256; the
                          LoRA settings; the sha256 of the merged engine weights the loader must rebuild

:func:`load_adapter` re-hashes the base draft, refuses an adapter made for another base
(:class:`AdapterMismatchError`), rebuilds the merged draft and checks its sha256.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from draft_align.conventions import float_dtype
from draft_align.heads.draft_head import DraftConfigError
from draft_align.heads.lora import (
    AdapterMismatchError,
    LoraSettings,
    apply_lora,
    is_lora,
    load_lora_state_dict,
    lora_state_dict,
    merged,
    strip_adapters,
)
from draft_align.publish import engine_sha256, engine_tensors, load_draft, write_draft
from draft_align.publish.folder import (
    MANIFEST_FILE,
    WEIGHTS_FILE,
    ExportRequest,
    digest,
    float_dtype_name,
    publish_folder,
    read_manifest,
    weights_sha256,
)

DELTA_FORMAT = "draft_align.lora_delta"
DELTA_FORMAT_VERSION = 1
ADAPTER_FILE = "adapter.safetensors"


@dataclass
class DeltaInfo:
    """What :func:`export_adapter` wrote."""

    path: Path
    base_sha256: str
    merged_sha256: str
    bytes: int
    extra: dict[str, Any] = field(default_factory=dict)


def _base_sha(base_dir: Path) -> tuple[str, dict[str, Any]]:
    man = read_manifest(Path(base_dir), verify=True)  # re-hashes the base files
    return weights_sha256(man), man


def _rebuild(base_dir: Path, settings: LoraSettings, tensors: dict[str, torch.Tensor]) -> nn.Module:
    base, _ = load_draft(Path(base_dir), verify=False)
    apply_lora(base, settings)
    load_lora_state_dict(base, tensors)
    return merged(base)


def export_adapter(
    draft: nn.Module,
    out_dir: Path,
    base_dir: Path,
    *,
    draft_version: int,
    policy_version: int,
    dtype: torch.dtype = torch.bfloat16,
    metrics: dict[str, Any] | None = None,
) -> DeltaInfo:
    """Write the adapters of ``draft`` (trained over the draft published at ``base_dir``) as a delta folder.

    The base's weights must be the ones the adapters were trained over: the draft's frozen base weights,
    cast to ``dtype``, must equal the base folder's (AdapterMismatchError otherwise, nothing written).
    The recorded merged sha256 is that of base folder + adapters, rebuilt as :func:`load_adapter` does.
    """
    if not is_lora(draft):
        raise DraftConfigError("the draft carries no LoRA adapters")
    settings: LoraSettings = draft.lora_settings  # type: ignore[assignment]  # set by apply_lora
    base_sha, base_man = _base_sha(base_dir)
    unmerged = copy.deepcopy(draft)
    strip_adapters(unmerged)
    mine = engine_tensors(unmerged, dtype)
    theirs = safetensors.torch.load_file(str(Path(base_dir) / WEIGHTS_FILE))
    if set(mine) != set(theirs) or any(not torch.equal(mine[k], theirs[k].to(mine[k].dtype)) for k in mine):
        raise AdapterMismatchError(
            f"the adapters were trained over another base than {base_dir} (its weights differ from the draft's "
            f"frozen base): not written"
        )
    tensors = lora_state_dict(draft)
    merged_sha = engine_sha256(_rebuild(base_dir, settings, tensors), dtype)
    manifest = {
        "format": DELTA_FORMAT,
        "format_version": DELTA_FORMAT_VERSION,
        "base": {
            "sha256": base_sha,
            "draft_version": base_man.get("draft_version"),
            "format": base_man["format"],
        },
        "lora": settings.to_dict(),
        "merged_sha256": merged_sha,
        "dtype": float_dtype_name(dtype),
        "draft_version": int(draft_version),
        "policy_version": int(policy_version),
        "metrics": metrics or {},
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "files": {},
    }
    out_dir = Path(out_dir)
    publish_folder(out_dir, tensors, manifest, weights_file=ADAPTER_FILE)
    size = manifest["files"][ADAPTER_FILE]["bytes"]
    return DeltaInfo(out_dir, base_sha, merged_sha, size)


def read_delta_manifest(delta_dir: Path) -> dict[str, Any]:
    """The delta's manifest, with its adapter file re-hashed (AdapterMismatchError when it differs)."""
    delta_dir = Path(delta_dir)
    try:
        man = json.loads((delta_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise AdapterMismatchError(f"{delta_dir}: no readable manifest.json ({e})") from e
    if man.get("format") != DELTA_FORMAT or man.get("format_version") != DELTA_FORMAT_VERSION:
        raise AdapterMismatchError(f"{delta_dir}: not a {DELTA_FORMAT} v{DELTA_FORMAT_VERSION} folder")
    info = man["files"][ADAPTER_FILE]
    sha, size = digest(delta_dir / ADAPTER_FILE)
    if sha != info["sha256"] or size != info["bytes"]:
        raise AdapterMismatchError(
            f"{delta_dir / ADAPTER_FILE}: sha256/size differ from the manifest (corrupt)"
        )
    return man


def load_adapter(delta_dir: Path, base_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the merged draft of an adapter-only delta over the draft published at ``base_dir``.

    Raises AdapterMismatchError when the base's sha256 is not the one the delta records (an adapter for
    another base), or when the rebuilt merged weights' sha256 differs from the recorded one.
    """
    man = read_delta_manifest(delta_dir)
    base_sha, _ = _base_sha(base_dir)
    if base_sha != man["base"]["sha256"]:
        raise AdapterMismatchError(
            f"adapter {delta_dir} was trained over base draft sha256 {man['base']['sha256'][:16]}…, but "
            f"{base_dir} has {base_sha[:16]}…: refusing to merge it"
        )
    settings = LoraSettings(**dict(man["lora"]))
    tensors = safetensors.torch.load_file(str(Path(delta_dir) / ADAPTER_FILE))
    out = _rebuild(base_dir, settings, tensors)
    got = engine_sha256(out, float_dtype(man.get("dtype", "bfloat16")))
    if got != man["merged_sha256"]:
        raise AdapterMismatchError(
            f"merged weights rebuilt from {delta_dir} hash to {got[:16]}…, the delta records "
            f"{man['merged_sha256'][:16]}…"
        )
    return out, man


def publish_adapter(
    delta_dir: Path,
    base_dir: Path,
    out_dir: Path,
    *,
    target_config: Any,
    target_name: str,
    tokenizer_fingerprint: str,
    metrics: dict[str, Any] | None = None,
) -> Path:
    """Rebuild the merged draft of a delta (:func:`load_adapter`) and publish it as a plain engine-format
    folder; its model.safetensors must hash to the delta's merged sha256 (else the folder is removed)."""
    draft, man = load_adapter(delta_dir, base_dir)
    out = Path(out_dir)
    req = ExportRequest(
        target_config=target_config,
        target_name=target_name,
        metrics=metrics or {},
        draft_version=int(man["draft_version"]),
        policy_version=int(man["policy_version"]),
        tokenizer_fingerprint=tokenizer_fingerprint,
        dtype=float_dtype(man.get("dtype", "bfloat16")),
        extra_manifest={
            "lora_delta": {"base_sha256": man["base"]["sha256"], "merged_sha256": man["merged_sha256"]}
        },
    )
    written = weights_sha256(write_draft(draft, out, req))
    if written != man["merged_sha256"]:
        shutil.rmtree(out, ignore_errors=True)
        raise AdapterMismatchError(
            f"published weights hash to {written[:16]}…, expected {man['merged_sha256'][:16]}…"
        )
    return out
