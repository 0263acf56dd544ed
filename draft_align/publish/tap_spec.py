"""What a policy-side Tap needs to know about a published draft, read without loading the draft.

The RL job taps the layers the draft reads and ships head rows for its vocabulary: both come from the
manifest and the one ``d2t`` tensor of model.safetensors (read through ``safe_open``, after the file's
sha256 is checked against the manifest).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from draft_align.heads.draft_head import DraftConfigError, HeadKind
from draft_align.heads.eagle3 import Eagle3Config, full_vocab
from draft_align.heads.mtp import MTPConfig
from draft_align.publish import checked_manifest
from draft_align.publish.folder import (
    MANIFEST_FILE,
    MTP_FORMAT,
    NATIVE_MTP_FORMAT,
    WEIGHTS_FILE,
    CorruptCheckpointError,
    ExportError,
    verify_file,
)
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
    fmt = str(manifest["format"])
    versions = int(manifest.get("draft_version", 0)), int(manifest.get("policy_version", 0))
    try:
        if fmt == MTP_FORMAT:
            mtp = MTPConfig.from_dict(dict(manifest["mtp_config"]))
            return TapSpec(
                "llama_block_mtp", tuple(mtp.aux_layer_ids), torch.arange(mtp.vocab_size), fmt, *versions
            )
        if fmt == NATIVE_MTP_FORMAT:  # a model's own MTP layers read the final hidden state (HF index L)
            target = dict(manifest["target"])
            vocab, layers = int(target["vocab_size"]), int(target["num_hidden_layers"])
            return TapSpec("native_mtp", (layers,), torch.arange(vocab), fmt, *versions)
        cfg = Eagle3Config.from_dict(dict(manifest["eagle3_config"]))
    except (KeyError, TypeError, DraftConfigError) as e:
        raise ExportError(f"{path / MANIFEST_FILE}: head config unusable: {e}") from e
    verify_file(path, WEIGHTS_FILE, manifest["files"][WEIGHTS_FILE])
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            if full_vocab(cfg) and "d2t" not in f.keys():  # stored in target order, no map (heads/eagle3.py)
                d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
            else:
                d2t = f.get_tensor("d2t").to(torch.long)
    except Exception as e:  # safetensors raises its own error types
        raise CorruptCheckpointError(f"{WEIGHTS_FILE}: no readable d2t ({e})") from e
    if d2t.shape != (cfg.draft_vocab_size,):
        raise CorruptCheckpointError(
            f"{WEIGHTS_FILE}: d2t is {list(d2t.shape)}, expected [{cfg.draft_vocab_size}]"
        )
    return TapSpec("eagle3", tuple(cfg.aux_layer_ids), d2t + torch.arange(d2t.numel()), fmt, *versions)
