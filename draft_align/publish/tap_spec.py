"""What a policy-side Tap needs to know about a published draft, read without loading the draft.

The RL job taps the layers the draft reads and ships head rows for its vocabulary: both come from the manifest
and, for EAGLE-3, the one ``d2t`` tensor of model.safetensors (read through ``safe_open``, after the file's
sha256 is checked against the manifest): the ``tap_capture`` of the format the manifest names
(``publish/registry.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from draft_align.heads.draft_head import DraftConfigError, HeadKind
from draft_align.publish import checked_manifest
from draft_align.publish.folder import MANIFEST_FILE, ExportError
from draft_align.publish.registry import format_of
from draft_align.publish.versions import resolve_draft_dir


@dataclass(frozen=True)
class TapSpec:
    """The capture side of a published draft: what to tap and which head rows to ship."""

    kind: HeadKind
    aux_layer_ids: tuple[int, ...]  # HF hidden_states indices the draft reads
    draft_to_target: torch.Tensor  # [draft_vocab] int64: target id of each draft id
    format: str  # manifest format (draft_align.eagle3 / draft_align.mtp / draft_align.native_mtp)
    draft_version: int
    policy_version: int


def read_tap_spec(draft_dir: Path) -> TapSpec:
    """The :class:`TapSpec` of the draft at ``draft_dir`` (a draft folder, or a run folder's ``latest``).

    EAGLE-3: ``draft_to_target = d2t + arange`` from model.safetensors, whose sha256 and size are verified
    first (CorruptCheckpointError otherwise).  MTP (either kind): the full target vocabulary (arange) and the
    final hidden state, no weights read.
    """
    path = resolve_draft_dir(Path(draft_dir))
    manifest = checked_manifest(path, verify=False)  # sizes against the head config, no links out
    fmt = format_of(manifest)
    versions = int(manifest.get("draft_version", 0)), int(manifest.get("policy_version", 0))
    try:
        aux_layer_ids, draft_to_target = fmt.tap_capture(path, manifest)
    except (KeyError, TypeError, DraftConfigError) as e:
        raise ExportError(f"{path / MANIFEST_FILE}: head config unusable: {e}") from e
    return TapSpec(fmt.kind, aux_layer_ids, draft_to_target, fmt.name, *versions)
