"""Where monitoring goes: JSONL files, wandb and a Prometheus page.  Sinks observe rows, never compute them.

- :class:`JsonlSink`: one JSON object per line, appended (``metrics.jsonl``, ``monitor.jsonl``).
- :class:`WandbSink`: wandb, offline unless configured; wandb is imported here only.
- :class:`PromSink`: ``GET /metrics`` served by ``prometheus_client`` from a registry of its own (never the
  process-global one), one gauge ``draft_align_<key>`` per numeric field of the latest row (``key``
  sanitised: every character outside ``[a-zA-Z0-9_:]`` becomes ``_``, so ``reward/mean`` is
  ``draft_align_reward_mean``; at most ``max_gauges`` distinct names, later new names are dropped and counted
  in ``draft_align_prom_dropped_names_total``) and the counter ``draft_align_wire_rejected_total{reason}``
  (at most ``max_gauges`` reasons).  The HTTP server gives each connection ``timeout_s`` per read and serves
  at most ``max_connections`` at once (more are closed at once), so idle clients cannot pile up threads.
- :class:`Sinks`: what a loop hands its training scalars (:meth:`Sinks.log`) and its monitoring rows
  (:meth:`Sinks.observe`, a :class:`~draft_align.monitor.rows.StepRow`) to.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draft_align.monitor.rows import SidecarStats, StepRow

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from draft_align.config.sections import LoggingConfig

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"  # training scalars, in the folder open_sinks is given
PREFIX = "draft_align_"
REJECTED = "draft_align_wire_rejected"  # exposed as the counter draft_align_wire_rejected_total{reason}
DROPPED_NAMES = "draft_align_prom_dropped_names"  # counter: new metric names refused over max_gauges
_NOT_NAME_CHAR = re.compile(r"[^a-zA-Z0-9_:]")


def prom_name(key: str) -> str:
    """``draft_align_<key>`` with every character outside ``[a-zA-Z0-9_:]`` replaced by ``_`` (a valid
    Prometheus metric name for any string key: the prefix supplies the leading letter)."""
    return PREFIX + _NOT_NAME_CHAR.sub("_", str(key))


class PromError(RuntimeError):
    """The Prometheus page cannot be served (port in use, invalid, not permitted)."""


class JsonlSink:
    """Appends JSON objects to ``path`` (created with its folder), one per line.  The file is opened per
    write, so a reader tailing it sees whole lines and a killed process loses nothing it wrote.

    ``max_bytes``: a line that would take the file past it first moves the file to ``<path>.1`` (replacing an
    older one) and starts it anew, so the two take at most about 2 · ``max_bytes`` whatever arrives (a flood of
    signed step reports grew ``monitor.jsonl`` by 3.46 MB per 200); ``rotations`` counts it, logged once."""

    def __init__(self, path: Path, max_bytes: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_bytes = max_bytes
        self.rotations = 0
        self.failed = 0  # lines lost to a write error (a full disk): logging must never stop training

    def _rotate(self, incoming: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if self.max_bytes is not None and size + incoming > self.max_bytes and size > 0:
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            self.rotations += 1
            (log.warning if self.rotations == 1 else log.debug)(
                "%s reached %d bytes: moved to %s.1 (the newest rows stay in %s)",
                self.path,
                size,
                self.path.name,
                self.path.name,
            )

    def write(self, obj: Mapping[str, Any]) -> None:
        line = json.dumps(obj) + "\n"
        try:
            self._rotate(len(line.encode()))
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as e:
            self.failed += 1
            if self.failed in (1, 10) or self.failed % 1000 == 0:
                log.error("%s: line not written (%s); %d lost so far", self.path, e, self.failed)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """A scalar series point: ``{"step", "time", **metrics}``."""
        self.write({"step": step, "time": time.time(), **metrics})


class WandbSink:
    """wandb logging; a failure to start it is logged and disables it (logging must never stop training)."""

    def __init__(
        self, run_dir: Path, logging_config: LoggingConfig, name: str, config: dict[str, Any]
    ) -> None:
        self.run: Any = None
        try:
            import wandb

            self.run = wandb.init(
                project=logging_config.wandb_project,
                name=name,
                dir=str(run_dir),
                mode=logging_config.wandb_mode,
                config=config,
                reinit="finish_previous",
            )
        except Exception as e:  # noqa: BLE001 - logging must never stop training
            log.warning("wandb disabled: %s", e)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def _serve(
    registry: Any, host: str, port: int, timeout_s: float, max_connections: int
) -> tuple[Any, threading.Thread]:
    """A threaded WSGI server for ``registry`` whose connections time out after ``timeout_s`` without a byte
    and of which at most ``max_connections`` are served at once (prometheus_client's own has neither)."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    slots = threading.BoundedSemaphore(max_connections)

    class Handler(WSGIRequestHandler):
        timeout = timeout_s  # StreamRequestHandler: settimeout on the connection

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        request_queue_size = 128  # listen backlog: a burst of connections is accepted (and refused) quickly

        def handle_error(self, request: Any, client_address: Any) -> None:
            log.debug(
                "Prometheus connection from %s dropped", client_address, exc_info=True
            )  # e.g. timed out

        def process_request(self, request: Any, client_address: Any) -> None:
            if not slots.acquire(blocking=False):
                self.shutdown_request(request)  # over the bound: closed, no thread
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                slots.release()
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                slots.release()

    try:
        httpd = make_server(host, port, make_wsgi_app(registry), Server, handler_class=Handler)
    except (OSError, OverflowError) as e:
        raise PromError(f"cannot serve Prometheus metrics on {host}:{port}: {e}") from e
    t = threading.Thread(target=httpd.serve_forever, name="prometheus", daemon=True)
    t.start()
    return httpd, t


class PromSink:
    """The latest row's numbers as Prometheus gauges at ``http://host:port/metrics`` (port 0: any free port,
    see ``.port``).  A field that is None or not a number leaves its gauge at the last value set.  Names,
    bounds and the server's limits: the module docstring.  PromError when the port cannot be bound."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_gauges: int = 1000,
        timeout_s: float = 5.0,
        max_connections: int = 32,
    ) -> None:
        from prometheus_client import CollectorRegistry

        self._lock = threading.Lock()
        self._gauges: dict[str, float] = {}
        self._rejected: dict[str, float] = {}
        self.max_gauges = int(max_gauges)
        self.dropped_names = 0  # new names refused because max_gauges were in use
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server, self._thread = _serve(self.registry, host, port, timeout_s, max_connections)
        self.host = host
        self.port: int = int(self._server.server_port)
        self._closed = False
        log.info("Prometheus metrics at %s", self.url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def observe(self, row: StepRow | SidecarStats) -> None:
        """Set :func:`prom_name` ``(key)`` for each int/float field of ``row.to_dict()`` (not bools, not
        ``time``) and the rejection counter; names beyond ``max_gauges`` are dropped and counted."""
        stats = row.sidecar if isinstance(row, StepRow) else row
        gauges = {}
        for k, v in row.to_dict().items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or k == "time":
                continue
            gauges[prom_name(k)] = float(v)
        with self._lock:
            for name, v in gauges.items():
                if name in self._gauges or len(self._gauges) < self.max_gauges:
                    self._gauges[name] = v
                else:
                    self.dropped_names += 1
            for reason, n in stats.rejected.items():
                if reason in self._rejected or len(self._rejected) < self.max_gauges:
                    self._rejected[str(reason)] = float(n)

    def collect(self) -> Iterator[Metric]:
        """The registry's collector interface (called by the HTTP server's thread)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            gauges, rejected, dropped = dict(self._gauges), dict(self._rejected), self.dropped_names
        for name in sorted(gauges):
            yield GaugeMetricFamily(name, "", value=gauges[name])
        yield CounterMetricFamily(DROPPED_NAMES, "metric names dropped over the bound", value=dropped)
        if rejected:
            c = CounterMetricFamily(REJECTED, "wire messages rejected", labels=["reason"])
            for reason in sorted(rejected):
                c.add_metric([reason], rejected[reason])
            yield c

    def write_port_file(self, path: str | os.PathLike[str]) -> Path:
        """Write the port as text to ``path`` atomically (temp file in the same folder, then rename)."""
        return write_port_file(path, self.port)

    def close(self) -> None:
        """Stop serving and release the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


class Sinks:
    """A loop's sinks: ``metrics`` (training scalars and row series), optional ``wandb`` (the same), optional
    ``monitor`` (one JSON line per row) and optional ``prom``."""

    def __init__(
        self,
        metrics: JsonlSink,
        *,
        wandb: WandbSink | None = None,
        monitor: JsonlSink | None = None,
        prom: PromSink | None = None,
    ) -> None:
        self.metrics = metrics
        self.wandb = wandb
        self.monitor = monitor
        self.prom = prom

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Training scalars at ``step`` (``metrics.jsonl`` and wandb)."""
        self.metrics.log(metrics, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step)

    def observe(self, row: StepRow) -> None:
        """A monitoring row: its JSON line, its ``rl/*`` series at the sidecar's train step, its gauges."""
        if self.monitor is not None:
            self.monitor.write(row.to_dict())
        self.log(row.series(), row.train_step)
        if self.prom is not None:
            self.prom.observe(row)

    def observe_stats(self, stats: SidecarStats) -> None:
        """The sidecar's counters between rows (after a publish): Prometheus only."""
        if self.prom is not None:
            self.prom.observe(stats)

    def close(self) -> None:
        if self.prom is not None:
            self.prom.close()
        if self.wandb is not None:
            self.wandb.close()


