"""The newest verified draft version of a run, as the push process follows it.

:meth:`VersionFollower.poll` never blocks: it drains the sidecar's ``DraftPublished`` notifications (newest
first) and falls back to the run's ``latest``; a version newer than the one it holds is verified once (every
file's size and sha256, the manifest's version equal to its ``vNNNN`` folder's, an announced sha256 equal to
the folder's) and then offered to the fleet.  A version that fails is logged once and not read again until its
files change; a version pruned while it was read is skipped (a newer one is next).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from draft_align.engines.rollout_types import DraftVersion
from draft_align.publish.folder import MANIFEST_FILE, ExportError
from draft_align.publish.versions import check_folder_version, folder_version, read_latest, run_version_dir
from draft_align.wire.messages import DraftPublished

log = logging.getLogger(__name__)


class Notifications(Protocol):
    """Where DraftPublished notifications arrive (a :class:`draft_align.wire.channel.Subscriber`)."""

    def poll(self, timeout_ms: int | None = 0) -> DraftPublished | None: ...


@dataclass(frozen=True)
class Followed:
    """A verified version and when it was published (its manifest's modification time, seconds since epoch)."""

    draft: DraftVersion
    published_at: float

    @property
    def version(self) -> int:
        return self.draft.version


class VersionFollower:
    """A run's newest verified version (module docstring).  ``notifications``: the sidecar's subscriber
    (None: ``latest`` only); ``max_notifications``: the most drained per poll (a flood is coalesced: only the
    newest of them is examined, the rest counted in ``coalesced``)."""

    def __init__(
        self, run_dir: Path, notifications: Notifications | None = None, *, max_notifications: int = 1024
    ) -> None:
        self.run_dir = Path(run_dir)
        self.notifications = notifications
        self.max_notifications = int(max_notifications)
        self.newest: Followed | None = None
        self.failures = 0
        self.coalesced = 0
        self._bad: set[tuple[str, int]] = set()  # (folder, manifest mtime) that failed verification

    def poll(self, wait_s: float = 0.0) -> Followed | None:
        """The newest verified version (newer ones verified now); None before any publish.  ``wait_s``: how
        long to wait for a notification when none is there (the push loop waits here between rounds, so a new
        version is pushed the moment it is announced)."""
        for path, sha in self._candidates(wait_s):
            if self.newest is not None and (folder_version(path) or 0) <= self.newest.version:
                continue
            found = self._verify(path, sha)
            if found is not None:
                self.newest = found
                break
        return self.newest

    def _candidates(self, wait_s: float = 0.0) -> list[tuple[Path, str | None]]:
        out: list[tuple[Path, str | None]] = []
        if self.notifications is None and wait_s > 0:
            time.sleep(wait_s)
        if self.notifications is not None:
            best: DraftPublished | None = None
            for i in range(self.max_notifications):
                msg = self.notifications.poll(int(wait_s * 1000) if i == 0 else 0)
                if msg is None:
                    break
                if best is not None:
                    self.coalesced += 1
                if msg.run_id == self.run_dir.resolve().name and (
                    best is None or msg.draft_version > best.draft_version
                ):
                    best = msg
            if best is not None:
                try:
                    out.append(
                        (run_version_dir(self.run_dir, Path(best.path), int(best.draft_version)), best.sha256)
                    )
                except ExportError as e:
                    self._fail(f"notification of v{best.draft_version}", e)
        try:
            latest = read_latest(self.run_dir)
        except (ExportError, OSError) as e:
            self._fail(f"{self.run_dir}/latest", e)
            latest = None
        if latest is not None:
            out.append((latest, None))
        return sorted(out, key=lambda c: folder_version(c[0]) or 0, reverse=True)

    def _verify(self, path: Path, sha: str | None) -> Followed | None:
        try:
            mtime = (path / MANIFEST_FILE).stat().st_mtime
        except OSError:
            return None  # pruned or not yet there: a newer one, or the next poll
        sig = (str(path), int(mtime * 1e9))
        if sig in self._bad:
            return None
        try:
            draft = DraftVersion.read(path)
            check_folder_version(path, dict(draft.manifest))
            if sha is not None and draft.sha256 != sha:
                raise ExportError("the notification's sha256 differs from the folder's")
        except (ExportError, OSError, KeyError, TypeError, ValueError) as e:
            if not path.exists():
                return None  # pruned while it was read
            self._bad.add(sig)
            self._fail(str(path), e)
            return None
        log.info("push: v%04d verified (%s)", draft.version, path)
        return Followed(draft, mtime)

    def _fail(self, what: str, err: Exception) -> None:
        self.failures += 1
        log.warning("push: %s refused: %s", what, err)
