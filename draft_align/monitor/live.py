"""Watching a co-training run: follow ``<run>/sidecar/monitor.jsonl`` as a table, scrape the Prometheus page.

``monitor.jsonl`` holds one JSON object per RL step (the RL job's StepReport merged with the sidecar's
state); every key is optional and unknown keys are ignored.  ``follow`` prints ``HEADER`` then one
``format_row`` line per record, like ``tail -f``: it waits for the file to appear, and for a partially
written last line to get its newline before printing it.  :class:`LiveTable` is the table ``draft-align
cotrain`` prints as it runs: the RL job's metrics of each step merged with the sidecar's row of that step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from draft_align.monitor.sinks import read_port_file

logger = logging.getLogger(__name__)

MONITOR_LOG = Path("sidecar") / "monitor.jsonl"
RL_LOG = Path("rl") / "steps.jsonl"
PORT_FILE = Path("sidecar") / "prometheus.port"


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is missing, not a number (bools included) or non-finite."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _fmt_int(v: float) -> str:
    return str(int(round(v)))


def _fixed(digits: int) -> Callable[[float], str]:
    return lambda v: f"{v:.{digits}f}"


def _percent(v: float) -> str:
    return f"{100.0 * v:.0f}%"


@dataclass(frozen=True)
class Column:
    """One table column: the record keys it shows (first present one wins), its title, width and format."""

    keys: tuple[str, ...]
    title: str
    width: int
    fmt: Callable[[float], str]

    def value(self, record: Mapping[str, Any]) -> float | None:
        for k in self.keys:
            v = number(record.get(k))
            if v is not None:
                return v
        return None

    def cell(self, record: Mapping[str, Any]) -> str:
        """Right-aligned to ``width``; ``-`` when missing (a wider value widens the cell, never truncates)."""
        v = self.value(record)
        return ("-" if v is None else self.fmt(v)).rjust(self.width)


# Messages that never reached the sidecar: every drop the wire sender counted (queue full, peer gone, too
# large, invalid, closed), else the Tap's own count of messages its sink refused.
DROP_KEYS: tuple[str, ...] = ("wire_dropped", "tap_messages_dropped")

# Estimated acceptance falls back to the probabilistic-mode estimate when a run only computes that one.
COLUMNS: tuple[Column, ...] = (
    Column(("step",), "step", 6, _fmt_int),
    Column(("policy_version",), "pol.v", 5, _fmt_int),
    Column(("draft_version",), "drf.v", 5, _fmt_int),
    Column(("staleness",), "stale", 5, _fmt_int),
    Column(("reward_mean",), "reward", 8, _fixed(3)),
    Column(("kl_to_initial",), "KL", 8, _fixed(4)),
    Column(("accept_measured_adapted",), "acc.ad", 6, _fixed(3)),
    Column(("accept_measured_frozen",), "acc.fr", 6, _fixed(3)),
    Column(("accept_est_adapted", "accept_est_adapted_prob"), "est.ad", 6, _fixed(3)),
    Column(("accept_est_frozen", "accept_est_frozen_prob"), "est.fr", 6, _fixed(3)),
    Column(("buffer_fill",), "buf", 4, _percent),
    Column(DROP_KEYS, "drops", 6, _fmt_int),
    Column(("wire_rejected",), "rej", 5, _fmt_int),
    Column(("sidecar_train_tokens_per_s",), "train tok/s", 11, _fixed(0)),
)
SEP = " "


def format_header(columns: tuple[Column, ...] = COLUMNS) -> str:
    """The titles, right-aligned to the column widths."""
    return SEP.join(c.title.rjust(c.width) for c in columns)


def format_row(record: Mapping[str, Any], columns: tuple[Column, ...] = COLUMNS) -> str:
    """One fixed-width table row for a monitor record (missing values print as ``-``)."""
    if not isinstance(record, Mapping):
        raise TypeError(f"a monitor record must be a mapping, got {type(record).__name__}")
    return SEP.join(c.cell(record) for c in columns)


HEADER: str = format_header()


def parse_line(line: bytes | str, where: str = "") -> dict[str, Any] | None:
    """One JSONL line → dict; None (with a warning) for a malformed or non-object line, or a blank one."""
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        logger.warning("skipping malformed JSON line %s: %s", where, e)
        return None
    if not isinstance(obj, dict):
        logger.warning("skipping JSON line %s: expected an object, got %s", where, type(obj).__name__)
        return None
    return obj


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete JSON object line of ``path``; a last line without its newline (being written) and
    malformed lines are skipped.  FileNotFoundError when the file does not exist."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    lines.pop()  # the text after the last newline: empty, or a line still being written
    out = []
    for i, line in enumerate(lines, 1):
        rec = parse_line(line, f"{path}:{i}")
        if rec is not None:
            out.append(rec)
    return out


class _Tail:
    """Complete lines appended to a file since the last poll; survives the file being absent, truncated or
    replaced (then it starts again from the beginning)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.pending = b""
        self.inode: int | None = None

    def poll(self) -> list[bytes]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if self.inode is not None and (st.st_ino != self.inode or st.st_size < self.offset):
            logger.warning("%s was truncated or replaced; reading it from the start", self.path)
            self.offset, self.pending = 0, b""
        self.inode = st.st_ino
        if st.st_size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        lines = (self.pending + chunk).split(b"\n")
        self.pending = lines.pop()
        return lines


