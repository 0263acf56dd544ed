"""Training-time-test (TTT) losses for draft heads (docs/formats.md §1 and docs/acceptance.md).

Per step j the draft's distribution q_j = softmax(z_j) over the draft vocabulary is fitted to the target's
distribution p restricted to the draft vocabulary and renormalised (p = softmax(final · rowsᵀ)).  Chain s's
step j scores the target position s+1+j and counts (m_j(s) = 1) iff token s+2+j is a response token inside
the row: prompt and padding targets never count.  N_j = Σ_s m_j(s).

    soft               L = Σ_j w_j Σ_s m_j CE_j / N_j,   CE_j = −Σ_x p(x) log q_j(x)   (forward KL + const)
    hard               the same with p one-hot at the sampled next token
    tv                 L = Σ_j w_j Σ_s m_j (1 − α_j) / N_j,   α_j = Σ_x min(p, q_j) = 1 − TV(p, q_j)
    greedy_surrogate   the same with α̃_j, a smooth α of greedy verification (:func:`acceptance_step`)
    expected_length    L = Σ_s Σ_{i<K} c_i (1 − Π_{j≤i} α_j) / N_0,   c_i(s) = Π_{j≤i} m_j(s)
                       (K − L = E[accepted drafts] per chain: α_j of the chosen verify mode)
    w_j = decay^j (EAGLE/SpecForge: K = 7, decay 0.8); an acceptance objective adds λ·L_soft (``soft_ce_weight``)

The acceptance objectives score p renormalised over the draft vocab, as soft CE does; an engine's α uses the
target's full-vocabulary p, which puts mass m ≤ 1 on the draft vocab, so its α is Σ_x min(m·p(x), q(x)) ≤ m.
q = p (renormalised) attains that bound, so the optimum of ``tv`` is an optimum of the engine's α too.

The ``*_head`` forms and :func:`soft_targets` compute the same sums with no [rows, Vd] tensor kept for
backward (row blocks, each checkpointed); :func:`truncate_batch` is the trainer's per-sequence cap
(docs/sizing.md §5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from draft_align.conventions import VerifyMode
from draft_align.heads.vocab import draft_logits
from draft_align.train.fused_lse import masked_lse_sum
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


def hard_ce_step(q_logits: torch.Tensor, target_draft_ids: torch.Tensor, mask: torch.Tensor) -> CESums:
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


# ----------------------------------------------------------------------------- objectives on acceptance
RowTerms = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # per row: (α, soft CE, argmax agreement)


def _f32(x: torch.Tensor) -> torch.Tensor:
    """x in float32 at least (float64 stays: the finite-difference tests run in it)."""
    return x if x.dtype == torch.float64 else x.float()


def acceptance_step(
    q_logits: torch.Tensor, p: torch.Tensor, p_argmax: torch.Tensor, mode: VerifyMode, tau: float
) -> torch.Tensor:
    """Per-row acceptance α [...] of one draft token, differentiable in the draft logits z = q_logits [..., Vd];
    p [..., Vd] the target's distribution and p_argmax [...] its argmax (constants):

        probabilistic   α = Σ_x min(p(x), q(x)) = 1 − TV(p, q),   q = softmax(z)      (exact)
        greedy_draft    α̃ = Σ_x p(x) softmax(z/τ)(x)   → p(argmax q), the exact α, as τ → 0
        greedy          α̃ = softmax(z/τ)(argmax p)      → 1[argmax q = argmax p] as τ → 0

    The greedy α's are step functions of z (zero gradient almost everywhere); their surrogates are maximised by
    a q that puts its top mass on argmax p, at every τ > 0.
    """
    z = _f32(q_logits)
    if mode == "probabilistic":
        return torch.minimum(p, torch.softmax(z, dim=-1)).sum(-1)
    if mode == "greedy_draft":
        return (p * torch.softmax(z / tau, dim=-1)).sum(-1)
    if mode == "greedy":
        return torch.log_softmax(z / tau, dim=-1).gather(-1, p_argmax.unsqueeze(-1)).squeeze(-1).exp()
    raise ValueError(f"unknown verify mode {mode!r}")


def acceptance_rows(q_logits: torch.Tensor, p_logits: torch.Tensor, mode: VerifyMode, tau: float) -> RowTerms:
    """(α [...], soft CE [...], 1[argmax q = argmax p] [...]) per row of draft logits z [..., Vd] against the
    target logits over the draft vocab [..., Vd] (constants: p = softmax(p_logits)); α by
    :func:`acceptance_step`, CE = −Σ_x p(x) log q(x)."""
    z, tl = _f32(q_logits), _f32(p_logits.detach())
    p, p_arg = torch.softmax(tl, dim=-1), tl.argmax(-1)
    ce = -(p * torch.log_softmax(z, dim=-1)).sum(-1)
    agree = (z.argmax(-1) == p_arg).to(ce.dtype)
    return acceptance_step(z, p, p_arg, mode, tau), ce, agree


def step_objective(alpha: torch.Tensor, mask: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Σ_j w_j Σ_s m_j(s) (1 − α_j(s)) / max(1, N_j): alpha [K, B, M], mask [K, B, M] (bool), weights [K]."""
    m = mask.to(alpha.dtype)
    w = torch.tensor(weights, dtype=alpha.dtype, device=alpha.device)
    per_step = ((1 - alpha) * m).flatten(1).sum(1) / m.flatten(1).sum(1).clamp(min=1)  # [K]
    return (w * per_step).sum()


