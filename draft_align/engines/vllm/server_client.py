"""One vLLM server over HTTP: vLLM's RL routes (served with ``VLLM_SERVER_DEV_MODE=1``) and its ``/metrics``.

:class:`VLLMServer` pushes one draft version as vLLM's own sequence — ``POST /start_draft_weight_update``,
``POST /update_weights`` (the signed update of :mod:`~draft_align.engines.vllm.draft_update`), ``POST
/finish_weight_update`` with the version as ``weight_version`` — optionally between ``POST /pause?mode=keep``
and ``POST /resume`` (requests in flight are frozen, not aborted), and reads back ``GET /weight_info``,
``GET /is_sleeping`` and the spec-decode counters of ``GET /metrics``.  Standard library only (urllib); the
server's API key goes in every request as ``Authorization: Bearer`` (vLLM guards ``/v1`` with it; its RL
routes are not guarded, which is why an update must carry the run's signature).

Errors: :class:`ServerUnreachable` (no answer: connection refused, timeout; retry later) and
:class:`ServerRefused` (the server answered with an error: the message it gave, e.g. the backend's reason).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from draft_align.engines.vllm.counters import SpecCounters
from draft_align.engines.vllm.draft_update import parse_weight_version
from draft_align.monitor.live import parse_metrics

PAUSE_MODES = ("none", "keep")  # how requests in flight are handled during a push (docs/servers.md)
MAX_BODY_BYTES = 8 << 20  # the most a response body is read
RL_ROUTES = (
    "/weight_info",
    "/start_weight_update",
    "/init_weight_transfer_engine",
    "/start_draft_weight_update",
    "/update_weights",
    "/finish_weight_update",
)


class ServerError(RuntimeError):
    """A call to a vLLM server failed."""


class ServerUnreachable(ServerError):
    """The server did not answer (refused connection, timeout, reset): try again later."""


class ServerRefused(ServerError):
    """The server answered with an error status; the message is the server's own (one line)."""


def _error_text(body: bytes) -> str:
    """The one-line reason of a vLLM error body (``{"error": {"message": …}}`` or ``{"error": "…"}``)."""
    try:
        obj = json.loads(body.decode("utf-8", "replace"))
    except ValueError:
        return (
            body.decode("utf-8", "replace").strip().splitlines()[0][:500] if body.strip() else "(empty body)"
        )
    err = obj.get("error", obj.get("detail", obj)) if isinstance(obj, dict) else obj
    msg = err.get("message", err) if isinstance(err, dict) else err
    text = str(msg)
    marker = "Worker failed with error '"
    if marker in text:  # vLLM wraps a worker's exception: keep the worker's own words
        text = text.split(marker, 1)[1].rsplit("', please check", 1)[0]
    return " ".join(text.split())[:1000]