def follow(
    run_dir: str | os.PathLike[str],
    *,
    once: bool = False,
    interval_s: float = 1.0,
    out: IO[str] | None = None,
    max_wait_s: float | None = None,
) -> int:
    """Print ``HEADER`` and a row per record of ``<run_dir>/sidecar/monitor.jsonl``; returns the rows printed.

    once=True: print the complete lines there are and return (FileNotFoundError if the log is absent).
    Otherwise poll every ``interval_s`` for new complete lines, waiting for the file to appear; return once
    nothing new has arrived for ``max_wait_s`` seconds (None: follow until interrupted).
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    if max_wait_s is not None and max_wait_s < 0:
        raise ValueError(f"max_wait_s must be >= 0 or None, got {max_wait_s}")
    out = out if out is not None else sys.stdout  # looked up per call: stdout may be replaced after import
    path = Path(run_dir) / MONITOR_LOG
    if once and not path.exists():
        raise FileNotFoundError(f"no monitor log at {path} (is {run_dir} a co-training run folder?)")
    tail = _Tail(path)
    out.write(HEADER + "\n")
    out.flush()
    rows = 0
    line_no = 0
    announced = False
    last_news = time.monotonic()
    while True:
        lines = tail.poll()
        for line in lines:
            line_no += 1
            rec = parse_line(line, f"{path}:{line_no}")
            if rec is not None:
                out.write(format_row(rec) + "\n")
                rows += 1
        if lines:
            out.flush()
            last_news = time.monotonic()
        if once:
            return rows
        if not announced and tail.inode is None:
            out.write(f"# waiting for {path} ...\n")
            out.flush()
            announced = True
        if max_wait_s is not None and time.monotonic() - last_news >= max_wait_s:
            return rows
        time.sleep(interval_s)


class LiveTable:
    """The co-training run's table as it runs: one row per RL step, the RL job's metrics merged with the
    sidecar's ``monitor.jsonl`` row of the same step (its estimates, buffer fill, training rate and counters;
    its keys win, as in ``monitor.jsonl`` and ``report.md``).

    The RL job never waits for it: :meth:`add` hands over a step's metrics and returns.  A background thread
    polls ``monitor_path`` every ``poll_s`` and prints the steps in order, each as soon as the sidecar's row of
    that step is there, or without it (``-`` in the sidecar's columns) once ``row_wait_s`` has passed since
    :meth:`add`, a later step's sidecar row has arrived, or ``sidecar_alive()`` is false.  :meth:`close`
    prints what is left (call it after the sidecar has exited, so its last rows are in).
    """

    def __init__(
        self,
        monitor_path: str | os.PathLike[str],
        out: IO[str],
        *,
        row_wait_s: float = 30.0,
        poll_s: float = 0.2,
        sidecar_alive: Callable[[], bool] = lambda: True,
    ) -> None:
        if row_wait_s < 0 or poll_s <= 0:
            raise ValueError(f"row_wait_s must be ≥ 0 and poll_s > 0, got {row_wait_s}, {poll_s}")
        self._tail = _Tail(Path(monitor_path))
        self._out = out
        self._row_wait_s = row_wait_s
        self._poll_s = poll_s
        self._alive = sidecar_alive
        self._sidecar: dict[int, dict[str, Any]] = {}
        self._pending: list[tuple[int, dict[str, Any], float]] = []  # (step, RL metrics, time added)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rows: list[str] = []  # what was printed, in order (header excluded)
        self.merged = 0  # rows printed with the sidecar's row of their step

    def start(self) -> LiveTable:
        """Print the header and start the printing thread; returns self."""
        self._out.write(HEADER + "\n")
        self._out.flush()
        self._thread = threading.Thread(target=self._run, name="draft-align-live-table", daemon=True)
        self._thread.start()
        return self

    def add(self, metrics: Mapping[str, Any]) -> None:
        """Queue one RL step's metrics (they must hold its ``step``); never blocks on the sidecar."""
        step = number(metrics.get("step"))
        if step is None:
            raise ValueError("a step's metrics must hold its step number")
        with self._lock:
            self._pending.append((int(step), dict(metrics), time.monotonic()))

    def close(self) -> None:
        """Stop the thread, read the sidecar's last rows and print every step still pending."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._print_ready(final=True)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._print_ready(final=False)

    def _read(self) -> None:
        for line in self._tail.poll():
            rec = parse_line(line, str(self._tail.path))
            step = number(rec.get("step")) if rec is not None else None
            if rec is not None and step is not None:
                self._sidecar.setdefault(int(step), {}).update(
                    {k: v for k, v in rec.items() if v is not None}
                )

    def _print_ready(self, final: bool) -> None:
        with self._lock:
            self._read()
            newest = max(self._sidecar, default=-1)
            # final: the caller has stopped the sidecar, so every row it wrote is in
            give_up = final or not self._alive()
            now = time.monotonic()
            lines = []
            while self._pending:
                step, metrics, added = self._pending[0]
                side = self._sidecar.get(step)
                if side is None and not (give_up or newest > step or now - added >= self._row_wait_s):
                    break  # later steps wait behind this one: rows stay in step order
                self._pending.pop(0)
                self.merged += side is not None
                lines.append(format_row({**metrics, **(side or {})}))
            self.rows += lines
        if lines:
            self._out.write("".join(x + "\n" for x in lines))
            self._out.flush()


# --- Prometheus text pages ---------------------------------------------------------------------------------


def sample_key(name: str, labels: Mapping[str, str] | None = None) -> str:
    """The key ``parse_metrics`` uses: ``name``, or ``name{a="x",b="y"}`` (labels sorted, values escaped)."""
    if not labels:
        return name
    esc = {k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()}
    return name + "{" + ",".join(f'{k}="{esc[k]}"' for k in sorted(esc)) + "}"


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page keyed by ``sample_key`` (parsed by ``prometheus_client``); a
    repeated sample keeps its last value, timestamps are ignored.  ValueError on a malformed line."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[sample_key(s.name, s.labels)] = float(s.value)
    return out


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """GET a Prometheus page and ``parse_metrics`` it.  URLError/HTTPError propagate."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return parse_metrics(resp.read().decode("utf-8"))


def metrics_url(run_dir: str | os.PathLike[str]) -> str | None:
    """The sidecar's metrics URL from ``<run_dir>/sidecar/prometheus.port``; None if that file is absent."""
    try:
        port = read_port_file(Path(run_dir) / PORT_FILE)
    except FileNotFoundError:
        return None
    return f"http://127.0.0.1:{port}/metrics"
