"""The TTT objective of one batch: its settings (:class:`LossSettings`, from a recipe's ``train`` or ``sidecar``
section) and :func:`ttt_loss`, the draft unrolled ``ttt_steps`` steps and scored step by step (the objectives'
formulas: train/losses.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from draft_align.conventions import LossKind, VerifyMode, check_loss, objective_mode
from draft_align.heads.draft_head import DraftHead
from draft_align.train.losses import (
    StepStats,
    acceptance_head,
    chain_objective,
    hard_ce_head,
    scored_positions,
    scored_steps,
    soft_ce_head,
    soft_targets,
    step_objective,
    step_weights,
)
from draft_align.train.records import Batch


class LossSection(Protocol):
    """A recipe section that sets the objective (``config.ObjectiveConfig``: a warm-start's ``train.objective``, the
    sidecar's ``sidecar.train.objective``)."""

    ttt_steps: int
    loss: str
    accept_mode: str | None
    soft_ce_weight: float
    surrogate_tau: float
    autocast_bf16: bool | None
    fused_soft_ce: bool


@dataclass(frozen=True)
class LossSettings:
    """The TTT objective (train/losses.py): ``kind`` (conventions.LossKind); for the acceptance objectives the
    verify mode they score (``accept_mode``, None: the loss's default), the soft-CE mix weight λ and the greedy
    surrogates' τ; ``fused_soft_ce``: soft CE through the fused log-sum-exp where the head allows it
    (losses.soft_ce_head), else checkpointed logit blocks (the same values and gradients)."""

    ttt_steps: int = 7
    step_decay: float = 0.8
    kind: LossKind = "soft"
    train_lm_head: bool = True
    autocast_bf16: bool | None = None  # None: bf16 where the device computes it natively (precision.py)
    accept_mode: VerifyMode | None = None
    soft_ce_weight: float = 0.0
    surrogate_tau: float = 0.5
    fused_soft_ce: bool = True

    def __post_init__(self) -> None:
        check_loss(self.kind, self.accept_mode, self.soft_ce_weight, self.surrogate_tau)

    @classmethod
    def from_section(cls, section: LossSection, step_decay: float, train_lm_head: bool) -> LossSettings:
        """The settings an objective section asks for (a warm-start's ``train.objective`` or the sidecar's
        ``sidecar.train.objective``: one path for both); ``step_decay`` resolved for the head
        (``config.step_decay``)."""
        mode = section.accept_mode
        return cls(
            ttt_steps=int(section.ttt_steps),
            step_decay=float(step_decay),
            kind=str(section.loss),  # type: ignore[arg-type]
            train_lm_head=bool(train_lm_head),
            autocast_bf16=section.autocast_bf16,
            accept_mode=None if mode is None else str(mode),  # type: ignore[arg-type]
            soft_ce_weight=float(section.soft_ce_weight),
            surrogate_tau=float(section.surrogate_tau),
            fused_soft_ce=bool(section.fused_soft_ce),
        )

    @property
    def verify_mode(self) -> VerifyMode | None:
        """The verify mode an acceptance objective scores; None for soft and hard CE."""
        return objective_mode(self.kind, self.accept_mode)  # type: ignore[return-value]


def ttt_loss(
    draft: DraftHead,
    embed: nn.Module,
    rows: torch.Tensor,
    batch: Batch,
    loss: LossSettings,
) -> tuple[torch.Tensor, StepStats]:
    """Weighted TTT loss of one batch (objectives in train/losses.py).  rows [draft_vocab, H]: the target's
    lm_head rows.

    Step j of chain s is scored at target position p = s+1+j (the target's distribution of token
    s+2+j) and counts iff token s+2+j is a response token inside the row.  StepStats.loss sums soft CE
    (hard CE for ``hard``) whatever the objective.
    """
    k = loss.ttt_steps
    xs = draft.unroll_hidden(
        batch.aux, embed, batch.input_ids, batch.valid, batch.starts, batch.starts_valid, k
    )
    vd = rows.shape[0]
    mode = loss.verify_mode  # None: soft or hard CE
    scored = scored_steps(batch, k)
    if loss.kind == "soft":
        # CE(p, q) = logsumexp(z) − Σ_x p(x) z(x) with z = W x: the second term is x · (Wᵀp), so Wᵀp is
        # formed once per scored position ([B, T, H]; prompt and padding targets skipped) instead of gathering
        # p [B, M, Vd] at every step.
        at = scored_positions(scored, batch.input_ids.shape)
        ep, p_arg = soft_targets(batch.final, rows, draft.lm_head.weight, at=at)  # gradient reaches lm_head
    elif loss.kind == "hard":
        dev = batch.input_ids.device
        to_draft = torch.full((draft.cfg.vocab_size,), -1, dtype=torch.long, device=dev)
        to_draft[draft.draft_to_target] = torch.arange(vd, device=dev)
        tgt_ids = to_draft[batch.input_ids]  # [B, T] draft id of each token (−1 outside)
    weights = step_weights(k, loss.step_decay)
    ce_total = xs[0].new_zeros((), dtype=torch.promote_types(xs[0].dtype, torch.float32))  # float64 stays
    sums = torch.zeros(3, k, device=batch.input_ids.device)
    alphas, masks = [], []
    for j, st in enumerate(scored):
        pos, mask = st.pos, st.mask
        # the [B, M, Vd] logits z = lm_head(xs[j]) exist one row block at a time (losses.*_head)
        if mode is not None:
            # α needs p itself: the target's logits at this step's scored positions only, per row block
            f = torch.gather(batch.final, 1, pos.unsqueeze(-1).expand(*pos.shape, batch.final.shape[-1]))
            alpha, ce_rows, agree_rows = acceptance_head(
                draft.lm_head, rows, xs[j], f, mode, loss.surrogate_tau
            )
            m = mask.to(ce_rows.dtype)
            ce, agree, n = (ce_rows * m).sum(), (agree_rows * m).sum(), m.sum()
            alphas.append(alpha)
            masks.append(mask)
        elif loss.kind == "soft":
            e = torch.gather(ep, 1, pos.unsqueeze(-1).expand(*pos.shape, ep.shape[-1]))  # [B, M, H]
            ce, agree, n = soft_ce_head(
                draft.lm_head, xs[j], e, torch.gather(p_arg, 1, pos), mask, fused=loss.fused_soft_ce
            )
        else:
            ce, agree, n = hard_ce_head(draft.lm_head, xs[j], torch.gather(tgt_ids, 1, st.nxt), mask)
        ce_total = ce_total + weights[j] * ce / n.clamp(min=1)
        sums[0, j], sums[1, j], sums[2, j] = ce.detach(), agree, n
    stats = StepStats(loss=sums[0], correct=sums[1], count=sums[2])
    if mode is None:
        return ce_total, stats
    a, m = torch.stack(alphas), torch.stack(masks)  # [K, B, M]
    objective = chain_objective(a, m)[0] if loss.kind == "expected_length" else step_objective(a, m, weights)
    total = objective + loss.soft_ce_weight * ce_total if loss.soft_ce_weight else objective
    return total, stats
