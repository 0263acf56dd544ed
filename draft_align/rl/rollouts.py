"""How the RL job gets its rollouts: the step's plan, the :class:`RolloutEngine` interface, and the reference
engine (this project's lossless speculative decoder).

A step decodes ``prompts_per_step`` prompts × ``group_size`` responses.  A seeded random ``frozen_fraction``
of them uses the frozen warm-start draft, the rest the adapted draft (:func:`plan_rollouts`).  Speculative
decoding is lossless, so the RL data has the policy's distribution either way, and both drafts' acceptance
is measured on real rollouts of the same step.  The engine that decoded a step is also the one source of
which adapted draft served it (:attr:`RolloutEngine.adapted`).  Implementations: :class:`ReferenceRollouts`
and :class:`draft_align.engines.vllm.vllm_rollouts.VLLMRollouts` (started from a recipe by
:func:`draft_align.rl.build.start_rollout_engine`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from draft_align.acceptance import AcceptanceTally
from draft_align.conventions import DRAFT_KINDS, DraftKind, VerifyMode
from draft_align.engines.reference.specdec import SpecDecoder
from draft_align.engines.rollout_types import (
    Decoding,
    DraftVersion,
    PlannedRollout,
    Rollout,
    RolloutPlan,
)
from draft_align.rl.drafts import DraftSource

SEED_BITS = 63  # torch.Generator seeds of the reference decoder


class RolloutEngine(Protocol):
    """What decodes a step's rollouts; the GRPO job drives any implementation the same way."""

    @property
    def adapted(self) -> DraftVersion | None:
        """The adapted version whose weights decode the adapted rollouts (None: the frozen draft stands in)."""
        ...

    def prepare(
        self, policy_model: nn.Module, policy_version: int, adapted: DraftVersion | None
    ) -> dict[str, float]:
        """Before a step's rollouts: serve policy ``policy_version`` (``policy_model``: its LoRA-injected HF
        model) and offer ``adapted``, the newest verified adapted draft; the step's metrics of doing so."""
        ...

    def rollouts(
        self, plan: RolloutPlan, prompts: Sequence[torch.Tensor], decoding: Decoding
    ) -> tuple[list[Rollout], dict[DraftKind, AcceptanceTally]]:
        """The plan's rollouts (its order, reward not set), decoded as ``decoding`` says, and each draft's
        measured acceptance."""
        ...

    def prefetch(self, plan: RolloutPlan, prompts: Sequence[torch.Tensor], decoding: Decoding) -> None:
        """After a step's rollouts: the next step's plan, which an asynchronous engine starts decoding while the
        job trains (a synchronous one ignores it)."""
        ...

    def step_metrics(self, rollouts: Sequence[Rollout], old_logprobs: torch.Tensor) -> dict[str, float]:
        """Engine metrics of a step, given its rollouts and the job's recomputed log-probs [N response tokens]."""
        ...

    def shutdown(self) -> None: ...


def plan_rollouts(
    seed: int, step: int, num_prompts: int, prompts_per_step: int, group_size: int, frozen_fraction: float
) -> RolloutPlan:
    """Step ``step``'s rollouts: ``prompts_per_step`` distinct prompts of ``num_prompts``, ``group_size``
    rollouts each (group-major), a random ``round(frozen_fraction · n)`` of them on the frozen draft.

    Everything is drawn from ``random.Random(f"grpo:{seed}:{step}")``: the same plan for the same step.
    """
    rng = random.Random(f"grpo:{seed}:{step}")
    chosen = rng.sample(range(num_prompts), prompts_per_step)
    n = prompts_per_step * group_size
    frozen = set(rng.sample(range(n), round(frozen_fraction * n)))
    prompt_of = [pi for pi in chosen for _ in range(group_size)]
    planned = tuple(
        PlannedRollout(i, pi, "frozen" if i in frozen else "adapted") for i, pi in enumerate(prompt_of)
    )
    return RolloutPlan(planned, rng.getstate())


def plan_given(seed: int, step: int, num_rollouts: int, frozen_fraction: float) -> RolloutPlan:
    """A plan for rollouts whose prompts are given (another framework chose them): rollout i decodes prompt i,
    a random ``round(frozen_fraction · n)`` of them on the frozen draft; drawn from
    ``random.Random(f"given:{seed}:{step}")``, so the same step gets the same plan."""
    if num_rollouts < 1:
        raise ValueError(f"num_rollouts must be ≥ 1, got {num_rollouts}")
    if not 0.0 <= frozen_fraction <= 1.0:
        raise ValueError(f"frozen_fraction={frozen_fraction} must be in [0, 1]")
    rng = random.Random(f"given:{seed}:{step}")
    frozen = set(rng.sample(range(num_rollouts), round(frozen_fraction * num_rollouts)))
    planned = tuple(PlannedRollout(i, i, "frozen" if i in frozen else "adapted") for i in range(num_rollouts))
    return RolloutPlan(planned, rng.getstate())


class ReferenceRollouts:
    """Rollouts by :class:`~draft_align.engines.reference.specdec.SpecDecoder` (batch 1, target = the policy, ``k``
    drafts per round, ``verify_mode``) with the drafts of ``drafts``; acceptance from its per-rollout tallies.

    The decoder reads the policy's live model, so :meth:`prepare` has nothing to sync, and it serves whatever
    ``drafts`` holds: the source's adapted version is the one that decoded.
    """

    def __init__(self, policy_model: nn.Module, drafts: DraftSource, k: int, verify_mode: VerifyMode) -> None:
        self.policy_model = policy_model
        self.drafts = drafts
        self.k = int(k)
        self.verify_mode = verify_mode

    @property
    def adapted(self) -> DraftVersion | None:
        return self.drafts.adapted_version

    def prepare(
        self, policy_model: nn.Module, policy_version: int, adapted: DraftVersion | None
    ) -> dict[str, float]:
        return {}

    def rollouts(
        self, plan: RolloutPlan, prompts: Sequence[torch.Tensor], decoding: Decoding
    ) -> tuple[list[Rollout], dict[DraftKind, AcceptanceTally]]:
        model = self.policy_model
        decoders = {
            kind: SpecDecoder(model, draft, self.k, self.verify_mode, decoding.temperature)  # type: ignore[arg-type]
            for kind, draft in (("adapted", self.drafts.adapted), ("frozen", self.drafts.frozen))
        }
        dev = next(model.parameters()).device
        model.eval()
        out: list[Rollout] = []
        tallies = {kind: AcceptanceTally.empty(self.k) for kind in DRAFT_KINDS}
        for p, seed in zip(plan.rollouts, plan.seeds(SEED_BITS), strict=True):
            prompt = prompts[p.prompt_index]
            gen = torch.Generator(device=dev).manual_seed(seed)
            new, tally = decoders[p.draft].generate(prompt, decoding.max_tokens, decoding.eos_ids, gen)
            new = new.cpu()
            finished = new.numel() > 0 and int(new[-1]) in decoding.eos_ids
            out.append(Rollout(p.prompt_index, prompt.cpu(), new, finished, p.draft, tally))
            tallies[p.draft].merge(tally)
        return out, tallies

    def prefetch(self, plan: RolloutPlan, prompts: Sequence[torch.Tensor], decoding: Decoding) -> None:
        return None  # synchronous: it decodes the policy's live model at the step

    def step_metrics(self, rollouts: Sequence[Rollout], old_logprobs: torch.Tensor) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        return None
