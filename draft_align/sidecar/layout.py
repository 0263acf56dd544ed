"""Where a sidecar lives in a run folder: ``<run>/sidecar/`` and its files (docs/formats.md); the sockets it binds
are named by the wire (``wire/endpoints.py``: ``tap_endpoint``, ``notify_endpoint``).

The launcher (``cotrain.py``) and the RL side find the sidecar by these names; the monitor reads its files.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SIDECAR_DIR = "sidecar"  # <run>/sidecar/
TRAINER_DIR = "trainer"  # <run>/sidecar/trainer/: the trainer checkpoint
STATE_FILE = "state.json"  # SidecarState, beside the trainer checkpoint
MONITOR_FILE = "monitor.jsonl"  # one monitoring row per RL step (lead rank)
PUBLISH_FILE = "publish.jsonl"  # one line per published version
PORT_FILE = "prometheus.port"  # the Prometheus page's port
READY_FILE = "ready.json"  # written once the sockets are bound: {"pid", "ppid", "time", "draft_version", …}
RAY_ENDPOINTS_FILE = "ray_endpoints.json"  # sidecar.host=ray: each rank's bound tap endpoint, by rank
WIRE_RECORDING = "wire.rec"  # sidecar.recording.enabled: every valid message received (wire/recording.py)
LOCK_FILE = "lock"  # held (flock) by the live sidecar of the run (sidecar/lock.py)
GUARD_FILE = (
    "sequence_guard.json"  # the receiver's sequence guard, kept across restarts (wire/sequence_guard.py)
)


def guard_name(rank: int | None) -> str:
    """The sequence guard's file in ``<run>/sidecar/``: ``sequence_guard.json``; under torchrun ``sequence_guard-rank<r>.json``."""
    return GUARD_FILE if rank is None else f"sequence_guard-rank{rank}.json"


def lock_name(rank: int | None) -> str:
    """The run lock's file name in ``<run>/sidecar/``: ``lock`` (one process, or rank 0); ``lock-rank<r>``."""
    return LOCK_FILE if not rank else f"{LOCK_FILE}-rank{rank}"


def recording_name(rank: int | None) -> str:
    """The recording's file name in ``<run>/sidecar/``: ``wire.rec``; under torchrun ``wire-rank<r>.rec``."""
    return WIRE_RECORDING if rank is None else f"wire-rank{rank}.rec"


def write_ready(sidecar_dir: Path, info: dict[str, Any]) -> None:
    """``ready.json`` (atomically): the sockets are bound.  On a full disk the error is logged and the
    sidecar serves anyway (the launcher then times out waiting, and says so)."""
    tmp = Path(sidecar_dir) / f".{READY_FILE}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(info))
        os.replace(tmp, Path(sidecar_dir) / READY_FILE)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.error("cannot write %s: %s", Path(sidecar_dir) / READY_FILE, e)
