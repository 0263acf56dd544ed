"""verl on this CPU: verl 0.9 lives in its own venv (`make verl-venv`, .venv-verl); `make test` runs this folder
with it.  The main venv has no verl and collects nothing here.  verl has no CPU platform of its own: a CPU one
is registered through verl's platform plugin API (``PlatformBase`` / ``set_platform``)."""

from __future__ import annotations

import importlib.util
import socket
from contextlib import contextmanager, nullcontext

import pytest

if importlib.util.find_spec("verl") is None:  # the main venv: `make test` runs this folder in .venv-verl
    collect_ignore_glob = ["test_*.py"]
else:
    import os

    from tests.integrations.ray.conftest import RAY_ENV

    os.environ.update(RAY_ENV)  # before verl imports Ray: 127.0.0.1 only (tests/integrations/ray/conftest.py)

    import torch
    from verl.plugin.platform.platform_base import PlatformBase

    class CPUPlatform(PlatformBase):
        """verl's device abstraction on a CPU: every device call is a no-op on "cpu"."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self):  # the device tensors are moved to (`.to(get_device_id())`)
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            with nullcontext():
                yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    from verl.plugin.platform.platform_manager import set_platform

    set_platform(CPUPlatform())  # before verl's engine modules are imported: they read the device name then

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
