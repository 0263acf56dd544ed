"""The push process's loop: follow the run, keep the fleet on its newest version, report.

At every notification of the sidecar, and at least every ``poll_interval_s``: the newest verified version is
taken (:class:`~draft_align.push.follow.VersionFollower`), the servers file is re-read when it changed, and
the fleet makes one round
(:class:`~draft_align.push.fleet.Fleet`).  What it reports:

- ``<run>/push/state.json`` (replaced atomically on every change): the newest version and each server's state;
- ``<run>/push/push.jsonl``: one row on every change and at least every ``row_every_s`` (``draft-align monitor``
  prints the servers' table from it);
- Prometheus (``prometheus_port``): gauges per server (``server`` label) from ``prometheus_client``'s own
  registry.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draft_align.monitor.fleet_view import PUSH_DIR, PUSH_PORT_FILE, PUSH_ROWS_FILE, PUSH_STATE_FILE
from draft_align.push.fleet import Fleet, ServerState, Version
from draft_align.push.follow import VersionFollower

if TYPE_CHECKING:
    from draft_align.config.sections import PushConfig

log = logging.getLogger(__name__)

__all__ = ["PUSH_DIR", "PushLoop", "ServerList", "build_push_loop", "read_servers_file"]


def read_servers_file(path: Path) -> list[str]:
    """Server URLs in ``path``: one per line, blank lines and ``#`` comments ignored."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        url = line.split("#", 1)[0].strip()
        if url:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{path}: {url!r} is not an http://host:port URL")
            out.append(url)
    return out


class ServerList:
    """The fleet's URLs: the fixed ones plus a file's, re-read when its modification time changes (a file that
    cannot be read keeps the previous list, logged once)."""

    def __init__(self, fixed: list[str], file: str | None) -> None:
        self.fixed = list(fixed)
        self.file = Path(file) if file else None
        self._mtime: int | None = None
        self._from_file: list[str] = []

    def urls(self) -> list[str]:
        if self.file is not None:
            try:
                mtime = self.file.stat().st_mtime_ns
                if mtime != self._mtime:
                    self._from_file, self._mtime = read_servers_file(self.file), mtime
            except (OSError, ValueError, UnicodeDecodeError) as e:
                if self._mtime != -1:
                    log.warning(
                        "push: servers file %s unreadable (%s); keeping %d servers",
                        self.file,
                        e,
                        len(self._from_file),
                    )
                self._mtime = -1
        return self.fixed + self._from_file


