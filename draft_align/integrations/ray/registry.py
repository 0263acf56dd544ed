"""The run's registry actor (rank endpoints, the newest published version) and the RL side's notification
source on it.

:class:`DraftRegistry` is a small named actor (no CPU reserved): each sidecar rank registers the tap endpoint
it bound, the lead rank reports every publish.  Both are also on disk — the endpoints in
``<run>/sidecar/ray_endpoints.json``, the versions in ``<run>/latest`` — so a restarted registry rebuilds itself
from the run folder.  The registry is a convenience, never the source of truth: :class:`RayNotifications`
never blocks and, when the registry is slow or gone, returns nothing (counted) so that
:class:`~draft_align.rl.drafts.DraftSource` falls back to reading ``latest``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from draft_align.integrations.ray.runtime import brief, get_actor, import_ray
from draft_align.publish.folder import read_manifest, weights_sha256
from draft_align.publish.versions import check_folder_version, read_latest, run_version_dir
from draft_align.sidecar.layout import RAY_ENDPOINTS_FILE, SIDECAR_DIR
from draft_align.wire.messages import DraftPublished

log = logging.getLogger(__name__)

MAX_JUMP = 1 << 20  # a publish report may move the newest version at most this far
MAX_FIRST = 1 << 40  # the first report's version


def read_endpoints(run_dir: Path) -> dict[int, str]:
    """``<run>/sidecar/ray_endpoints.json`` as {rank: endpoint}; {} when absent or unreadable."""
    path = Path(run_dir) / SIDECAR_DIR / RAY_ENDPOINTS_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return {int(k): str(v) for k, v in raw.items()}
    except (OSError, ValueError, AttributeError) as e:
        if not isinstance(e, FileNotFoundError):
            log.warning("%s unreadable (%s): endpoints start empty", path, e)
        return {}


def write_endpoints(run_dir: Path, endpoints: dict[int, str]) -> None:
    """Write the endpoints file atomically (a full disk is logged: the registry still holds them)."""
    folder = Path(run_dir) / SIDECAR_DIR
    tmp = folder / f".{RAY_ENDPOINTS_FILE}.tmp-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({str(k): v for k, v in sorted(endpoints.items())}), encoding="utf-8")
        os.replace(tmp, folder / RAY_ENDPOINTS_FILE)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.error("cannot write %s: %s", folder / RAY_ENDPOINTS_FILE, e)


def latest_published(run_dir: Path, run_id: str) -> DraftPublished | None:
    """The DraftPublished of the version ``<run>/latest`` names (None before any publish or when unreadable;
    the consumer verifies the files itself)."""
    try:
        path = read_latest(Path(run_dir))
        if path is None:
            return None
        manifest = read_manifest(path, verify=False)
        version = check_folder_version(path, manifest)
        return DraftPublished(
            run_id=run_id,
            draft_version=int(version if version is not None else manifest["draft_version"]),
            policy_version=int(manifest.get("policy_version", 0)),
            path=str(path),
            sha256=weights_sha256(manifest),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("registry: %s/latest unreadable (%s)", run_dir, e)
        return None


class DraftRegistry:
    """The registry actor's class (``ray.remote`` applied by :func:`registry_actor`); see the module docstring."""

    def __init__(self, run_dir: str, run_id: str) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.refused = (
            0  # publish reports refused (another run, a version out of bounds, a folder that is not it)
        )
        self._macs: dict[int, str] = {}  # rank → the signature it announced its endpoint with
        self._endpoints = read_endpoints(self.run_dir)
        self._newest = latest_published(self.run_dir, run_id)
        self._stop = False
        self._published = 0
        self._started = time.time()
        self._ranks: dict[int, dict[str, Any]] = {}  # rank → what it reported last (start, end)
        self._starts: dict[int, int] = {}

    def begin(self) -> None:
        """A (re)started gang: forget the endpoints and reports of the ranks' previous start."""
        self._endpoints, self._ranks, self._stop = {}, {}, False

    def register(self, rank: int, endpoint: str, info: dict[str, Any] | None = None, mac: str = "") -> None:
        """Rank ``rank`` bound ``endpoint`` (after every start or restart), announced with ``mac`` (its
        signature under the run's key, which the RL side checks: :meth:`signed_endpoints`); ``info``: its pid,
        whether it resumed, …"""
        rank = int(rank)
        self._endpoints[rank] = str(endpoint)
        self._macs[rank] = str(mac)
        self._starts[rank] = self._starts.get(rank, 0) + 1
        self._ranks[rank] = {**(info or {}), "starts": self._starts[rank], "running": True}
        write_endpoints(self.run_dir, self._endpoints)

    def rank_done(self, rank: int, info: dict[str, Any]) -> None:
        """Rank ``rank``'s loop ended (its train steps, the digest of its draft's weights, …)."""
        self._ranks[int(rank)] = {**self._ranks.get(int(rank), {}), **info, "running": False}

    def ranks(self) -> dict[int, dict[str, Any]]:
        return {r: dict(v) for r, v in self._ranks.items()}

    def endpoints(self) -> dict[int, str]:
        return dict(self._endpoints)

    def signed_endpoints(self) -> dict[int, tuple[str, str]]:
        """{rank: (endpoint, signature)}: the RL side uses an endpoint only when its signature verifies."""
        return {r: (ep, self._macs.get(r, "")) for r, ep in self._endpoints.items()}

    def published(self, msg: DraftPublished) -> None:
        """The lead rank published ``msg``: kept when it is this run's, newer than what the registry holds by at
        most 2^20 (a first one: at most 2^40), and names the run's own folder of that version with that
        sha256 in its manifest; anything else is refused and counted (a job on the cluster can call the
        registry: one report at 2^63 − 1 used to pin it, so genuine publishes were never forwarded)."""
        self._published += 1
        version = int(msg.draft_version)
        newest = int(self._newest.draft_version) if self._newest is not None else 0
        why = None
        if msg.run_id != self.run_id:
            why = f"of run {msg.run_id!r}"
        elif version <= newest:
            why = f"v{version} is not newer than v{newest}"
        elif version > newest + (MAX_JUMP if self._newest is not None else MAX_FIRST):
            why = f"v{version} jumps too far past v{newest}"
        else:
            try:
                path = run_version_dir(self.run_dir, Path(msg.path), version)
                if weights_sha256(read_manifest(path, verify=False)) != msg.sha256:
                    why = "its sha256 is not the folder's"
            except (OSError, ValueError, KeyError, TypeError) as e:
                why = str(e)
        if why is not None:
            self.refused += 1
            log.warning("draft registry: publish report refused: %s", why)
            return
        self._newest = msg

    def newest(self) -> DraftPublished | None:
        return self._newest

    def request_stop(self) -> None:
        """Ask every rank to end its loop (they poll :meth:`stop_requested`), checkpoint and close."""
        self._stop = True

    def stop_requested(self) -> bool:
        return self._stop

    def info(self) -> dict[str, Any]:
        newest = self._newest
        return {
            "endpoints": dict(self._endpoints),
            "newest_version": int(newest.draft_version) if newest is not None else 0,
            "published_reports": self._published,
            "refused_reports": self.refused,
            "stop_requested": self._stop,
            "up_s": time.time() - self._started,
        }


