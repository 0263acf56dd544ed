"""verl's device abstraction on a CPU, as a verl platform plugin: verl 0.9 has no CPU platform of its own.

Importing this module registers ``CPUPlatform`` as verl's platform ``cpu`` (``PlatformRegistry``) and makes it
the current one (``set_platform``): the test process imports it from conftest.py; a verl Ray worker imports it
through verl's own plugin hook, ``VERL_USE_EXTERNAL_MODULES`` (read by ``import verl``, before any verl module
asks for the device), with ``VERL_PLATFORM=cpu`` (:func:`worker_env`).  It is imported there by its own
top-level name, from this folder on the worker's path: verl's wheel installs a ``tests`` package of its own,
which shadows this checkout's ``tests`` outside pytest."""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform


def worker_env(pythonpath: str) -> dict[str, str]:
    """What a verl Ray worker's environment needs to run on this platform (``RayWorkerGroup``'s ``worker_env``):
    this folder then ``pythonpath`` on its path, the plugin imported by ``import verl``, the platform chosen by
    name, and verl's FSDP engine (registered for "cuda"/"npu" only) selected through verl's own engine override
    (``VERL_ENGINE_DEVICE``)."""
    return {
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), pythonpath]),
        "VERL_USE_EXTERNAL_MODULES": Path(__file__).stem,
        "VERL_PLATFORM": "cpu",
        "VERL_ENGINE_DEVICE": "cuda",
        "GLOO_SOCKET_IFNAME": "lo",  # gloo on 127.0.0.1 only
    }


class CPUDeviceModule:
    """``torch.cpu`` with the ``torch.cuda`` memory calls verl makes on its device module (``get_torch_device()``:
    ``aggressive_empty_cache``, memory logging): no device memory, nothing to free."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    def empty_cache(self) -> None:
        pass

    def memory_allocated(self, device=None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    def mem_get_info(self, device=None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def set_per_process_memory_fraction(self, fraction: float, device=None) -> None:
        pass

    def reset_peak_memory_stats(self, device=None) -> None:
        pass


@PlatformRegistry.register(platform="cpu")
class CPUPlatform(PlatformBase):
    """verl's device abstraction on a CPU: every device call is a no-op on "cpu"."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = CPUDeviceModule()

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


set_platform(CPUPlatform())  # before verl's engine modules are imported: they read the device name then