def open_sinks(
    run_dir: Path,
    logging_config: LoggingConfig,
    name: str,
    config: dict[str, Any],
    *,
    monitor: Path | None = None,
    monitor_max_bytes: int | None = None,
    prom: PromSink | None = None,
) -> Sinks:
    """``<run_dir>/metrics.jsonl``, wandb when ``logging.wandb`` is on and its mode is not ``disabled``
    (``config``: the resolved recipe, recorded in the wandb run), a monitor file and a Prometheus sink."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lc = logging_config
    wandb = WandbSink(run_dir, lc, name, config) if lc.wandb and lc.wandb_mode != "disabled" else None
    return Sinks(
        JsonlSink(run_dir / METRICS_FILE),
        wandb=wandb,
        monitor=JsonlSink(monitor, monitor_max_bytes) if monitor is not None else None,
        prom=prom,
    )


def write_port_file(path: str | os.PathLike[str], port: int) -> Path:
    """Write ``port`` (1..65535) as text to ``path`` atomically; creates the parent folder."""
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an int in 1..65535, got {port!r}")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{port}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def read_port_file(path: str | os.PathLike[str]) -> int:
    """The port written by ``write_port_file`` (FileNotFoundError if absent, ValueError if not a port)."""
    text = Path(path).read_text().strip()
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{path}: expected a port number, got {text[:40]!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"{path}: port {port} out of range 1..65535")
    return port
