"""Training-time-test (TTT) losses for EAGLE-3 heads (docs/formats.md §1 and docs/acceptance.md).

Per step j the draft's distribution q_j over the draft vocabulary is fitted to the target's
distribution p restricted to the draft vocabulary and renormalised:

    L_j = mean_{valid chains} − Σ_x p(x) log q_j(x)          (soft CE = forward KL + const)
    L   = Σ_j w_j L_j,   w_j = decay^j                         (EAGLE/SpecForge: K = 7, decay 0.8)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
