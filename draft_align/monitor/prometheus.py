"""A minimal Prometheus endpoint (text exposition format 0.0.4) on the standard library alone.

``PromExporter`` keeps gauges and counters in memory and serves them at ``GET /metrics`` from a
``ThreadingHTTPServer`` in a daemon thread.  A page looks like::

    # HELP draft_align_buffer_fill replay buffer fill, 0..1
    # TYPE draft_align_buffer_fill gauge
    draft_align_buffer_fill 0.25
    # HELP draft_align_wire_rejected_total wire messages rejected
    # TYPE draft_align_wire_rejected_total counter
    draft_align_wire_rejected_total{reason="mac"} 3

Names must match ``[a-zA-Z_:][a-zA-Z0-9_:]*`` (label names ``[a-zA-Z_][a-zA-Z0-9_]*``, not ``__*``);
label values escape ``\\``, ``"`` and newline; a gauge set to None has no sample until it is set again;
NaN and ±Inf print as ``NaN`` / ``+Inf`` / ``-Inf``.  Any name prefix is the caller's business.
"""

from __future__ import annotations

import http.server
import logging
import math
import numbers
import os
import re
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

MetricType = Literal["gauge", "counter"]
LabelKey = tuple[tuple[str, str], ...]  # sorted (label name, label value) pairs


@dataclass
class _Family:
    """One metric name: its type, help text and a value per label set (None: no sample)."""

    kind: MetricType
    help: str = ""
    samples: dict[LabelKey, float | None] = field(default_factory=dict)


def check_metric_name(name: str) -> None:
    """Raise ValueError unless ``name`` is a valid Prometheus metric name."""
    if not isinstance(name, str) or not METRIC_NAME_RE.match(name):
        raise ValueError(f"invalid Prometheus metric name {name!r}: must match {METRIC_NAME_RE.pattern}")


def label_key(labels: Mapping[str, Any] | None) -> LabelKey:
    """Validated, sorted label pairs; values are converted with ``str``."""
    if not labels:
        return ()
    out = []
    for k, v in labels.items():
        if not isinstance(k, str) or not LABEL_NAME_RE.match(k) or k.startswith("__"):
            raise ValueError(
                f"invalid Prometheus label name {k!r}: must match {LABEL_NAME_RE.pattern} and not start with '__'"
            )
        out.append((k, str(v)))
    return tuple(sorted(out))


def escape_label_value(value: str) -> str:
    """Escape a label value for the text format: ``\\`` → ``\\\\``, ``"`` → ``\\"``, newline → ``\\n``."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """Escape HELP text: ``\\`` → ``\\\\``, newline → ``\\n`` (quotes stay as they are)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value as the text format writes it: ``NaN``, ``+Inf``, ``-Inf``, integers without ``.0``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def format_sample(name: str, key: LabelKey, value: float) -> str:
    """One sample line: ``name{a="b"} value``."""
    if key:
        inner = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in key)
        return f"{name}{{{inner}}} {format_value(value)}"
    return f"{name} {format_value(value)}"


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, str):
        return float(value)
    raise TypeError(f"metric {name}: value must be a real number or None, got {type(value).__name__}")


class PromExporter:
    """Gauges and counters served at ``http://host:port/metrics`` (port 0: any free port; see ``.port``).

    Thread-safe: every update and every page render holds one lock.  ``close()`` stops the server.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        handler = _make_handler(self)
        self._server = http.server.ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},  # how long close() may wait for the loop to notice shutdown
            name=f"prometheus-{self.port}",
            daemon=True,
        )
        self._thread.start()
        self._closed = False
        logger.info("Prometheus metrics at http://%s:%d/metrics", host, self.port)

    @property
    def url(self) -> str:
        """The metrics page's URL."""
        return f"http://{self.host}:{self.port}/metrics"

    def _family(self, name: str, kind: MetricType, help: str) -> _Family:
        check_metric_name(name)
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = _Family(kind=kind, help=help)
        elif fam.kind != kind:
            raise ValueError(f"metric {name} is a {fam.kind}, cannot use it as a {kind}")
        elif help and not fam.help:
            fam.help = help
        return fam

    def set_gauge(
        self, name: str, value: float | None, help: str = "", labels: Mapping[str, Any] | None = None
    ) -> None:
        """Set a gauge sample; None removes the sample from the page until it is set again."""
        v = None if value is None else _as_float(name, value)
        key = label_key(labels)
        with self._lock:
            self._family(name, "gauge", help).samples[key] = v

    def inc_counter(
        self, name: str, amount: float = 1.0, help: str = "", labels: Mapping[str, Any] | None = None
    ) -> float:
        """Add ``amount`` ≥ 0 (finite) to a counter that starts at 0; returns the new total."""
        a = _as_float(name, amount)
        if not math.isfinite(a) or a < 0:
            raise ValueError(f"counter {name}: increment must be finite and >= 0, got {amount!r}")
        key = label_key(labels)
        with self._lock:
            fam = self._family(name, "counter", help)
            total = (fam.samples.get(key) or 0.0) + a
            fam.samples[key] = total
        return total

    def set_counter(
        self, name: str, total: float | None, help: str = "", labels: Mapping[str, Any] | None = None
    ) -> None:
        """Mirror a running total kept elsewhere; it may not go down (ValueError).  None changes nothing."""
        key = label_key(labels)
        if total is None:
            with self._lock:
                self._family(name, "counter", help)
            return
        t = _as_float(name, total)
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"counter {name}: total must be finite and >= 0, got {total!r}")
        with self._lock:
            fam = self._family(name, "counter", help)
            prev = fam.samples.get(key)
            if prev is not None and t < prev:
                raise ValueError(f"counter {name}{dict(key)}: total went down from {prev} to {t}")
            fam.samples[key] = t

    def render(self) -> str:
        """The whole page in text exposition format 0.0.4 (metrics in name order, samples in label order)."""
        lines: list[str] = []
        with self._lock:
            for name in sorted(self._families):
                fam = self._families[name]
                if fam.help:
                    lines.append(f"# HELP {name} {escape_help(fam.help)}")
                lines.append(f"# TYPE {name} {fam.kind}")
                for key in sorted(fam.samples):
                    v = fam.samples[key]
                    if v is not None:
                        lines.append(format_sample(name, key, v))
        return "\n".join(lines) + "\n" if lines else ""

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

    def __enter__(self) -> PromExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _make_handler(exporter: PromExporter) -> type[http.server.BaseHTTPRequestHandler]:
    class _Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server interface)
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served")
                return
            body = exporter.render().encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base signature)
            logger.debug("%s " + format, self.address_string(), *args)

    return _Handler
