"""The GRPO objective: group-normalised advantages, the clipped surrogate and the k3 KL estimator.

Per response token, with ρ = exp(log π(y) − log π_old(y)) at temperature T and A the rollout's advantage:

    ℓ = −min(ρ·A, clip(ρ, 1 − ε, 1 + ε)·A)  [+ β·k3,  k3 = exp(log π0 − log π) − (log π0 − log π) − 1]

averaged over every response token of the step; A = (r − mean_group(r)) / (std_group(r) + 1e-4) (std with
Bessel's correction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ADV_EPS = 1e-4


class GRPOError(ValueError):
    """A GRPO job, or one of its inputs (rewards, prompts), that cannot be used as given."""


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [G, N] (G groups of N rollouts, N ≥ 2) → A [G, N] = (r − mean_g) / (std_g + 1e-4)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise GRPOError(f"rewards must be [groups, group_size ≥ 2], got {tuple(rewards.shape)}")
    r = rewards.double()
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + ADV_EPS)).to(rewards.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[token]: logits [N, V], tokens [N] → [N] float32 (T ≤ 0 is read as 1)."""
    t = temperature if temperature > 0 else 1.0
    return F.log_softmax(logits.float() / t, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def clipped_surrogate(
    logp: torch.Tensor,  # [N] current log-probs (with grad)
    old_logp: torch.Tensor,  # [N] log-probs of the rollout policy
    advantages: torch.Tensor,  # [N] per-token advantage
    clip_eps: float,
) -> torch.Tensor:
    """Per-token GRPO/PPO loss [N]: −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) with ρ = exp(logp − old_logp)."""
    ratio = torch.exp(logp - old_logp)
    return -torch.minimum(ratio * advantages, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π ‖ π_ref) on samples of π: exp(d) − d − 1 with d = ref_logp − logp (≥ 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0
