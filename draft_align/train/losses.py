"""Training-time-test (TTT) losses for EAGLE-3 heads (docs/formats.md §1 and docs/acceptance.md).

Per step j the draft's distribution q_j over the draft vocabulary is fitted to the target's
distribution p restricted to the draft vocabulary and renormalised:

    L_j = mean_{valid chains} − Σ_x p(x) log q_j(x)          (soft CE = forward KL + const)
    L   = Σ_j w_j L_j,   w_j = decay^j                         (EAGLE/SpecForge: K = 7, decay 0.8)

The ``*_head`` forms and :func:`soft_targets` compute the same sums with no [rows, Vd] tensor kept for
backward (row blocks, each checkpointed); :func:`truncate_batch` is the trainer's per-sequence cap
(docs/sizing.md §5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from draft_align.heads.vocab import draft_logits
from draft_align.train.records import Batch

CESums = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (Σ CE, Σ argmax agreement, count), scalars


@dataclass
class StepStats:
    """Per-step sums for one batch (added across batches, divided at logging time)."""

    loss: torch.Tensor  # [K] Σ soft CE over valid chains
    correct: torch.Tensor  # [K] Σ 1[argmax q == argmax p]  (teacher-forced T=0 acceptance of step j)
    count: torch.Tensor  # [K] number of valid chains


def step_weights(steps: int, decay: float) -> list[float]:
    return [decay**j for j in range(steps)]


def soft_ce_step(
    q_logits: torch.Tensor, p_dot_z: torch.Tensor, p_argmax: torch.Tensor, mask: torch.Tensor
) -> CESums:
    """Soft cross-entropy of one TTT step, CE = logsumexp(z) − Σ_x p(x) z(x)  (Σ p = 1).

    q_logits z [B, M, Vd] draft logits; p_dot_z [B, M] the expectation Σ_x p(x) z(x) under the target's
    distribution p over the draft vocab; p_argmax [B, M] argmax of p; mask [B, M] valid chains.
    Returns (Σ CE, Σ argmax agreement, count), all scalars.
    """
    ce = torch.logsumexp(q_logits.float(), dim=-1) - p_dot_z.float()  # [B, M]
    m = mask.to(ce.dtype)
    agree = (q_logits.argmax(-1) == p_argmax).to(ce.dtype)
    return (ce * m).sum(), (agree * m).sum(), m.sum()


def soft_ce_reference(q_logits: torch.Tensor, p_logp: torch.Tensor) -> torch.Tensor:
    """−Σ_x p(x) log q(x) per row, written out (for tests): q_logits, p_logp [..., Vd] → [...]."""
    return -(p_logp.float().exp() * torch.log_softmax(q_logits.float(), dim=-1)).sum(-1)


def hard_ce_step(
    q_logits: torch.Tensor, target_draft_ids: torch.Tensor, mask: torch.Tensor
) -> CESums:
    """Cross-entropy on sampled tokens (unbiased forward-KL estimate for on-policy tokens).

    q_logits [B, M, Vd]; target_draft_ids [B, M] draft ids of the next tokens (−1 when outside the
    draft vocab: such chains are masked out); mask [B, M].
    """
    ok = mask & (target_draft_ids >= 0)
    q_logp = torch.log_softmax(q_logits.float(), dim=-1)
    ce = -q_logp.gather(-1, target_draft_ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    m = ok.to(ce.dtype)
    agree = (q_logits.argmax(-1) == target_draft_ids).to(ce.dtype)
    return (ce * m).sum(), (agree * m).sum(), m.sum()


# ----------------------------------------------------------------------------- memory-bounded forms
LOGITS_BLOCK_BYTES = 32 * 2**20  # fp32 logits of one row block at most (the blocked losses' default)
MAX_SEQ_TOKENS = 8192  # the trainer's default per-sequence cap (longer rows are truncated, counted)


def row_blocks(n: int, row_bytes: int, block_bytes: int | None) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering n rows, each of at most max(1, ⌊block_bytes / row_bytes⌋) rows
    (``block_bytes`` None: :data:`LOGITS_BLOCK_BYTES`)."""
    c = max(1, (block_bytes or LOGITS_BLOCK_BYTES) // max(1, row_bytes))
    return [(lo, min(n, lo + c)) for lo in range(0, n, c)] or [(0, 0)]


def _blocked(fn: Callable[..., Any], args: tuple[torch.Tensor, ...], bounds: list[tuple[int, int]]) -> list[Any]:
    """fn on each row block of args (all [N, ...]); with more than one block and autograd on, each block is
    checkpointed: its intermediates (the [rows, Vd] logits) are recomputed in backward, never kept."""
    if len(bounds) == 1:
        return [fn(*args)]
    from torch.utils.checkpoint import checkpoint

    recompute = torch.is_grad_enabled()
    out = []
    for lo, hi in bounds:
        part = tuple(a[lo:hi] for a in args)
        out.append(checkpoint(fn, *part, use_reentrant=False) if recompute else fn(*part))
    return out


def soft_targets(
    final: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, block_bytes: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The soft target's two uses, without a [B, T, Vd] tensor: (e = Wᵀp [B, T, H], argmax p [B, T]).

    final [B, T, H_t] target final hidden; rows [Vd, H_t] the target's head rows over the draft vocab;
    w [Vd, H] the draft's lm_head weight.  p = softmax(final · rowsᵀ) is the target's distribution over
    the draft vocab; CE(p, q) = logsumexp(z) − Σ_x p(x) z(x) with z = W x, and the second term is x · e.
    Positions run in blocks of ⌊block_bytes / (4·Vd)⌋; p is recomputed per block in backward (the gradient
    reaches w through e = Wᵀp), so memory is O(T·H) plus one block's [rows, Vd].
    """
    b, t, _ = final.shape
    vd = rows.shape[0]

    def block(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            tl = draft_logits(f, rows).float()  # [N, Vd]
            p_arg = tl.argmax(-1)
            p = torch.softmax(tl, dim=-1).to(w.dtype)
            del tl
        return torch.matmul(p, w), p_arg

    flat = final.reshape(b * t, final.shape[-1])
    parts = _blocked(block, (flat,), row_blocks(b * t, 4 * vd, block_bytes))
    ep = torch.cat([e for e, _ in parts]).view(b, t, -1)
    p_arg = torch.cat([a for _, a in parts]).view(b, t)
    return ep, p_arg


def soft_ce_head(
    head: nn.Linear,
    x: torch.Tensor,
    e: torch.Tensor,
    p_argmax: torch.Tensor,
    mask: torch.Tensor,
    block_bytes: int | None = None,
) -> CESums:
    """:func:`soft_ce_step` of z = head(x), summed over row blocks so that one block's logits live at a time.

    x [B, M, H] the lm_head's input; e [B, M, H] Wᵀp at each chain's scored position (Σ_x p(x) z(x) = x·e);
    p_argmax [B, M]; mask [B, M].  Blocks of ⌊block_bytes / (4·Vd)⌋ rows, checkpointed under autograd
    (logits recomputed in backward): saved memory O(B·M·H) instead of O(B·M·Vd).
    """

    def block(xc: torch.Tensor, ec: torch.Tensor, ac: torch.Tensor, mc: torch.Tensor) -> CESums:
        return soft_ce_step(head(xc), (xc * ec).sum(-1), ac, mc)

    return _sum_blocks(block, x, (e, p_argmax, mask), head.weight.shape[0], block_bytes)


def hard_ce_head(
    head: nn.Linear,
    x: torch.Tensor,
    target_draft_ids: torch.Tensor,
    mask: torch.Tensor,
    block_bytes: int | None = None,
) -> CESums:
    """:func:`hard_ce_step` of z = head(x) (x [B, M, H]; target_draft_ids, mask [B, M]) in row blocks, as
    :func:`soft_ce_head`."""
    return _sum_blocks(lambda xc, ic, mc: hard_ce_step(head(xc), ic, mc), x, (target_draft_ids, mask),
                       head.weight.shape[0], block_bytes)


def _sum_blocks(
    fn: Callable[..., CESums], x: torch.Tensor, rest: tuple[torch.Tensor, ...], vd: int, block_bytes: int | None
) -> CESums:
    """Σ over row blocks of fn(x, *rest) (x [..., H]; rest [...] or [..., H]) → (Σ CE, Σ agreement, count)."""
    n = x.shape[:-1].numel()
    bounds = row_blocks(n, 4 * vd, block_bytes)
    if len(bounds) == 1:
        return fn(x, *rest)
    lead = x.dim() - 1
    parts = _blocked(fn, (x.reshape(n, x.shape[-1]), *(r.reshape(n, *r.shape[lead:]) for r in rest)), bounds)
    ce, agree, count = (torch.stack(list(v)).sum() for v in zip(*parts, strict=True))
    return ce, agree, count


def truncate_batch(batch: Batch, max_tokens: int, steps: int) -> tuple[Batch, int, int]:
    """The batch cut to its first ``max_tokens`` positions, with its chain starts recomputed for ``steps``
    TTT steps (as :func:`~draft_align.train.records.collate` lists them for the cut rows).

    Attention is causal and a step's inputs precede its target, so the cut batch's loss is the full rows'
    loss over the targets at positions < max_tokens (their mean).  Returns (batch, rows cut, targets
    dropped: response tokens at positions ≥ max_tokens); the batch itself when no row is longer.
    """
    t = batch.input_ids.shape[1]
    if t <= max_tokens:
        return batch, 0, 0
    rows_cut = int(batch.valid[:, max_tokens:].any(-1).sum())
    dropped = int((batch.loss_mask[:, max_tokens:] & batch.valid[:, max_tokens:]).sum())
    lm = batch.loss_mask[:, :max_tokens]
    hit = torch.zeros_like(lm)
    for j in range(steps):  # chain start s trains iff loss_mask[s+2+j] for some j < steps
        off = 2 + j
        if off < max_tokens:
            hit[:, : max_tokens - off] |= lm[:, off:]
    pos = torch.arange(max_tokens, device=lm.device).expand_as(lm)
    order = torch.where(hit, pos, pos + max_tokens).sort(dim=1).values  # chain starts first, ascending
    m = max(1, int(hit.sum(1).max()))
    sv = order[:, :m] < max_tokens
    starts = torch.where(sv, order[:, :m], torch.zeros_like(order[:, :m]))
    cut = Batch(batch.input_ids[:, :max_tokens], batch.valid[:, :max_tokens], lm, batch.aux[:, :max_tokens],
                batch.final[:, :max_tokens], starts, sv)
    return cut, rows_cut, dropped
