"""The push process's view of a fleet of vLLM servers, read from the run folder (``draft-align monitor
--servers``): where ``draft-align push`` writes its state, and that state as a table.

One row per server: whether it answered, the draft version it serves against the run's newest, the lag, the
pushes (and re-pushes after a wake or a restart), failures and refusals, and the acceptance length the server
itself measured (its ``/metrics`` counters: *measured*, between the push process's last two reads and since
its version was pushed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PUSH_DIR = "push"  # <run>/push/: the push process's files
PUSH_STATE_FILE = "state.json"  # the latest state, replaced atomically
PUSH_ROWS_FILE = "push.jsonl"  # a state row on every change and at least every push.row_every_s
PUSH_PORT_FILE = "prometheus.port"

COLUMNS = (
    "server",
    "up",
    "serving",
    "newest",
    "lag s",
    "pushes",
    "re-pushes",
    "failures",
    "refused",
    "L now",
    "L since push",
)


def read_push_state(run_dir: str | Path) -> dict[str, Any] | None:
    """``<run>/push/state.json`` (None when there is none or it is not a JSON object)."""
    try:
        state = json.loads((Path(run_dir) / PUSH_DIR / PUSH_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("servers"), dict) else None


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, int | float) and math.isfinite(v) else "-"


def _version(v: Any) -> str:
    return f"v{v:04d}" if isinstance(v, int) else "start-up"


def format_servers(state: dict[str, Any]) -> str:
    """The fleet as a fixed-width table (a header, then one line per server)."""
    newest = state.get("newest")
    rows = [COLUMNS]
    for url, s in state["servers"].items():
        rows.append(
            (
                str(url),
                "yes" if s.get("up") else "NO",
                _version(s.get("serving")),
                _version(newest) if newest is not None else "-",
                _num(s.get("lag_s"), ".1f"),
                _num(s.get("pushes"), "d"),
                _num(s.get("repushes"), "d"),
                _num(s.get("failures"), "d"),
                ",".join(sorted(s.get("refusals") or {})) or "-",
                _num(s.get("acceptance_length"), ".3f"),
                _num(s.get("acceptance_since_push"), ".3f"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
