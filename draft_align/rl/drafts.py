"""The RL job's one source of drafts: the frozen warm-start draft and the newest draft the sidecar published.

:meth:`DraftSource.poll` runs at each step boundary and never waits.  It drains the sidecar's
``DraftPublished`` notifications (non-blocking); the newest one that names a newer version is used, else it
falls back to reading ``run_dir/latest`` (no notification came, or no subscriber is configured).  A new
version is resolved once, its sha256 verified once (for a notification: the folder's must also be the one
announced), loaded once, and checked once against the frozen draft: what the Tap captures, the vocab map
HeadSync ships and the shapes an engine reloads in place are fixed for a run.  The result, a
:class:`~draft_align.engines.rollout_types.DraftVersion` (path, manifest, sha256) and its module, is what
both the reference decoder and an engine's refresher serve.

Anything wrong with a new version (corrupt or half-written files, a config that does not fit, an unreadable
``latest`` — not UTF-8, a directory —, a notification whose sha256 or version differs from the folder's, a
manifest whose ``draft_version`` is not its ``vNNNN`` folder's number) is logged and counted, and the
previous draft stays in use: :meth:`DraftSource.poll` never raises for what it reads.  A failed version is
not re-read until its files change.  Versions are read from this run's own ``drafts/vNNNN`` only: a
notification for another ``run_id`` or naming another folder, and a ``latest`` or version folder that a link
leads out of the run, are refused the same way (``publish.versions.run_version_dir``).

``background=True`` (the RL job's setting) takes all of that off the job's thread: a daemon thread looks for
new versions every ``poll_interval_s`` and hashes, loads and checks them as they appear, mid-step; ``poll``
only swaps in the newest version already verified (an assignment).  A version that fails there is never
handed to ``poll``.  The silent-zero guard is :meth:`DraftSource.judge` (a
:class:`~draft_align.rl.draft_guard.CounterGuard` on the step's own rollout counters): a new version stays
on probation until the first step it served is judged, and one that collapsed is replaced by the previous
good version (or the frozen draft), so the engine serves that again from the next step boundary on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from draft_align.acceptance import AcceptanceTally
from draft_align.engines.rollout_types import DraftVersion
from draft_align.heads.draft_head import DraftHead
from draft_align.publish import load_verified_draft
from draft_align.publish.folder import (
    MANIFEST_FILE,
    WEIGHTS_FILE,
    CorruptCheckpointError,
    ExportError,
)
from draft_align.publish.versions import (
    check_folder_version,
    folder_version,
    read_latest,
    resolve_draft_dir,
    run_version_dir,
    version_dir,
)
from draft_align.rl.draft_guard import CounterGuard
from draft_align.wire.messages import DraftPublished

log = logging.getLogger(__name__)

# Config fields that must equal the frozen draft's: what the Tap captures and the vocab map HeadSync ships
# (fixed for a run), and the shapes an engine loads a new version into in place.
_FIXED_FIELDS = (
    "aux_layer_ids",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "target_num_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
)

Signature = tuple[str, int, int, int]
MAX_NOTIFICATIONS = 1024  # notifications drained per poll (a flood waits for later polls)
MAX_EXAMINED = 8  # newer versions of this run examined per poll, newest first
FOREIGN_LOG_EVERY_S = 60.0  # notifications for other runs: one log line at most this often


class Notifications(Protocol):
    """Where DraftPublished notifications arrive (a :class:`draft_align.wire.channel.Subscriber`)."""

    def poll(self, timeout_ms: int | None = 0) -> DraftPublished | None: ...


def _signature(path: Path) -> Signature:
    """(path, weights mtime, weights size, manifest mtime): changes whenever the folder is rewritten."""
    w, m = (path / WEIGHTS_FILE).stat(), (path / MANIFEST_FILE).stat()
    return str(path.resolve()), w.st_mtime_ns, w.st_size, m.st_mtime_ns


class DraftSource:
    """Frozen and adapted drafts (see the module docstring).  Before any publish the adapted module is the
    frozen one and ``adapted_version`` is None.

    ``notifications``: the sidecar's DraftPublished subscriber (None: poll ``latest`` only); with
    ``background`` it is read by the verifier thread only.  ``guard``: the silent-zero guard :meth:`judge`
    applies (None: every verified version serves).  Call :meth:`close` to stop the verifier thread.  ``run_id``: the
    run id a notification must carry (None: the run folder's name).
    """

    def __init__(
        self,
        run_dir: Path,
        frozen_path: Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        notifications: Notifications | None = None,
        run_id: str | None = None,
        background: bool = False,
        guard: CounterGuard | None = None,
        poll_interval_s: float = 0.1,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = self.run_dir.name if run_id is None else run_id
        self.device = device
        self.dtype = dtype
        self.notifications = notifications
        path = resolve_draft_dir(frozen_path)
        frozen, manifest, weights = load_verified_draft(path, verify=True, device=device, dtype=dtype)
        self.frozen: DraftHead = frozen.requires_grad_(False).eval()
        self.frozen_version = DraftVersion.of(path, manifest, weights)
        self.adapted: DraftHead = self.frozen
        self.adapted_version: DraftVersion | None = None
        self.failures = 0
        self._foreign = 0  # notifications for other runs since the last line that said so
        self._foreign_logged_at = -float("inf")
        self.superseded = 0  # versions pruned by the sidecar's retention while they were verified
        self.refreshes = 0
        self.notified = 0  # versions taken from a notification (the rest came from `latest`)
        self._skip: set[Signature] = set()
        self.guard = guard
        self.probation: DraftVersion | None = None  # served, not yet judged by the guard
        self._good: tuple[DraftVersion | None, DraftHead] = (None, self.frozen)  # what a rollback restores
        self._reference: AcceptanceTally | None = None  # the last good adapted draft's tally
        self.rollbacks = 0
        self.alarms = 0
        self.verify_s: float | None = None  # the latest verification's seconds (on the verifier thread)
        self.background = background
        self.poll_interval_s = float(poll_interval_s)
        self._lock = threading.Lock()
        self._ready: tuple[DraftVersion, DraftHead] | None = None  # verified, not yet taken by poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._verify_loop, name="draft-verify", daemon=True)
            self._thread.start()

    @property
    def frozen_path(self) -> Path:
        return self.frozen_version.path

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] the frozen draft's vocab map (fixed for the run)."""
        return self.frozen.draft_to_target

    @property
    def current_version(self) -> int:
        """The adapted draft's version number (0 before any publish)."""
        return self.adapted_version.version if self.adapted_version is not None else 0

    def _newest(self) -> DraftVersion | None:
        """The newest version verified so far: one waiting for :meth:`poll`, else the adapted one."""
        with self._lock:
            ready = self._ready
        return ready[0] if ready is not None else self.adapted_version

    @property
    def verified_version(self) -> int:
        """The newest version verified so far (served, or waiting for :meth:`poll`); 0 before any."""
        newest = self._newest()
        return newest.version if newest is not None else 0

    # ----------------------------------------------------------------- checks
    def _fail(self, what: str, err: Exception, sig: Signature | None) -> bool:
        self.failures += 1
        if sig is not None:
            self._skip.add(sig)
        log.warning("draft refresh: %s: %s; keeping draft v%04d", what, err, self.current_version)
        return False

    def check_fits(self, draft: DraftHead) -> None:
        """Raise ExportError unless ``draft`` can replace the frozen draft (the one check, for every consumer)."""
        if draft.kind != self.frozen.kind:
            raise ExportError(f"config mismatch: a {draft.kind} head, the frozen draft is {self.frozen.kind}")
        for name in _FIXED_FIELDS:
            got, want = getattr(draft.cfg, name, None), getattr(self.frozen.cfg, name, None)
            if got != want:
                raise ExportError(f"config mismatch: {name} = {got}, the frozen draft has {want}")
        if not torch.equal(draft.draft_to_target.cpu(), self.frozen.draft_to_target.cpu()):
            raise ExportError("config mismatch: draft_to_target differs from the frozen draft's vocab map")

    def verify(
        self, path: Path, sha256: str | None = None, announced: int | None = None
    ) -> tuple[DraftVersion, DraftHead]:
        """Load the version at ``path`` with its files verified and check that it fits; ``sha256``/``announced``:
        the weights digest and version a notification announced, which must be the folder's; the manifest's
        ``draft_version`` must be the folder name's.  Raises ExportError / OSError."""
        draft, manifest, weights = load_verified_draft(
            path, verify=True, device=self.device, dtype=self.dtype
        )
        check_folder_version(path, manifest)
        version = DraftVersion.of(path, manifest, weights)  # the module and the tensors: one read, verified
        if sha256 is not None and version.sha256 != sha256:
            raise CorruptCheckpointError(
                "the notification's sha256 differs from the folder's (rewritten since?)"
            )
        if announced is not None and version.version != announced:
            raise ExportError(f"the notification announced v{announced}, the folder is v{version.version}")
        self.check_fits(draft)
        return version, draft

    # ----------------------------------------------------------------- refresh
    def _newest_notification(self) -> DraftPublished | None:
        """The newest of at most :data:`MAX_NOTIFICATIONS` waiting notifications that names a newer version of
        this run (a flood is coalesced: the rest wait for the next poll; notifications for another run are
        counted as failures and logged in one line a minute at most, not one line each)."""
        if self.notifications is None:
            return None
        newer: list[DraftPublished] = []
        foreign: dict[str, int] = {}
        for _ in range(MAX_NOTIFICATIONS):
            msg = self.notifications.poll(0)
            if msg is None:
                break
            if msg.run_id != self.run_id:
                foreign[msg.run_id] = foreign.get(msg.run_id, 0) + 1
            elif int(msg.draft_version) > self.current_version:
                newer.append(msg)
        if foreign:
            self.failures += sum(foreign.values())
            self._foreign += sum(foreign.values())
            now = time.monotonic()
            if now >= self._foreign_logged_at + FOREIGN_LOG_EVERY_S:  # a flood is one line a minute
                shown = ", ".join(f"{run!r} ×{n}" for run, n in sorted(foreign.items())[:3])
                log.warning(
                    "draft refresh: %d notifications for other runs ignored since the last such line (%s); "
                    "keeping draft v%04d",
                    self._foreign,
                    shown,
                    self.current_version,
                )
                self._foreign, self._foreign_logged_at = 0, now
        # newest first: older ones (perhaps pruned since) are examined only when a newer one is refused
        for msg in sorted(newer, key=lambda m: -int(m.draft_version))[:MAX_EXAMINED]:
            if self._in_run(msg):
                return msg
        return None

    def _in_run(self, msg: DraftPublished) -> bool:
        """Whether ``msg`` is this run's and names its ``drafts/vNNNN`` of that version (else counted, logged)."""
        if msg.run_id != self.run_id:
            return self._fail(f"a notification for run {msg.run_id!r}", ValueError("not this run"), None)
        try:
            run_version_dir(self.run_dir, Path(msg.path), int(msg.draft_version))
        except ExportError as e:
            gone = version_dir(self.run_dir, int(msg.draft_version))
            return self._superseded_or_fail(gone, f"notification of v{int(msg.draft_version):04d}", e, None)
        return True

    def poll(self) -> bool:
        """Take the newest published version if it is newer than the adapted one; True when one was taken.
        With ``background``: the newest version the verifier thread finished, if any (never waits)."""
        if self.background:
            return self._take_ready()
        return self._poll_files()

    def _poll_files(self) -> bool:
        """Look for a newer version (notifications, then ``latest``) and verify it here."""
        msg = self._newest_notification()
        if msg is not None and int(msg.draft_version) > self.verified_version:
            path = version_dir(self.run_dir, int(msg.draft_version))  # checked: the folder msg.path names
            if self._take(path, msg.sha256, int(msg.draft_version)):
                self.notified += 1
                return True
            return False
        try:
            path = self._read_latest()
        except (ExportError, OSError, ValueError) as e:
            return self._fail(f"{self.run_dir}/latest unreadable", e, None)
        current = self._newest()
        if path is None or (current is not None and path.resolve() == current.path.resolve()):
            return False
        try:
            path = run_version_dir(self.run_dir, path)
        except ExportError as e:
            return self._fail(f"{self.run_dir}/latest", e, None)
        return self._take(path, None)

    def _take(self, path: Path, sha256: str | None, announced: int | None = None) -> bool:
        try:
            sig = _signature(path)
        except (OSError, ValueError) as e:
            return self._superseded_or_fail(path, f"{path} incomplete", e, None)
        if sig in self._skip:
            return False
        t0 = time.perf_counter()
        try:
            version, draft = self.verify(path, sha256, announced)
        except (ExportError, CorruptCheckpointError, OSError, KeyError, TypeError, ValueError) as e:
            return self._superseded_or_fail(path, f"{path} rejected", e, sig)
        self.verify_s = time.perf_counter() - t0
        if version.version <= self.verified_version:
            log.info(
                "draft refresh: %s is v%04d, not newer than v%04d",
                path,
                version.version,
                self.verified_version,
            )
            self._skip.add(sig)  # not an error, but nothing to re-read until it changes
            return False
        draft = draft.requires_grad_(False).eval()
        if self.background:
            with self._lock:
                self._ready = (version, draft)
        else:
            self._install(version, draft)
        log.info(
            "draft refresh: loaded v%04d (policy version %d) from %s%s",
            version.version,
            version.policy_version,
            path,
            " (notified)" if sha256 is not None else "",
        )
        return True

    def _read_latest(self) -> Path | None:
        """``latest``'s folder; read twice when the first read names a folder pruned meanwhile (``latest``
        moved on between reading it and checking its folder: the second read names the newer one)."""
        try:
            return read_latest(self.run_dir)
        except ExportError:
            return read_latest(self.run_dir)

    def _superseded_or_fail(self, path: Path, what: str, err: Exception, sig: Signature | None) -> bool:
        """Count ``path`` as superseded when the sidecar's retention removed it meanwhile, else as a failure."""
        if self._pruned_since(path):
            self.superseded += 1
            log.info("draft refresh: %s was pruned while it was read (a newer version replaced it)", path)
            return False
        return self._fail(what, err, sig)

    def _pruned_since(self, path: Path) -> bool:
        """Whether ``path`` (a ``vNNNN`` folder) is gone and ``latest`` names a newer version: the sidecar's retention removed it
        while it was read, which is no failure (the newer one is taken next)."""
        gone = folder_version(path)
        if path.exists() or gone is None:
            return False
        try:
            newest = read_latest(self.run_dir)
        except (ExportError, OSError, ValueError):
            return False
        latest = folder_version(newest) if newest is not None else None
        return latest is not None and latest > gone

    # ----------------------------------------------------------------- background verification
    def _verify_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll_files()
            except Exception:  # a bug here must not stop the thread: the job keeps its draft
                log.exception("draft refresh: the verifier thread failed once; it keeps polling")
            self._stop.wait(self.poll_interval_s)

    def _take_ready(self) -> bool:
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None:
            return False
        self._install(*ready)
        return True

    def _install(self, version: DraftVersion, draft: DraftHead) -> None:
        """Serve ``version``: on probation until :meth:`judge` passes it; a rollback restores the last good one."""
        if self.probation is None:
            self._good = (self.adapted_version, self.adapted)
        self.adapted, self.adapted_version = draft, version
        self.probation = version if self.guard is not None else None
        self.refreshes += 1

    def wait_verified(self, timeout_s: float) -> bool:
        """Block until the verifier thread holds a version for :meth:`poll` (for start-up and tests, never per
        step); True when one is ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._ready is not None:
                    return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Stop the verifier thread (waits for a verification in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60.0)

    # ----------------------------------------------------------------- silent-zero guard
    def judge(self, served: DraftVersion | None, tallies: Mapping[str, AcceptanceTally]) -> bool:
        """After a step's rollouts: judge the version on probation by ``tallies`` (each draft's counters of the
        step) when ``served`` (the adapted version that decoded them) is that version.  On a collapse, log an
        alarm and restore the last good version, which the engine is offered at the next step boundary; True
        then.  A version that passed becomes the reference for later ones when a step lacks frozen rounds."""
        adapted = tallies.get("adapted")
        if self.guard is None or served is None or adapted is None:
            return False
        probation = self.probation
        if probation is None or served.sha256 != probation.sha256:
            if self.adapted_version is not None and served.sha256 == self.adapted_version.sha256:
                if adapted.rounds >= self.guard.min_rounds:
                    self._reference = adapted
            return False
        frozen = tallies.get("frozen")
        ref = frozen if frozen is not None and frozen.rounds >= self.guard.min_rounds else self._reference
        verdict = self.guard.verdict(adapted, ref)
        if verdict == "undecided":
            return False
        self.probation = None
        if verdict == "pass":
            self._reference = adapted
            return False
        self.alarms += 1
        self.rollbacks += 1
        good_version, good = self._good
        log.error(
            "draft guard ALARM: v%04d measured acceptance %.3f collapsed on its first step (reference %.3f, "
            "min ratio %.2f): back to %s from the next step",
            probation.version,
            adapted.mean_length(),
            ref.mean_length() if ref is not None else float("nan"),
            self.guard.min_ratio,
            f"v{good_version.version:04d}" if good_version is not None else "the frozen draft",
        )
        try:
            self._skip.add(_signature(probation.path))
        except (OSError, ValueError):
            pass  # the folder is gone: nothing will re-read it
        self.adapted_version, self.adapted = good_version, good
        return True
