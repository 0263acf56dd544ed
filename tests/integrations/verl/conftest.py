"""verl on this CPU: verl 0.9 lives in its own venv (`make verl-venv`, .venv-verl); `make test` runs this folder
with it.  The main venv has no verl and collects nothing here.  verl has no CPU platform of its own: a CPU one
is registered through verl's platform plugin API (verl_cpu_platform.py)."""

from __future__ import annotations

import importlib.util
import socket

import pytest

if importlib.util.find_spec("verl") is None:  # the main venv: `make test` runs this folder in .venv-verl
    collect_ignore_glob = ["test_*.py"]
else:
    import os

    from tests.integrations.ray.conftest import RAY_ENV

    os.environ.update(RAY_ENV)  # before verl imports Ray: 127.0.0.1 only (tests/integrations/ray/conftest.py)

    import sys
    from pathlib import Path

    # verl's CPU platform, set on import; by its top-level name, as verl's Ray workers import it
    # (verl_cpu_platform.py says why)
    sys.path.insert(0, str(Path(__file__).parent))
    import verl_cpu_platform  # noqa: F401

    @pytest.fixture(scope="session")
    def gloo_world():
        """A one-rank gloo process group on 127.0.0.1 (verl's engine all-reduces the batch's token count)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        yield
