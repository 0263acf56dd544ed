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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from draft_align.monitor.sinks import read_port_file

logger = logging.getLogger(__name__)

MONITOR_LOG = Path("sidecar") / "monitor.jsonl"
RL_LOG = Path("rl") / "steps.jsonl"
PORT_FILE = Path("sidecar") / "prometheus.port"


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is missing, not a number (bools included), non-finite or
    an integer beyond float range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        v = float(value)
    except OverflowError:
        return None
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


MAX_LINE_BYTES = 1 << 20  # a monitor row is a few KiB: a longer line is damage, skipped without being held
_MAX_STEP = 2**63 - 1
_READ_CHUNK = 1 << 20  # bytes read per poll: a large log is streamed, never held whole


class BadLines:
    """The lines of one log that were skipped (not a JSON object, a ``step`` that is not an integer in
    0..2^63−1, longer than MAX_LINE_BYTES): counted, the first one's place and reason kept; :meth:`report`
    logs one warning line with the count (again only if more were skipped since)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self.count = 0
        self.first = ""
        self.reported = 0

    def add(self, where: str, why: str) -> None:
        self.count += 1
        self.first = self.first or f"{where}: {why}"

    def report(self) -> None:
        if self.count > self.reported:
            said = (self.path, self.count, self.first)
            if said not in _SAID:  # the same file read again by this process (report, then its advice)
                logger.warning("%s: skipped %d bad line(s); the first: %s", *said)
                if len(_SAID) > 1000:
                    _SAID.clear()
                _SAID.add(said)
            self.reported = self.count


_SAID: set[tuple[str, int, str]] = set()  # bad-line warnings already logged by this process


def _check_step(obj: dict[str, Any]) -> str | None:
    """Why the record's ``step`` (optional) is unusable, or None."""
    step = obj.get("step")
    if step is None:
        return None
    ok = not isinstance(step, bool) and (
        (isinstance(step, int) and 0 <= step <= _MAX_STEP)
        or (isinstance(step, float) and step.is_integer() and 0 <= step <= _MAX_STEP)
    )
    return None if ok else f"step {str(step)[:40]} is not an integer in 0..2^63-1"


def parse_line(line: bytes | str, where: str = "", bad: BadLines | None = None) -> dict[str, Any] | None:
    """One JSONL line → dict; None for a blank line, or a bad one (counted in ``bad``; without it, a warning)."""
    if len(line) > MAX_LINE_BYTES:
        why: str | None = f"longer than {MAX_LINE_BYTES} bytes"
    else:
        text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
        if not text.strip():
            return None
        try:
            obj = json.loads(text)
            why = (
                _check_step(obj) if isinstance(obj, dict) else f"expected an object, got {type(obj).__name__}"
            )
        except (
            ValueError,
            RecursionError,
        ) as e:  # JSONDecodeError, an int over Python's digit limit, nesting
            why = f"not JSON ({' '.join(str(e).split())[:80]})"
        if why is None:
            return obj
    if bad is not None:
        bad.add(where, why)
    else:
        logger.warning("skipping line %s: %s", where, why)
    return None


def iter_jsonl(path: str | os.PathLike[str], bad: BadLines | None = None) -> Iterator[dict[str, Any]]:
    """Every complete JSON object line of ``path``, read line by line (memory: one line, ≤ MAX_LINE_BYTES).
    A last line without its newline (being written) is left out; bad lines are skipped, counted in ``bad``
    and reported in one warning when the file is done.  FileNotFoundError when the file does not exist."""
    bad = bad if bad is not None else BadLines(path)
    with open(path, "rb") as f:
        i = 0
        while line := f.readline(MAX_LINE_BYTES + 1):
            i += 1
            if not line.endswith(b"\n"):
                if len(line) <= MAX_LINE_BYTES:
                    break  # the last line, still being written
                bad.add(f"{path}:{i}", f"longer than {MAX_LINE_BYTES} bytes")
                while (rest := f.readline(MAX_LINE_BYTES + 1)) and not rest.endswith(b"\n"):
                    pass  # the rest of the long line, dropped as it is read
                continue
            rec = parse_line(line, f"{path}:{i}", bad)
            if rec is not None:
                yield rec
    bad.report()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """:func:`iter_jsonl` as a list (for small logs)."""
    return list(iter_jsonl(path))


def last_record(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The last complete, good JSON object line of ``path`` (None when there is none in its last
    MAX_LINE_BYTES), read from the file's end: cheap however long the log."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - MAX_LINE_BYTES)
        f.seek(start)
        lines = f.read().split(b"\n")
    lines.pop()  # after the last newline: empty, or a line being written
    if start > 0 and lines:
        lines.pop(0)  # may begin mid-line
    for line in reversed(lines):
        rec = parse_line(line, str(path), BadLines(path))
        if rec is not None:
            return rec
    return None


class _Tail:
    """Complete lines appended to a file since the last poll, at most ``_READ_CHUNK`` bytes a poll (``behind``:
    more is there already); survives the file being absent, truncated or replaced (then it starts again from
    the beginning).  A line longer than MAX_LINE_BYTES is dropped as it is read and counted in ``bad``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.pending = b""
        self.skipping = False  # inside an over-long line: drop up to its newline
        self.inode: int | None = None
        self.behind = False
        self.bad = BadLines(path)

    def poll(self) -> list[bytes]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if self.inode is not None and (st.st_ino != self.inode or st.st_size < self.offset):
            logger.warning("%s was truncated or replaced; reading it from the start", self.path)
            self.offset, self.pending, self.skipping = 0, b"", False
        self.inode = st.st_ino
        if st.st_size == self.offset:
            self.behind = False
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(_READ_CHUNK)
        self.offset += len(chunk)
        self.behind = self.offset < st.st_size
        lines = (self.pending + chunk).split(b"\n")
        self.pending = lines.pop()
        if self.skipping and lines:
            lines.pop(0)  # the end of the over-long line
            self.skipping = False
        if self.skipping:
            self.pending = b""
        elif len(self.pending) > MAX_LINE_BYTES:
            self.bad.add(
                f"{self.path} at byte {self.offset - len(self.pending)}",
                f"longer than {MAX_LINE_BYTES} bytes",
            )
            self.pending, self.skipping = b"", True
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
    bad = tail.bad
    while True:
        lines = tail.poll()
        for line in lines:
            line_no += 1
            rec = parse_line(line, f"{path}:{line_no}", bad)
            if rec is not None:
                out.write(format_row(rec) + "\n")
                rows += 1
        if lines:
            out.flush()
            last_news = time.monotonic()
        if not once and bad.count and not bad.reported:
            bad.report()  # the first bad line at once; the total when following ends
        if once and tail.behind:
            continue
        if once:
            bad.report()
            return rows
        if not announced and tail.inode is None:
            out.write(f"# waiting for {path} ...\n")
            out.flush()
            announced = True
        if max_wait_s is not None and time.monotonic() - last_news >= max_wait_s:
            bad.report()
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
        self._tail.bad.report()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._print_ready(final=False)

    def _read(self) -> None:
        while True:
            for line in self._tail.poll():
                rec = parse_line(line, str(self._tail.path), self._tail.bad)
                step = number(rec.get("step")) if rec is not None else None
                if rec is not None and step is not None:
                    self._sidecar.setdefault(int(step), {}).update(
                        {k: v for k, v in rec.items() if v is not None}
                    )
            if not self._tail.behind:
                return

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
