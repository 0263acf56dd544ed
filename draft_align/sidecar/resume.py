"""What a (re)starting sidecar can trust: the newest published version and trainer checkpoint that verify.

A corrupt newest version, trainer checkpoint or ``state.json`` must not block a restart, and nothing the
sidecar finds on disk is taken at its word:

- a version's number is its ``drafts/vNNNN`` folder's name; its files must match its manifest, its manifest's
  ``draft_version`` the folder name, and when ``sidecar/publish.jsonl`` (the run's publish log) records the
  version, the weights' sha256 the one logged; versions newer than the newest logged one were never
  announced and are not trusted.  :func:`trusted_published` takes ``latest`` when it passes, else the newest
  version that does, and says so;
- a trainer checkpoint or ``state.json`` that cannot be read is moved aside (``.corrupt-<name>-<time>``,
  nothing is deleted) and the sidecar starts training afresh from the trusted published draft
  (:func:`set_aside`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from draft_align.heads.draft_head import DraftHead
from draft_align.publish import load_draft
from draft_align.publish.folder import ExportError, weights_sha256
from draft_align.publish.versions import check_folder_version, folder_version, published_versions, read_latest
from draft_align.sidecar.gate import plain_copy
from draft_align.sidecar.layout import PUBLISH_FILE, STATE_FILE, TRAINER_DIR
from draft_align.sidecar.state import SidecarState, StateError
from draft_align.train.checkpoint import checkpoint_exists

log = logging.getLogger(__name__)


def read_publish_log(path: Path) -> dict[int, str | None]:
    """``{version: weights sha256 (None when the line has none)}`` from a ``publish.jsonl``; unreadable lines
    (a write cut short by a kill or a full disk) are skipped."""
    out: dict[int, str | None] = {}
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except (FileNotFoundError, IsADirectoryError):
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
            v = rec["draft_version"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if isinstance(v, int) and not isinstance(v, bool):
            sha = rec.get("sha256")
            out[v] = sha if isinstance(sha, str) else None
    return out


def _check(
    path: Path, publish_log: dict[int, str | None], device: torch.device
) -> tuple[Any, dict[str, Any]]:
    draft, man = load_draft(path, device=device)  # every file re-hashed
    v = check_folder_version(path, man)
    if v is not None and publish_log:
        if v > max(publish_log):
            raise ExportError(
                f"{path}: v{v} is not in the run's publish log (newest logged: v{max(publish_log)})"
            )
        logged = publish_log.get(v)
        if logged is not None and logged != weights_sha256(man):
            raise ExportError(f"{path}: weights sha256 differs from the one the publish log recorded")
    return draft, man


def trusted_published(
    run_dir: Path, publish_log: Path, device: torch.device
) -> tuple[Path, Any, dict] | None:
    """(folder, draft, manifest) of ``latest`` when it verifies, else of the newest version that does (logged
    as a fallback); None when the run has no version that verifies."""
    logged = read_publish_log(publish_log)
    try:
        latest = read_latest(run_dir)
    except ExportError as e:
        log.error("%s; looking for the newest version that verifies", e)
        latest = None
    candidates = ([latest] if latest is not None else []) + [
        p for p in published_versions(run_dir) if p != latest
    ]
    for path in candidates:
        try:
            draft, man = _check(path, logged, device)
        except (ExportError, OSError, KeyError, TypeError, ValueError, RuntimeError) as e:
            log.error("published version %s does not verify (%s): skipped", path, e)
            continue
        if latest is not None and path != latest:
            log.warning("falling back to %s, the newest published version that verifies", path)
        return path, draft, man
    return None


def set_aside(path: Path, why: Exception, then: str = "training restarts from the published draft") -> Path:
    """Move an unusable checkpoint file or folder aside (never deleted) and say so (``then``: what happens
    instead); returns where it went."""
    path = Path(path)
    dest = path.with_name(f".corrupt-{path.name}-{int(time.time())}")
    os.replace(path, dest)
    log.error("%s is unusable (%s): moved to %s; %s", path, why, dest, then)
    return dest


def resume_state(sidecar_dir: Path) -> tuple[SidecarState, bool]:
    """(state, resumed): the saved state when a trainer checkpoint and ``state.json`` exist (restarts counted,
    ``done`` cleared), else a fresh one.  An unreadable ``state.json`` is set aside with the checkpoint it
    belongs to, and the sidecar starts afresh."""
    sfile, tdir = Path(sidecar_dir) / STATE_FILE, Path(sidecar_dir) / TRAINER_DIR
    if not (checkpoint_exists(tdir) and sfile.is_file()):
        return SidecarState(), False
    try:
        state, resumed = SidecarState.load(sfile), True
    except StateError as e:  # the trainer checkpoint goes with it: its counters are gone
        set_aside(sfile, e)
        set_aside(tdir, e)
        state, resumed = SidecarState(), False
    state.restarts += 1
    state.done = False
    return state, resumed


def start_published(
    run_dir: Path, sidecar_dir: Path, state: SidecarState, frozen: DraftHead, device: torch.device
) -> tuple[DraftHead, Path | None]:
    """(the published draft the gate compares against, its folder): the trusted published version
    (:func:`trusted_published`; ``state`` takes its number and policy version), else a copy of ``frozen``
    and None."""
    found = trusted_published(run_dir, Path(sidecar_dir) / PUBLISH_FILE, device)
    if found is None:
        return plain_copy(frozen, device).eval(), None
    path, published, man = found
    v = folder_version(path)
    state.published_version = max(state.published_version, v if v is not None else 0)
    state.published_policy_version = int(man["policy_version"])
    return published.eval(), path