def chain_objective(alpha: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, E[accepted]) of the expected acceptance length over the unroll: alpha, mask [K, B, M].

    A chain's draft i is accepted iff all drafts j ≤ i are, with probability Π_{j≤i} α_j; only drafts whose
    every earlier step counts score (c_i = Π_{j≤i} m_j: a chain ends at its first prompt/padding target).
    E[accepted] = Σ_s Σ_i c_i Π_{j≤i} α_j / max(1, N_0) and L = Σ_s Σ_i c_i (1 − Π_{j≤i} α_j) / max(1, N_0).
    """
    c = torch.cumprod(mask.to(alpha.dtype), dim=0)
    prod = torch.cumprod(torch.where(mask, alpha, torch.ones_like(alpha)), dim=0)
    n0 = c[0].sum().clamp(min=1)
    return (c * (1 - prod)).sum() / n0, (c * prod).sum() / n0


# ----------------------------------------------------------------------------- memory-bounded forms
LOGITS_BLOCK_BYTES = 32 * 2**20  # fp32 logits of one row block at most (the blocked losses' default)
# the fused soft-CE path (fused_lse.py) keeps no logits across blocks, so its blocks bound only a transient:
# larger blocks mean fewer [Vd, H] gradient accumulations per step
FUSED_BLOCK_BYTES = 128 * 2**20
# ... unless the [Vd, H] gradient it keeps per TTT step (fp32) is larger than this: a SmolLM2-sized head's is
# 38 MB (7 steps: 264 MB kept), a Llama-8B-sized one's (32k × 4096) 537 MB, which takes the checkpointed blocks
FUSED_GRAD_BYTES = 128 * 2**20
MAX_SEQ_TOKENS = 8192  # the trainer's default per-sequence cap (longer rows are truncated, counted)


def row_blocks(n: int, row_bytes: int, block_bytes: int | None) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering n rows, each of at most max(1, ⌊block_bytes / row_bytes⌋) rows
    (``block_bytes`` None: :data:`LOGITS_BLOCK_BYTES`)."""
    c = max(1, (block_bytes or LOGITS_BLOCK_BYTES) // max(1, row_bytes))
    return [(lo, min(n, lo + c)) for lo in range(0, n, c)] or [(0, 0)]


def _blocked(
    fn: Callable[..., Any], args: tuple[torch.Tensor, ...], bounds: list[tuple[int, int]]
) -> list[Any]:
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
    final: torch.Tensor,
    rows: torch.Tensor,
    w: torch.Tensor,
    block_bytes: int | None = None,
    at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The soft target's two uses, without a [B, T, Vd] tensor: (e = Wᵀp [B, T, H], argmax p [B, T]).

    final [B, T, H_t] target final hidden; rows [Vd, H_t] the target's head rows over the draft vocab;
    w [Vd, H] the draft's lm_head weight.  p = softmax(final · rowsᵀ) is the target's distribution over
    the draft vocab; CE(p, q) = logsumexp(z) − Σ_x p(x) z(x) with z = W x, and the second term is x · e.
    Positions run in blocks of ⌊block_bytes / (4·Vd)⌋; p is recomputed per block in backward (the gradient
    reaches w through e = Wᵀp), so memory is O(T·H) plus one block's [rows, Vd].  ``at`` [B, T] bool: the
    positions some step scores (:func:`scored_positions`); only they are computed, the others are 0.
    """
    b, t, _ = final.shape
    vd = rows.shape[0]
    if at is not None:
        idx = at.reshape(-1).nonzero().squeeze(-1)
        ep, p_arg = soft_targets(final.reshape(1, b * t, -1)[:, idx], rows, w, block_bytes)
        full = ep.new_zeros(b * t, ep.shape[-1]).index_copy(0, idx, ep[0])
        return full.view(b, t, -1), p_arg.new_zeros(b * t).index_copy(0, idx, p_arg[0]).view(b, t)

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


@dataclass(frozen=True)
class ScoredStep:
    """Where TTT step j of every chain is scored: the target position pos = s+1+j [B, M] (clamped to the row),
    the predicted token's position nxt = s+2+j [B, M] (clamped) and whether it counts, mask [B, M]: a response
    token inside the row."""

    pos: torch.Tensor
    nxt: torch.Tensor
    mask: torch.Tensor


def scored_steps(batch: Batch, steps: int) -> list[ScoredStep]:
    """The :class:`ScoredStep` of each of ``steps`` TTT steps of ``batch``'s chains."""
    t = batch.input_ids.shape[1]
    out = []
    for j in range(steps):
        nxt = batch.starts + 2 + j
        nxt_c = nxt.clamp(max=t - 1)
        mask = batch.starts_valid & (nxt <= t - 1) & torch.gather(batch.loss_mask, 1, nxt_c)
        out.append(ScoredStep((batch.starts + 1 + j).clamp(max=t - 1), nxt_c, mask))
    return out


def scored_positions(scored: list[ScoredStep], shape: torch.Size) -> torch.Tensor:
    """[B, T] bool: the target positions some step scores, i.e. those whose next token is a response token
    that a counted chain step predicts (positions before prompt tokens and padding are not among them)."""
    at = torch.zeros(shape, dtype=torch.bool, device=scored[0].pos.device)
    row = torch.arange(shape[0], device=at.device).unsqueeze(-1).expand_as(scored[0].pos)
    for st in scored:
        at[row[st.mask], st.pos[st.mask]] = True
    return at


def soft_ce_head(
    head: nn.Linear,
    x: torch.Tensor,
    e: torch.Tensor,
    p_argmax: torch.Tensor,
    mask: torch.Tensor,
    block_bytes: int | None = None,
    fused: bool = True,
) -> CESums:
    """:func:`soft_ce_step` of z = head(x), summed over row blocks so that one block's logits live at a time.

    x [B, M, H] the lm_head's input; e [B, M, H] Wᵀp at each chain's scored position (Σ_x p(x) z(x) = x·e);
    p_argmax [B, M]; mask [B, M].  Blocks of ⌊block_bytes / (4·Vd)⌋ rows.  A plain bias-free ``nn.Linear``
    head goes through :func:`~draft_align.train.fused_lse.masked_lse_sum` (each block visited once, its
    gradient formed in the forward pass; kept O(B·M·H + Vd·H); ``block_bytes`` None: FUSED_BLOCK_BYTES)
    when its weight is frozen or its fp32 gradient fits FUSED_GRAD_BYTES; any other head (a peft LoRA layer,
    a large vocabulary) through autograd with each block checkpointed (logits recomputed in backward; kept
    O(B·M·H); None: LOGITS_BLOCK_BYTES).  ``fused`` False (``train.objective.fused_soft_ce``): the checkpointed
    blocks for every head.
    """
    w = head.weight
    if (
        fused
        and type(head) is nn.Linear
        and head.bias is None
        and (not w.requires_grad or 4 * w.numel() <= FUSED_GRAD_BYTES)
    ):
        n = x.shape[:-1].numel()
        x2 = x.reshape(n, x.shape[-1])
        m = mask.reshape(n)
        lse, agree = masked_lse_sum(
            x2, w, m, p_argmax.reshape(n), row_blocks(n, 4 * w.shape[0], block_bytes or FUSED_BLOCK_BYTES)
        )
        mf = m.to(lse.dtype)
        pdz = ((x2 * e.reshape(n, -1)).sum(-1).to(lse.dtype) * mf).sum()
        return lse - pdz, agree, mf.sum()

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
    return _sum_blocks(
        lambda xc, ic, mc: hard_ce_step(head(xc), ic, mc),
        x,
        (target_draft_ids, mask),
        head.weight.shape[0],
        block_bytes,
    )


#: fp32 [rows, Vd] tensors one acceptance-objective block holds at once (target logits, p, the draft's logits and
#: log q or q): its rows are sized so that they fit in LOGITS_BLOCK_BYTES together
ACCEPT_ROW_TENSORS = 4


def acceptance_head(
    head: Callable[[torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    x: torch.Tensor,
    final: torch.Tensor,
    mode: VerifyMode,
    tau: float,
    block_bytes: int | None = None,
) -> RowTerms:
    """:func:`acceptance_rows` of z = head(x) against p = softmax(final · rowsᵀ), per row, in row blocks.

    head the draft's lm_head (z = head(x)); x [B, M, H] its input; final [B, M, H_t] the target's final hidden state at each chain's scored
    position; rows [Vd, H_t] the target's head rows over the draft vocab.  Returns (α, CE, agreement), each
    [B, M].  Blocks of ⌊block_bytes / (4·ACCEPT_ROW_TENSORS·Vd)⌋ rows, checkpointed under autograd: the target
    and draft logits are recomputed in backward (one more target-logit matmul than soft CE per scored row),
    saved memory O(B·M·(H + H_t)).
    """

    def block(xc: torch.Tensor, fc: torch.Tensor) -> RowTerms:
        with torch.no_grad():
            p_logits = draft_logits(fc, rows)
        return acceptance_rows(head(xc), p_logits, mode, tau)

    lead = x.shape[:-1]
    n = lead.numel()
    bounds = row_blocks(n, 4 * ACCEPT_ROW_TENSORS * rows.shape[0], block_bytes)
    parts = _blocked(block, (x.reshape(n, x.shape[-1]), final.reshape(n, final.shape[-1])), bounds)
    a, ce, agree = (torch.cat(list(v)).view(lead) for v in zip(*parts, strict=True))
    return a, ce, agree


def _sum_blocks(
    fn: Callable[..., CESums],
    x: torch.Tensor,
    rest: tuple[torch.Tensor, ...],
    vd: int,
    block_bytes: int | None,
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


class Cut(NamedTuple):
    """What :func:`truncate_batch` made of a batch."""

    batch: Batch
    rows_cut: int  # rows longer than max_tokens
    targets_dropped: int  # response tokens of those rows outside the window they keep
    rows_shifted: int  # rows whose window had to start after position 0 (their prompt side cut)


def _chain_hits(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, T] bool: position s is a chain start, i.e. loss_mask[s+2+j] for some j < steps."""
    t = loss_mask.shape[1]
    hit = torch.zeros_like(loss_mask)
    for j in range(steps):
        off = 2 + j
        if off < t:
            hit[:, : t - off] |= loss_mask[:, off:]
    return hit


def truncate_batch(batch: Batch, max_tokens: int, steps: int) -> Cut:
    """The batch cut to windows of ``max_tokens`` ≥ 3 positions, with its chain starts recomputed for
    ``steps`` TTT steps (as :func:`~draft_align.train.records.collate` lists them for the cut rows).

    A row keeps its first ``max_tokens`` positions when they hold a chain start: attention is causal and a
    step's inputs precede its target, so its loss is the full row's loss over the targets at positions
    < max_tokens.  A row whose first ``max_tokens`` positions hold no target (a long prompt) keeps instead the
    window [o, o + max_tokens) with o = min(its first chain start, length − max_tokens): its prompt side is
    cut, so a cut never leaves a row of a trainable record without targets.  The batch itself when no row is
    longer.
    """
    if max_tokens < 3:
        raise ValueError(
            f"max_tokens must be ≥ 3 (a chain start, its input and its target), got {max_tokens}"
        )
    t = batch.input_ids.shape[1]
    if t <= max_tokens:
        return Cut(batch, 0, 0, 0)
    lengths = batch.valid.sum(1)  # [B]
    long_rows = lengths > max_tokens
    rows_cut = int(long_rows.sum())
    lm_full = batch.loss_mask & batch.valid
    first_ok = _chain_hits(lm_full[:, :max_tokens], steps).any(1)  # [B] the plain cut keeps a target
    full_hits = _chain_hits(lm_full, steps)
    pos = torch.arange(t, device=lm_full.device).expand_as(lm_full)
    first_start = torch.where(full_hits, pos, t).min(1).values  # [B] (t: the row has no chain start)
    shift = long_rows & ~first_ok & (first_start < t)
    offset = torch.where(shift, torch.minimum(first_start, lengths - max_tokens), 0)  # [B]
    idx = offset[:, None] + torch.arange(max_tokens, device=offset.device)  # [B, max_tokens]

    def take(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return x.gather(1, idx)
        return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))

    lm = take(batch.loss_mask)
    valid = take(batch.valid)
    dropped = int(lm_full.sum() - (lm & valid).sum())
    hit = _chain_hits(lm & valid, steps)
    window = torch.arange(max_tokens, device=lm.device).expand_as(lm)
    order = torch.where(hit, window, window + max_tokens).sort(dim=1).values  # chain starts first, ascending
    m = max(1, int(hit.sum(1).max()))
    sv = order[:, :m] < max_tokens
    starts = torch.where(sv, order[:, :m], torch.zeros_like(order[:, :m]))
    cut = Batch(take(batch.input_ids), valid, lm, take(batch.aux), take(batch.final), starts, sv)
    return Cut(cut, rows_cut, dropped, int(shift.sum()))
