"""Whether training autocasts to bf16: only where the device computes bf16 natively.

On a CPU without AVX-512 BF16 or AMX, PyTorch emulates bf16 matmuls and a train step is about ten times
slower than in fp32 (measured: 266 s for one 512-token step on an AVX2-only EPYC), so ``autocast_bf16: null``
(the default) means bf16 on CUDA devices that support it and on CPUs with those instructions, fp32 elsewhere.
``true``/``false`` force it.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

_CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU's flags list AVX-512 BF16 or AMX-BF16 (Linux x86); Apple silicon and other
    platforms without a flag list are taken as not native (fp32 is never wrong, only slower)."""
    if platform.system() != "Linux":
        return False
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return bool(_CPU_BF16_FLAGS & set(line.split(":", 1)[-1].split()))
    return False


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 matmuls natively."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_native_bf16()
    return False


def resolve_autocast(setting: bool | None, device: torch.device) -> bool:
    """The recipe's ``autocast_bf16`` (None = automatic) for ``device``."""
    return native_bf16(device) if setting is None else bool(setting)
