"""The fleet: each vLLM server's state and the push of the newest version to every server behind it.

Rules (docs/servers.md, "What the push process guarantees"):

- a server is pushed a version only when it is newer than the one the server says it serves
  (``GET /weight_info``, read at most every ``state_every_s`` and after every failure): no server ever goes
  back to an older version;
- a server that restarted (its ``weight_info`` is vLLM's ``"default"`` again) or joined late is pushed the
  current version; a server that wakes from sleep (``/is_sleeping`` true → false) is pushed again the version it
  served before (its backend holds it in memory; vLLM's level-2 sleep discards the draft's weights);
- a server that refuses a version (the backend's checks) keeps its own, the refusal is recorded with its one-line
  reason, and that version is never offered to it again; a newer one is;
- a server that does not answer is retried with exponential backoff (``retry_min_s`` doubling to
  ``retry_max_s``); its state says since when it is failing;
- each server's spec-decode counters are read from its ``/metrics`` (after any push of the round, at most
  every ``counters_every_s``): the acceptance length measured by the server since the previous read, and
  since the version it serves was pushed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from draft_align.engines.vllm.counters import SpecCounters
from draft_align.engines.vllm.draft_update import UpdateSigner, weight_version
from draft_align.engines.vllm.server_client import ServerError, ServerRefused, ServerUnreachable, VLLMServer
from draft_align.wire.messages import DraftPublished

log = logging.getLogger(__name__)

MAX_PARALLEL = 64  # servers visited at once in a round


@dataclass(frozen=True)
class Version:
    """What is pushed: a verified version of the run (or the one a server held before it slept)."""

    version: int
    policy_version: int
    path: str
    sha256: str
    published_at: float  # seconds since epoch (for the publish → serving latency)


@dataclass
class ServerState:
    """One server as the push process sees it (a row of ``push.jsonl`` and of ``draft-align monitor``)."""

    url: str
    up: bool = False
    serving: int | None = None  # the draft version it serves (None: its start-up draft)
    serving_sha: str | None = None
    sleeping: bool = False
    pushes: int = 0
    repushes: int = 0  # versions loaded again after a wake or a restart of the server
    failures: int = 0  # calls that got no answer, in all
    failing_since: float | None = None  # the first of the current run of failures (None: answering)
    refusals: dict[int, str] = field(default_factory=dict)  # version → the server's reason
    last_error: str = ""
    lag_s: float = 0.0  # seconds the newest version has been published without this server serving it
    last_push_s: float = math.nan  # the last push's seconds (start → finish, as the caller saw it)
    last_push_at: float = math.nan  # when the last push began (seconds since epoch)
    last_latency_s: float = math.nan  # publish → serving of the last version pushed
    acceptance_length: float = math.nan  # measured by the server between the last two reads of /metrics
    acceptance_since_push: float = math.nan  # measured by the server since its current version was pushed
    next_try: float = 0.0  # monotonic time before which it is not called again
    state_due: float = 0.0  # monotonic time of the next /weight_info and /is_sleeping read
    counters_due: float = 0.0  # monotonic time of the next /metrics read
    backoff_s: float = 0.0
    _counters: SpecCounters | None = None
    _counters_at_push: SpecCounters | None = None

    def row(self) -> dict[str, Any]:
        """The JSON-safe fields (NaN as None)."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if k.startswith("_") or k in ("next_try", "backoff_s", "counters_due", "state_due"):
                continue
            out[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        out["refusals"] = {str(k): v for k, v in self.refusals.items()}
        return out


class Fleet:
    """Every server of the fleet (module docstring).  ``run_dir`` / ``key_file``: what each server's backend is
    bound to (``init_weight_transfer_engine``); ``signer``: signs each update with the run's key; ``pause``:
    ``none`` (the load runs between scheduler steps) or ``keep`` (requests in flight frozen around it)."""

    def __init__(
        self,
        run_dir: str,
        signer: UpdateSigner,
        *,
        key_file: str | None = None,
        api_key: str | None = None,
        pause: str = "none",
        timeout_s: float = 60.0,
        retry_min_s: float = 0.5,
        retry_max_s: float = 30.0,
        counters_every_s: float = 1.0,
        state_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.run_dir = str(run_dir)
        self.run_id = run_dir.rstrip("/").rsplit("/", 1)[-1]
        self.signer = signer
        self.key_file = key_file
        self.api_key = api_key
        self.pause = pause
        self.timeout_s = float(timeout_s)
        self.retry_min_s = float(retry_min_s)
        self.retry_max_s = float(retry_max_s)
        self.counters_every_s = float(counters_every_s)
        self.state_every_s = float(state_every_s)
        self.clock, self.wall = clock, wall
        self.servers: dict[str, ServerState] = {}
        self._clients: dict[str, VLLMServer] = {}
        self._held: dict[tuple[int, str], Version] = {}  # versions pushed, for a re-push after a wake
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def set_servers(self, urls: Iterable[str]) -> None:
        """The fleet is ``urls`` from now on (new ones join with no state; gone ones are dropped)."""
        wanted = list(dict.fromkeys(u.rstrip("/") for u in urls))
        for url in wanted:
            if url not in self.servers:
                self._clients[url] = VLLMServer(url, api_key=self.api_key, timeout_s=self.timeout_s)
                self.servers[url] = ServerState(url)
                log.info("push: server %s joined the fleet", url)
        for url in list(self.servers):
            if url not in wanted:
                del self.servers[url], self._clients[url]
                log.info("push: server %s left the fleet", url)

    # ----------------------------------------------------------------- one round
    def tick(self, newest: Version | None) -> None:
        """One round over every server that is due, the servers in parallel (a slow or dead server delays
        none of the others): read its state, push what it lacks."""
        if newest is not None:
            self._held[(newest.version, newest.sha256)] = newest
        due = [(url, s) for url, s in self.servers.items() if self.clock() >= s.next_try]
        if len(due) > 1:
            list(self._pool(len(due)).map(lambda item: self._round(item[0], item[1], newest), due))
        elif due:
            self._round(*due[0], newest)
        for state in self.servers.values():
            self._update_lag(state, newest)

    def _pool(self, n: int) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None or self._executor._max_workers < min(n, MAX_PARALLEL):
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._executor = concurrent.futures.ThreadPoolExecutor(
                min(n, MAX_PARALLEL), thread_name_prefix="push"
            )
        return self._executor

    def _round(self, url: str, state: ServerState, newest: Version | None) -> None:
        try:
            self._visit(self._clients[url], state, newest)
        except ServerUnreachable as e:
            self._unreachable(state, str(e))
        except ServerRefused as e:  # it answers but will not be bound (pinned to another run, no key...)
            self._unreachable(state, str(e))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _visit(self, client: VLLMServer, state: ServerState, newest: Version | None) -> None:
        """Read the server's state (at most every ``state_every_s``: a new version is pushed on what the last
        read said, so publish → serving costs no extra round trips), push what it lacks, read its counters."""
        now = self.clock()
        if not state.up or now >= state.state_due:
            self._read_state(client, state)
            state.state_due = now + self.state_every_s
        if not state.sleeping:  # a sleeping server is pushed when it wakes
            behind = newest is not None and (state.serving is None or newest.version > state.serving)
            if behind and newest is not None and newest.version not in state.refusals:
                self._push(client, state, newest, again=False)
        if self.clock() >= state.counters_due:  # after the push: reading /metrics delays no version
            state.counters_due = self.clock() + self.counters_every_s
            self._read_counters(client, state)

    def _read_state(self, client: VLLMServer, state: ServerState) -> None:
        """What the server serves and whether it sleeps; bind it after a (re)start; load its version again
        after a wake."""
        was_up, was_sleeping = state.up, state.sleeping
        said = client.serving()  # ServerUnreachable propagates
        restarted = was_up and said is None and state.serving is not None
        if not was_up or restarted:  # (again) after a restart: the backend's binding died with the process
            client.bind(self.run_dir, self.key_file)
            log.info(
                "push: %s is up, serving %s", state.url, f"v{said[0]:04d}" if said else "its start-up draft"
            )
        state.up, state.failing_since, state.backoff_s = True, None, 0.0
        state.sleeping = client.is_sleeping()
        state.serving, state.serving_sha = (said[0], said[1]) if said else (None, None)
        if restarted:
            log.warning("push: %s restarted (serves its start-up draft again)", state.url)
        if (
            was_sleeping and not state.sleeping and said is not None
        ):  # woke: its draft may be the start-up one
            held = self._held.get(said) or Version(
                said[0], 0, f"{self.run_dir}/drafts/v{said[0]:04d}", said[1], self.wall()
            )
            if self._push(client, state, held, again=True):
                log.info("push: %s woke up; v%04d loaded again", state.url, said[0])

    def _push(self, client: VLLMServer, state: ServerState, version: Version, *, again: bool) -> bool:
        msg = DraftPublished(
            run_id=self.run_id,
            draft_version=version.version,
            policy_version=version.policy_version,
            path=version.path,
            sha256=version.sha256,
        )
        start, started_at = self.clock(), self.wall()
        try:
            client.push(
                self.signer.update_info(msg),
                weight_version(version.version, version.sha256),
                pause=self.pause,
            )
        except ServerRefused as e:
            if "not bound" in str(e):  # a server restarted between two reads: bind, then the next tick pushes
                state.up = False
                return False
            if "already active" in str(e):  # another caller's session outlasted the wait: try next round
                state.last_error = str(e)
                return False
            state.refusals[version.version] = str(e)
            state.last_error = str(e)
            log.warning(
                "push: %s refused v%04d: %s; it keeps serving %s",
                state.url,
                version.version,
                e,
                _name(state.serving),
            )
            return False
        state.last_push_s, state.last_push_at = self.clock() - start, started_at
        state.serving, state.serving_sha = version.version, version.sha256
        if again:
            state.repushes += 1
        else:
            state.pushes += 1
            state.last_latency_s = self.wall() - version.published_at
            log.info(
                "push: %s serves v%04d (%.2f s after publish)",
                state.url,
                version.version,
                state.last_latency_s,
            )
        state._counters_at_push = state._counters
        return True

    def _read_counters(self, client: VLLMServer, state: ServerState) -> None:
        try:
            now = client.counters()
        except ServerRefused:
            return  # no /metrics page: acceptance not measured
        prev = state._counters
        state._counters = now
        if prev is None:
            return
        try:
            state.acceptance_length = (now - prev).mean_acceptance_length()
            if state._counters_at_push is not None:
                state.acceptance_since_push = (now - state._counters_at_push).mean_acceptance_length()
        except ValueError:  # counters went backwards: the server restarted
            state._counters_at_push = None

    def _unreachable(self, state: ServerState, why: str) -> None:
        now = self.clock()
        if state.up or state.failing_since is None:
            log.warning("push: %s unreachable (%s); retrying with backoff", state.url, why)
            state.failing_since = self.wall()
        state.up = False
        state.failures += 1
        state.last_error = why
        state.backoff_s = min(self.retry_max_s, max(self.retry_min_s, 2 * state.backoff_s))
        state.next_try = now + state.backoff_s

    def _update_lag(self, state: ServerState, newest: Version | None) -> None:
        behind = newest is not None and (state.serving is None or state.serving < newest.version)
        state.lag_s = self.wall() - newest.published_at if behind and newest is not None else 0.0

    def rows(self) -> dict[str, dict[str, Any]]:
        return {url: s.row() for url, s in self.servers.items()}


def _name(version: int | None) -> str:
    return f"v{version:04d}" if version is not None else "its start-up draft"


__all__ = ["Fleet", "ServerError", "ServerState", "Version"]
