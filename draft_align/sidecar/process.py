"""The sidecar as a child process of an RL job (the co-training launcher, the TRL callback): start it, wait
until it has bound its sockets, stop it.  The RL job never depends on it: a sidecar that does not come up,
or dies, only means taps are dropped (counted) and the last draft stays in use."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def spawn_sidecar(recipe_file: Path, start: Path, log_file: Path, ranks: int = 1) -> subprocess.Popen:
    """The sidecar as a child process; with ``ranks`` > 1 under torchrun (one rank per process)."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    )
    cmd = [
        sys.executable,
        *launcher,
        "-m",
        "draft_align",
        "sidecar",
        str(recipe_file),
        "--draft",
        str(start),
        "--exit-when-done",
    ]
    fh = open(log_file, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, run_dir: Path, timeout_s: float) -> bool:
    """At start only: wait until the sidecar has bound its sockets (its ready file names its pid), so the
    first steps' taps are not dropped while it loads.  False on timeout or if it died (the RL job then runs
    on: it never depends on the sidecar)."""
    from draft_align.sidecar.layout import READY_FILE, SIDECAR_DIR

    path = run_dir / SIDECAR_DIR / READY_FILE
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        try:
            ready = json.loads(path.read_text())
            if proc.pid in (
                ready.get("pid"),
                ready.get("ppid"),
            ):  # ppid: torchrun's agent (sidecar.ranks > 1)
                return True
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.2)
    log.warning(
        "the sidecar is not ready after %.0f s (exit code %s): the RL job starts without it",
        timeout_s,
        proc.poll(),
    )
    return False


def stop_sidecar(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """Wait up to ``timeout_s`` for the sidecar to finish on its own, then SIGTERM, then SIGKILL."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def kill_at_exit(proc: subprocess.Popen) -> None:
    """Kill ``proc`` when this interpreter exits if it is still running (a caller that raised before its
    clean stop must not leave a sidecar behind; a clean stop first makes this a no-op)."""
    import atexit

    def _reap() -> None:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    atexit.register(_reap)
