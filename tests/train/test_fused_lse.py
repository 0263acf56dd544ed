"""draft_align.train.fused_lse: Σ m·logsumexp(x Wᵀ) with its gradient formed in the forward pass, against
autograd through the written-out logits (values, gradients, blocks, dtypes, which inputs need a gradient)."""

import pytest
import torch
from torch import nn

from draft_align.train import losses
from draft_align.train.fused_lse import masked_lse_sum
from draft_align.train.losses import row_blocks
from tests.helpers import saved_bytes

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(n=37, h=6, vd=53, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(vd, h, generator=g, dtype=dtype, requires_grad=True)
    m = (torch.rand(n, generator=g) > 0.3).to(dtype)
    arg = torch.randint(0, vd, (n,), generator=g)
    return x, w, m, arg


def reference(x, w, m, arg):
    z = x @ w.t()
    lse = (torch.logsumexp(z, -1) * m).sum()
    agree = ((z.argmax(-1) == arg).to(m.dtype) * m).sum()
    return lse, agree


@pytest.mark.parametrize("rows_per_block", [1, 5, 37, 1000])
def test_value_agreement_and_gradients_equal_autograd(rows_per_block):
    x, w, m, arg = inputs()
    arg[:10] = (x.detach() @ w.detach().t()).argmax(-1)[:10]  # some rows agree, so the count is not 0
    ref, ref_agree = reference(x, w, m, arg)
    ref_gx, ref_gw = torch.autograd.grad(ref * 0.7, (x, w))
    bounds = row_blocks(x.shape[0], 1, rows_per_block)
    val, agree = masked_lse_sum(x, w, m, arg, bounds)
    gx, gw = torch.autograd.grad(val * 0.7, (x, w))
    torch.testing.assert_close(val, ref)
    assert agree.item() == ref_agree.item() >= 1
    torch.testing.assert_close(gx, ref_gx)
    torch.testing.assert_close(gw, ref_gw)


def test_gradcheck_float64():
    x, w, m, arg = inputs(n=7, h=3, vd=11)
    bounds = row_blocks(7, 1, 3)
    assert torch.autograd.gradcheck(lambda a, b: masked_lse_sum(a, b, m, arg, bounds)[0], (x, w))


def test_only_the_inputs_that_need_a_gradient_get_one():
    x, w, m, arg = inputs()
    w.requires_grad_(False)
    val, _ = masked_lse_sum(x, w, m, arg, row_blocks(37, 1, 8))
    val.backward()
    (ref_gx,) = torch.autograd.grad(reference(x, w, m, arg)[0], (x,))
    torch.testing.assert_close(x.grad, ref_gx)
    assert w.grad is None
    vd, h = w.shape
    kept = saved_bytes(lambda: masked_lse_sum(x, w, m, arg, row_blocks(37, 1, 8)))
    assert kept < 8 * vd * h  # no [Vd, H] gradient formed for the frozen weight ([N, H] for x only)
    w.requires_grad_(True)
    assert saved_bytes(lambda: masked_lse_sum(x, w, m, arg, row_blocks(37, 1, 8))) >= kept + 8 * vd * h
    with torch.no_grad():
        val, _ = masked_lse_sum(x, w, m, arg, row_blocks(37, 1, 8))
    assert not val.requires_grad
    torch.testing.assert_close(val, reference(x, w, m, arg)[0].detach())


def test_bf16_autocast_matches_linear_under_autocast():
    """Under CPU autocast the matmuls run in bf16 as F.linear's would; log-sum-exp stays fp32."""
    x, w, m, arg = inputs(n=64, h=32, vd=500, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        val, _ = masked_lse_sum(x, w, m, arg, row_blocks(64, 1, 16))
        z = nn.functional.linear(x, w)
        assert z.dtype == torch.bfloat16
        ref = (torch.logsumexp(z.float(), -1) * m).sum()
    assert val.dtype == torch.float32
    torch.testing.assert_close(val, ref, rtol=1e-4, atol=1e-3)
    gx, gw = torch.autograd.grad(val, (x, w))
    rgx, rgw = torch.autograd.grad(ref, (x, w))
    assert gx.dtype == x.dtype and gw.dtype == w.dtype
    torch.testing.assert_close(gx, rgx, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw, rgw, rtol=2e-2, atol=2e-3)


def test_bad_shapes_are_refused():
    x, w, m, arg = inputs()
    with pytest.raises(ValueError, match=r"x \[N, H\] and w \[Vd, H\]"):
        masked_lse_sum(x, w[:, :3], m, arg, [(0, 37)])
    with pytest.raises(ValueError, match="m and arg must be"):
        masked_lse_sum(x, w, m[:5], arg, [(0, 37)])


@pytest.mark.parametrize("block_bytes", [None, 4 * 40 * 3])
def test_soft_ce_head_fused_equals_checkpointed_blocks(block_bytes):
    """losses.soft_ce_head through the fused path and through checkpointed autograd blocks: same CE sum,
    agreement, count and gradients."""
    g = torch.Generator().manual_seed(3)
    head = nn.Linear(8, 40, bias=False)
    x = torch.randn(2, 9, 8, generator=g, requires_grad=True)
    e = torch.randn(2, 9, 8, generator=g)
    mask = torch.rand(2, 9, generator=g) > 0.3
    arg = (x.detach() @ head.weight.detach().t()).argmax(-1)
    arg[0, :4] = 0

    def run(fused):
        ce, agree, n = losses.soft_ce_head(head, x, e, arg, mask, block_bytes=block_bytes, fused=fused)
        return (ce, agree, n, *torch.autograd.grad(ce, (x, head.weight)))

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b)