class VLLMServer:
    """A vLLM server at ``url`` (``http://host:port``); ``api_key``: sent as a bearer token when given;
    ``busy_timeout_s``: how long a weight update waits for another caller's session to close."""

    def __init__(
        self, url: str, *, api_key: str | None = None, timeout_s: float = 60.0, busy_timeout_s: float = 30.0
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"server URL {url!r}: expected http://host:port or https://host:port")
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.busy_timeout_s = float(busy_timeout_s)

    def __repr__(self) -> str:
        return f"VLLMServer({self.url!r})"

    def _call(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, timeout_s: float | None = None
    ) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                return resp.read(MAX_BODY_BYTES)
        except urllib.error.HTTPError as e:
            if e.code == 404 and path in RL_ROUTES:
                raise ServerRefused(
                    f"{method} {path}: HTTP 404: the server has no vLLM RL routes (start it with "
                    f"VLLM_SERVER_DEV_MODE=1; drafts need vLLM ≥ 0.32's start_draft_weight_update)"
                ) from None
            raise ServerRefused(
                f"{method} {path}: HTTP {e.code}: {_error_text(e.read(MAX_BODY_BYTES))}"
            ) from None
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise ServerUnreachable(f"{method} {path}: {reason}") from None

    def _json(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        raw = self._call(method, path, body)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ServerRefused(f"{method} {path}: not JSON ({e})") from None

    # ----------------------------------------------------------------- state
    def healthy(self) -> bool:
        """``GET /health`` answered 200."""
        try:
            self._call("GET", "/health", timeout_s=min(self.timeout_s, 5.0))
        except ServerError:
            return False
        return True

    def weight_version(self) -> str:
        """vLLM's ``weight_version`` (``GET /weight_info``)."""
        return str(self._json("GET", "/weight_info").get("weight_version"))

    def serving(self) -> tuple[int, str] | None:
        """(version, sha256) the server says it serves (None: its start-up draft, or not set by draft_align)."""
        return parse_weight_version(self.weight_version())

    def is_sleeping(self) -> bool:
        """``GET /is_sleeping`` (False where the route is absent: a server without sleep mode)."""
        try:
            return bool(self._json("GET", "/is_sleeping").get("is_sleeping"))
        except ServerRefused:
            return False

    def counters(self) -> SpecCounters:
        """The server's spec-decode counters from ``GET /metrics`` (summed over engines)."""
        samples = parse_metrics(self._call("GET", "/metrics").decode("utf-8", "replace"))
        return SpecCounters.from_samples(samples)

    # ----------------------------------------------------------------- updates
    def bind(self, run_dir: str, key_file: str | None = None) -> None:
        """``POST /init_weight_transfer_engine``: the run whose versions the server's backend loads."""
        self._call(
            "POST", "/init_weight_transfer_engine", {"init_info": {"run_dir": run_dir, "key_file": key_file}}
        )

    def push(self, update_info: Mapping[str, Any], weight_version: str, *, pause: str = "none") -> None:
        """Load one version: start → update → finish (``pause="keep"``: between ``/pause?mode=keep`` and
        ``/resume``).  ServerRefused carries the backend's reason; the previous version keeps serving then."""
        if pause not in PAUSE_MODES:
            raise ValueError(f"pause {pause!r}: expected one of {PAUSE_MODES}")
        if pause == "keep":
            self._call("POST", "/pause?mode=keep")
        try:
            self._begin("/start_draft_weight_update")
            self._call("POST", "/update_weights", {"update_info": dict(update_info)})
            self._call("POST", "/finish_weight_update", {"weight_version": weight_version})
        finally:
            if pause == "keep":
                self._call("POST", "/resume")

    def push_policy(self, update_info: Mapping[str, Any]) -> None:
        """A policy sync (``rl.engine.kind: server``): start → update → finish of a target session; vLLM's
        ``weight_version`` stays the draft's (the push process reads it)."""
        self._begin("/start_weight_update")
        self._call("POST", "/update_weights", {"update_info": dict(update_info)})
        self._call("POST", "/finish_weight_update", {})

    def _begin(self, route: str) -> None:
        """Open a weight-update session.  vLLM has one at a time per server: while another caller's is open (the
        RL job's policy sync beside the push process's draft), wait for it, up to ``busy_timeout_s``; a session
        still open after that was left by a caller that died mid-update: close it, then open ours."""
        deadline = time.monotonic() + self.busy_timeout_s
        wait = 0.02
        while True:
            try:
                self._call("POST", route)
                return
            except ServerRefused as e:
                if "already active" not in str(e):
                    raise
            if time.monotonic() >= deadline:
                self._call("POST", "/finish_weight_update", {})  # a session a killed caller left open
                self._call("POST", route)
                return
            time.sleep(wait)
            wait = min(0.5, 2 * wait)

    # ----------------------------------------------------------------- generation
    def complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /v1/completions`` with ``body``; the response object."""
        out = self._json("POST", "/v1/completions", body)
        if not isinstance(out, dict) or not out.get("choices"):
            raise ServerRefused(f"POST /v1/completions: no choices in the answer ({str(out)[:200]})")
        return out

    def served_models(self) -> list[str]:
        """The model names the server serves (``GET /v1/models``)."""
        data = self._json("GET", "/v1/models").get("data") or []
        return [str(m.get("id")) for m in data if isinstance(m, dict)]
