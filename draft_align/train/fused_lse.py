"""Σ_r m_r · logsumexp(x_r Wᵀ) over a large vocabulary with its gradient formed in the forward pass.

The soft-CE step (train/losses.py) is CE_r = logsumexp(z_r) − x_r·e_r with z = x Wᵀ.  Autograd through the
blocked logits keeps nothing vocabulary-sized, but only by recomputing each block's logits in backward (a
checkpoint): one more [rows, H]×[H, Vd] matmul and a second pass of the cast / max / exp work per block, then
the backward's own sub / exp / mul over [rows, Vd].  Here each block is visited once: z, its log-sum-exp and
softmax s, then the two products the backward needs, m·s W [rows, H] and (m·s)ᵀ x [Vd, H], accumulated
as the blocks go.  Backward scales them by the upstream gradient (a scalar: the function returns the sum),
so what is kept is O(N·H + Vd·H) and the lm_head matmuls per step drop from four to three.

Agreement Σ_r m_r·1[z_r(a_r) = max z_r] (the teacher-forced argmax match) comes from the same pass: a tie for the
maximum counts as agreement.

Dtypes follow ``F.linear`` under autocast: the matmuls run in the autocast dtype (bf16) when autocast is on
for the device and neither operand is float64, otherwise in their promoted dtype; log-sum-exp and softmax in at
least fp32; the weight's gradient is accumulated in at least fp32 across blocks.
"""

from __future__ import annotations

from typing import Any

import torch


def compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(x, w)`` computes in here: the autocast dtype where autocast would cast them."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and torch.float64 not in (x.dtype, w.dtype):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(x.dtype, w.dtype)


class _MaskedLSESum(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        m: torch.Tensor,
        arg: torch.Tensor,
        bounds: list[tuple[int, int]],
        cdt: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = torch.promote_types(cdt, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            xc, wc = x.to(cdt), w.to(cdt)
            lse_sum = torch.zeros((), dtype=acc, device=x.device)
            agree = torch.zeros((), dtype=acc, device=x.device)
            gx = torch.zeros(x.shape, dtype=x.dtype, device=x.device) if need_x else None
            gw: torch.Tensor | None = None  # the first block's product, then the sum (no zero-filled start)
            gw_dtype = torch.promote_types(acc, w.dtype)
            for lo, hi in bounds:
                mb = m[lo:hi].to(acc)
                z = torch.matmul(xc[lo:hi], wc.t()).to(acc)  # [rows, Vd]
                mx = z.amax(-1, keepdim=True)
                hit = (z.gather(-1, arg[lo:hi].unsqueeze(-1)) >= mx).squeeze(-1)
                agree += (hit.to(acc) * mb).sum()
                z.sub_(mx).exp_()
                tot = z.sum(-1, keepdim=True)
                lse_sum += ((tot.log() + mx).squeeze(-1) * mb).sum()
                if gx is None and not need_w:
                    continue
                s = z.mul_(mb.unsqueeze(-1) / tot).to(cdt)  # m·softmax(z), the lse-sum's gradient in z
                del z
                if gx is not None:
                    gx[lo:hi] = torch.matmul(s, wc).to(x.dtype)
                if need_w:
                    part = torch.matmul(s.t(), xc[lo:hi])
                    gw = part.to(gw_dtype) if gw is None else gw.add_(part)
        ctx.save_for_backward(gx, gw)
        ctx.w_dtype = w.dtype
        ctx.mark_non_differentiable(agree)
        return lse_sum, agree

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _g_agree: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        gx, gw = ctx.saved_tensors
        dx = None if gx is None else gx * g.to(gx.dtype)
        dw = None if gw is None else (gw * g.to(gw.dtype)).to(ctx.w_dtype)
        return dx, dw, None, None, None, None


def masked_lse_sum(
    x: torch.Tensor, w: torch.Tensor, m: torch.Tensor, arg: torch.Tensor, bounds: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_r m_r·logsumexp(x_r Wᵀ), Σ_r m_r·1[argmax_r = arg_r]) for x [N, H], w [Vd, H], m [N] (0/1 weights),
    arg [N] vocabulary indices, rows visited in the ``bounds`` blocks ([lo, hi) covering 0..N).  The first is
    differentiable in x and w (its gradient formed in the forward pass, see the module); the second is not."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"masked_lse_sum: x [N, H] and w [Vd, H] expected, got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    if m.shape != x.shape[:1] or arg.shape != x.shape[:1]:
        raise ValueError(
            f"masked_lse_sum: m and arg must be [{x.shape[0]}], got {tuple(m.shape)}, {tuple(arg.shape)}"
        )
    return _MaskedLSESum.apply(x, w, m, arg, bounds, compute_dtype(x, w))