class PromGauges:
    """The fleet on a Prometheus page (``prometheus_client``, a registry of its own, on 127.0.0.1)."""

    FIELDS = (
        "serving",
        "lag_s",
        "pushes",
        "repushes",
        "failures",
        "acceptance_length",
        "acceptance_since_push",
    )

    def __init__(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.gauges = {
            f: Gauge(
                f"draft_align_push_{f}",
                f"draft-align push: each server's {f}",
                ["server"],
                registry=self.registry,
            )
            for f in self.FIELDS
        }
        self.up = Gauge(
            "draft_align_push_up", "the server answered the last round", ["server"], registry=self.registry
        )
        self.refusals = Gauge(
            "draft_align_push_refusals", "versions the server refused", ["server"], registry=self.registry
        )
        self.newest = Gauge(
            "draft_align_push_newest_version", "the run's newest verified version", registry=self.registry
        )
        self.server, self.thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        self.port = int(self.server.server_port)

    def observe(self, newest: int, servers: dict[str, ServerState]) -> None:
        self.newest.set(newest)
        for url, s in servers.items():
            for f, g in self.gauges.items():
                v = getattr(s, f)
                g.labels(url).set(float("nan") if v is None else float(v))
            self.up.labels(url).set(1.0 if s.up else 0.0)
            self.refusals.labels(url).set(float(len(s.refusals)))

    def close(self) -> None:
        self.server.shutdown()


class PushLoop:
    """One push process (module docstring).  ``follower`` finds versions, ``fleet`` pushes them, ``servers``
    lists the URLs; ``out_dir`` is ``<run>/push``."""

    def __init__(
        self,
        follower: VersionFollower,
        fleet: Fleet,
        servers: ServerList,
        out_dir: Path,
        *,
        poll_interval_s: float = 0.5,
        row_every_s: float = 60.0,
        prometheus_port: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.follower, self.fleet, self.servers = follower, fleet, servers
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.poll_interval_s = float(poll_interval_s)
        self.row_every_s = float(row_every_s)
        self.clock = clock
        self.rounds = 0
        self._last_row_at = -float("inf")
        self._last_key: Any = None
        self.prom = PromGauges(prometheus_port) if prometheus_port is not None else None
        if self.prom is not None:
            (self.out_dir / PUSH_PORT_FILE).write_text(f"{self.prom.port}\n")

    def tick(self, wait_s: float = 0.0) -> dict[str, Any]:
        """One round, after waiting up to ``wait_s`` for the sidecar's next notification; returns the state it
        wrote."""
        followed = self.follower.poll(wait_s)
        self.fleet.set_servers(self.servers.urls())
        newest = None
        if followed is not None:
            d = followed.draft
            newest = Version(d.version, d.policy_version, str(d.path), d.sha256, followed.published_at)
        self.fleet.tick(newest)
        self.rounds += 1
        state = {
            "time": time.time(),
            "run": str(self.follower.run_dir),
            "newest": newest.version if newest is not None else None,
            "verify_failures": self.follower.failures,
            "notifications_coalesced": self.follower.coalesced,
            "servers": self.fleet.rows(),
        }
        self._report(state)
        return state

    def _report(self, state: dict[str, Any]) -> None:
        key = (
            state["newest"],
            [
                (s["url"], s["up"], s["serving"], s["sleeping"], len(s["refusals"]))
                for s in state["servers"].values()
            ],
        )
        changed = key != self._last_key
        if changed:
            tmp = self.out_dir / f".{PUSH_STATE_FILE}.tmp"
            tmp.write_text(json.dumps(state, sort_keys=True))
            os.replace(tmp, self.out_dir / PUSH_STATE_FILE)
        now = self.clock()
        if changed or now - self._last_row_at >= self.row_every_s:
            with (self.out_dir / PUSH_ROWS_FILE).open("a", encoding="utf-8") as f:
                f.write(json.dumps(state, sort_keys=True) + "\n")
            self._last_row_at = now
        self._last_key = key
        if self.prom is not None:
            self.prom.observe(state["newest"] or 0, self.fleet.servers)

    def run(
        self,
        stop: threading.Event,
        *,
        max_seconds: float | None = None,
        on_state: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Rounds until ``stop`` is set (or ``max_seconds`` passed); ``on_state`` sees each round's state."""
        end = None if max_seconds is None else self.clock() + max_seconds
        while not stop.is_set() and (end is None or self.clock() < end):
            try:  # waits for a notification up to poll_interval_s: a new version is pushed the moment it comes
                state = self.tick(wait_s=self.poll_interval_s)
                if on_state is not None:
                    on_state(state)
            except Exception:  # a bug in one round must not stop the fleet's updates
                log.exception("push: a round failed; the next one runs as usual")
                stop.wait(self.poll_interval_s)

    def close(self) -> None:
        self.fleet.close()
        if self.prom is not None:
            self.prom.close()


def build_push_loop(
    run_dir: Path,
    cfg: PushConfig,
    key: bytes,
    *,
    key_file: str | None = None,
    notifications: Any = None,
    servers: list[str] | None = None,
    servers_file: str | None = None,
    pause: str | None = None,
) -> PushLoop:
    """The push process of run ``run_dir`` with the recipe's ``push`` section ``cfg`` (``servers`` and
    ``servers_file`` add to its own; ``pause`` overrides it): what ``draft-align push`` and the co-training
    launcher (``rl.engine.kind: server``) run."""
    from draft_align.engines.vllm.draft_update import UpdateSigner

    fleet = Fleet(
        str(Path(run_dir).resolve()),
        UpdateSigner(key),
        key_file=key_file,
        api_key=os.environ.get(cfg.api_key_env) or None,
        pause=str(pause or cfg.pause),
        timeout_s=cfg.timeout_s,
        retry_min_s=cfg.retry_min_s,
        retry_max_s=cfg.retry_max_s,
    )
    urls = ServerList(list(cfg.servers) + list(servers or []), servers_file or cfg.servers_file)
    return PushLoop(
        VersionFollower(Path(run_dir), notifications),
        fleet,
        urls,
        Path(run_dir) / PUSH_DIR,
        poll_interval_s=cfg.poll_interval_s,
        row_every_s=cfg.row_every_s,
        prometheus_port=cfg.prometheus_port,
    )
