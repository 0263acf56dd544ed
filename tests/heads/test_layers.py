"""draft_align.heads.layers: the TTT attention in query blocks equals the dense computation (values and
gradients), its prefix mask equals the explicit one, and what it keeps for backward grows linearly in T."""

import math

import pytest
import torch

from draft_align.heads import layers
from draft_align.heads.layers import PrefixMask, attend
from tests.helpers import saved_bytes

B, H, KV, D = 2, 4, 2, 8


def dense_reference(q, k0, v0, allow, diag_k, diag_v):
    """Attention written out per query with an explicit [B, 1, M, T] bool mask, K/V repeated per head."""
    rep = H // KV
    k = k0.repeat_interleave(rep, dim=1)  # [B, h, T, d]
    v = v0.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # [B, h, M, T]
    s = s.masked_fill(~allow, float("-inf"))
    ds = [(q * kd.repeat_interleave(rep, dim=1)).sum(-1, keepdim=True) / math.sqrt(D) for kd in diag_k]
    p = torch.cat([s, *ds], dim=-1).softmax(-1)
    t = k0.shape[2]
    out = p[..., :t] @ v
    for i, vd in enumerate(diag_v):
        out = out + p[..., t + i : t + i + 1] * vd.repeat_interleave(rep, dim=1)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], H * D)


def chain_inputs(t: int, m: int, n_diag: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, m, D, generator=g, requires_grad=True)
    k0 = torch.randn(B, KV, t, D, generator=g, requires_grad=True)
    v0 = torch.randn(B, KV, t, D, generator=g, requires_grad=True)
    dk = [torch.randn(B, KV, m, D, generator=g, requires_grad=True) for _ in range(n_diag)]
    dv = [torch.randn(B, KV, m, D, generator=g, requires_grad=True) for _ in range(n_diag)]
    starts = torch.sort(torch.randint(0, t, (B, m), generator=g), dim=1).values
    valid = torch.ones(B, t, dtype=torch.bool)
    valid[1, t - t // 3 :] = False  # row 1 is padded at the end
    sv = starts < t - t // 3
    sv[0] = True
    return q, k0, v0, dk, dv, PrefixMask.chains(starts, sv, valid), starts, sv, valid


def grads(out, tensors):
    w = torch.linspace(-1, 1, out.numel()).view_as(out)  # a fixed, non-uniform upstream gradient
    return torch.autograd.grad((out * w).sum(), tensors)


@pytest.mark.parametrize("t,m,n_diag", [(7, 5, 0), (19, 13, 2), (33, 33, 3)])
@pytest.mark.parametrize("block_queries", [1, 3, 7])
def test_blocked_attention_equals_dense_values_and_gradients(t, m, n_diag, block_queries):
    q, k0, v0, dk, dv, mask, starts, sv, valid = chain_inputs(t, m, n_diag, seed=t + m)
    allow = (torch.arange(t).view(1, 1, t) <= starts.unsqueeze(-1)) & valid.unsqueeze(1) & sv.unsqueeze(-1)
    allow = (allow | ~sv.unsqueeze(-1)).unsqueeze(1)  # padded queries see everything
    tensors = (q, k0, v0, *dk, *dv)
    ref = dense_reference(q, k0, v0, allow, dk, dv)
    one = attend(q, k0, v0, mask, dk, dv, block_bytes=1 << 40)  # a single block
    block_bytes = 4 * B * H * (t + n_diag) * block_queries  # exactly block_queries queries per block
    blocked = attend(q, k0, v0, mask, dk, dv, block_bytes=block_bytes)
    torch.testing.assert_close(one, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(blocked, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads(blocked, tensors), grads(ref, tensors), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_appended_mask_is_past_plus_causal():
    past, m = 4, 3
    want = torch.ones(m, past + m, dtype=torch.bool)
    want[:, past:] = torch.ones(m, m, dtype=torch.bool).tril()
    assert torch.equal(PrefixMask.appended(past, m, torch.device("cpu")).rows(0, m, past + m)[0, 0], want)


def test_no_shared_keys_uses_the_private_ones_only():
    """T = 0 shared keys (MTP modules d ≥ 1): softmax over the chain's own keys alone."""
    q, _, _, dk, dv, _, starts, _, _ = chain_inputs(5, 4, 2, seed=3)
    empty = torch.zeros(B, KV, 0, D)
    out = attend(q, empty, empty, PrefixMask(starts), dk, dv, block_bytes=4 * B * H * 2)  # 1 query a block
    ref = dense_reference(q, empty, empty, torch.ones(B, 1, 4, 0, dtype=torch.bool), dk, dv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_blocked_attention_keeps_linear_memory_dense_keeps_quadratic(monkeypatch):
    """Doubling T (every position a chain start) doubles what blocked attention keeps for backward; the
    single-block computation (the old one) keeps its [M, T] scores and grows ~4×."""

    def kept(t: int, block_bytes: int | None) -> int:
        q, k0, v0, dk, dv, _, _, _, _ = chain_inputs(t, t, 2, seed=0)
        mask = PrefixMask.chains(
            torch.arange(t).expand(B, t),
            torch.ones(B, t, dtype=torch.bool),
            torch.ones(B, t, dtype=torch.bool),
        )
        return saved_bytes(lambda: attend(q, k0, v0, mask, dk, dv, block_bytes=block_bytes))

    small = 4 * B * H * 64  # ~ one 64-key query per block at T = 64
    dense = [kept(t, 1 << 40) for t in (128, 256)]
    blocked = [kept(t, small) for t in (128, 256)]
    assert dense[1] / dense[0] > 3.5
    assert blocked[1] / blocked[0] < 2.2
    assert blocked[1] < dense[1] / 10
    monkeypatch.setattr(layers, "ATTN_BLOCK_BYTES", small)  # the default is read at call time
    assert kept(256, None) == blocked[1]