def registry_actor(run_dir: Path, run_id: str, namespace: str, *, identity: str, detached: bool) -> Any:
    """Create the run's registry actor (named by the run's ``identity``, runtime.run_identity), or get the one
    that exists (restarted by Ray without limit: it holds no state the run folder lacks).  No CPU is reserved
    for it."""
    from draft_align.integrations.ray.runtime import registry_name

    ray = import_ray()
    cls = ray.remote(DraftRegistry)
    return cls.options(
        name=registry_name(identity),
        namespace=namespace,
        lifetime="detached" if detached else None,
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        max_task_retries=0,
    ).remote(str(run_dir), run_id)


class RayNotifications:
    """:class:`~draft_align.rl.drafts.Notifications` backed by the registry actor.  :meth:`poll` never waits
    longer than ``timeout_ms`` (0: not at all): it keeps one question to the registry in flight and returns its
    answer once it has come (a version newer than the last one returned), else None.  A registry that is gone
    or errs, or a question older than ``timeout_s``, counts (``failures``, ``timeouts``) and the poll returns
    None (``fallbacks``): the DraftSource then reads ``latest`` itself.  The registry is looked up again at
    most every ``retry_s``."""

    def __init__(
        self, identity: str, namespace: str, *, timeout_s: float = 2.0, retry_s: float = 5.0
    ) -> None:
        self.identity = identity  # the run's actor names (runtime.run_identity)
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.retry_s = float(retry_s)
        self.notified = 0  # notifications returned
        self.failures = 0  # registry errors (dead actor, lookup failed)
        self.timeouts = 0  # questions unanswered within timeout_s
        self.fallbacks = 0  # polls that returned nothing because the registry was unavailable
        self._handle: Any = None
        self._next_lookup = 0.0
        self._pending: Any = None
        self._asked_at = 0.0
        self._seen = 0

    def _ask(self) -> None:
        from draft_align.integrations.ray.runtime import registry_name

        if self._handle is None:
            if time.monotonic() < self._next_lookup:
                return
            self._next_lookup = time.monotonic() + self.retry_s
            try:
                self._handle = get_actor(registry_name(self.identity), self.namespace)
            except Exception as e:  # a cluster that went away: counted, latest still serves
                self.failures += 1
                log.warning("draft registry lookup failed: %s", e)
                return
            if self._handle is None:
                self.failures += 1
                return
        try:
            self._pending = self._handle.newest.remote()
            self._asked_at = time.monotonic()
        except Exception as e:
            self.failures += 1
            self._handle = None
            log.warning("draft registry unreachable: %s", e)

    def poll(self, timeout_ms: int | None = 0) -> DraftPublished | None:
        """The newest DraftPublished not returned before, if the registry's answer is in; else None."""
        ray = import_ray()
        if self._pending is None:
            self._ask()
            if self._pending is None:
                self.fallbacks += 1
                return None
        wait_s = 0.0 if timeout_ms is None else max(0.0, min(timeout_ms / 1000, self.timeout_s))
        ready, _ = ray.wait([self._pending], timeout=wait_s)
        if not ready:
            if time.monotonic() - self._asked_at > self.timeout_s:
                self.timeouts += 1
                self.fallbacks += 1
                self._pending = None
                self._handle = None  # look it up again: it may have been replaced
            return None
        ref, self._pending = self._pending, None
        try:
            msg = ray.get(ref, timeout=self.timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as e:
            self.failures += 1
            self.fallbacks += 1
            self._handle = None
            log.warning("draft registry failed (%s): reading latest instead", brief(e))
            return None
        self._ask()  # the next question is in flight before the next step boundary
        if msg is None or int(msg.draft_version) <= self._seen:
            return None
        self._seen = int(msg.draft_version)
        self.notified += 1
        return msg
