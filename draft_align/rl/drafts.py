"""The RL job's two drafts: the frozen warm-start draft and the newest draft the sidecar published.

``DraftWatcher.refresh()`` runs between RL steps and never waits: it reads ``run_dir/latest`` and, when
that names a newer version, loads it with its sha256 verified.  Anything wrong with a new version
(corrupt or half-written files, a config that does not match the frozen draft, an unreadable
``latest``) is logged and counted, and the previous draft stays in use.  A failed version is not
re-read until its files change.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from draft_align.heads.eagle3 import Eagle3Draft
from draft_align.publish import load_draft
from draft_align.publish.folder import MANIFEST_FILE, WEIGHTS_FILE, CorruptCheckpointError, ExportError
from draft_align.publish.versions import read_latest, resolve_draft_dir

log = logging.getLogger(__name__)

# Eagle3Config fields that must equal the frozen draft's: what the Tap captures and the vocab map
# HeadSync ships are fixed for a run.
_FIXED_FIELDS = ("aux_layer_ids", "vocab_size", "draft_vocab_size", "target_hidden_size", "target_num_layers")


def _signature(path: Path) -> tuple[str, int, int, int]:
    """(path, weights mtime, weights size, manifest mtime): changes whenever the folder is rewritten."""
    w, m = (path / WEIGHTS_FILE).stat(), (path / MANIFEST_FILE).stat()
    return str(path.resolve()), w.st_mtime_ns, w.st_size, m.st_mtime_ns


class DraftWatcher:
    """Frozen and adapted drafts (see the module docstring).  Before any publish, adapted = frozen, version 0."""

    def __init__(
        self,
        run_dir: Path,
        frozen_path: Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.device = device
        self.dtype = dtype
        self.frozen_path = resolve_draft_dir(frozen_path)
        self.frozen, self.frozen_manifest = load_draft(
            self.frozen_path, verify=True, device=device, dtype=dtype
        )
        self.frozen.requires_grad_(False).eval()
        self.adapted: Eagle3Draft = self.frozen
        self.adapted_manifest: dict[str, Any] = self.frozen_manifest
        self.adapted_path: Path | None = None
        self.adapted_version = 0
        self.adapted_policy_version = 0
        self.failures = 0
        self.refreshes = 0
        self._skip: set[tuple[str, int, int, int]] = set()

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] the frozen draft's vocab map (fixed for the run)."""
        return self.frozen.draft_to_target

    def _fail(self, what: str, err: Exception, sig: tuple[str, int, int, int] | None) -> bool:
        self.failures += 1
        if sig is not None:
            self._skip.add(sig)
        log.warning("draft refresh: %s: %s; keeping draft v%04d", what, err, self.adapted_version)
        return False

    def _check_fits(self, draft: Eagle3Draft) -> None:
        for name in _FIXED_FIELDS:
            got, want = getattr(draft.cfg, name), getattr(self.frozen.cfg, name)
            if got != want:
                raise ExportError(f"config mismatch: {name} = {got}, the frozen draft has {want}")
        if not torch.equal(draft.draft_to_target.cpu(), self.frozen.draft_to_target.cpu()):
            raise ExportError("config mismatch: draft_to_target differs from the frozen draft's vocab map")

    def refresh(self) -> bool:
        """Load the version ``latest`` names if it is newer than the adapted one; True when one was loaded."""
        try:
            path = read_latest(self.run_dir)
        except (ExportError, OSError) as e:
            return self._fail(f"{self.run_dir}/latest unreadable", e, None)
        if path is None or (self.adapted_path is not None and path.resolve() == self.adapted_path.resolve()):
            return False
        try:
            sig = _signature(path)
        except OSError as e:
            return self._fail(f"{path} incomplete", e, None)
        if sig in self._skip:
            return False
        try:
            draft, manifest = load_draft(path, verify=True, device=self.device, dtype=self.dtype)
            self._check_fits(draft)
            version = int(manifest["draft_version"])
            policy_version = int(manifest["policy_version"])
        except (ExportError, CorruptCheckpointError, OSError, KeyError, TypeError, ValueError) as e:
            return self._fail(f"{path} rejected", e, sig)
        if version <= self.adapted_version:
            log.info("draft refresh: %s is v%04d, not newer than v%04d", path, version, self.adapted_version)
            self._skip.add(sig)  # not an error, but nothing to re-read until it changes
            return False
        self.adapted = draft.requires_grad_(False).eval()
        self.adapted_manifest = manifest
        self.adapted_path = path
        self.adapted_version = version
        self.adapted_policy_version = policy_version
        self.refreshes += 1
        log.info("draft refresh: loaded v%04d (policy version %d) from %s", version, policy_version, path)
        return True
