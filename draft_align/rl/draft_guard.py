"""Silent-zero guard on the RL job's own rollouts: a newly served adapted draft is judged by the acceptance the
engine counted on the first step it served, against a reference counted on the same step.

A draft can pass every file and shape check and still accept nothing (a wiped lm_head, a wrong vocab map
written by a bug upstream); speculative decoding stays lossless, so only the speed shows it.  With L the mean
acceptance length (bonus token included) and A the draft tokens accepted in one verification round, a new
draft has collapsed when both hold:

    L_new − 1 < min_ratio · (L_ref − 1)                       (it keeps less than min_ratio of the reference's gain)
    L_ref − L_new > z · sqrt(se_new² + se_ref²)          (beyond the noise of the step's rounds)

with se the standard error of a measured mean length from its own tally
(:func:`~draft_align.acceptance.length_stderr`).  The reference is the frozen draft's tally of the same
step (same policy, same prompts' distribution); when that step had too few frozen rounds, the tally of the
previous good adapted draft on the step before.  No verdict while either side has fewer than ``min_rounds``
rounds or the reference gains nothing (L_ref ≤ 1: a collapse cannot be told from it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from draft_align.acceptance import AcceptanceTally, length_stderr

if TYPE_CHECKING:
    from draft_align.config import RLGuardConfig

Verdict = Literal["pass", "collapse", "undecided"]


@dataclass(frozen=True)
class CounterGuard:
    """The collapse test of the module docstring."""

    min_ratio: float = 0.5
    z: float = 2.0
    min_rounds: int = 8

    def __post_init__(self) -> None:
        if not 0.0 < self.min_ratio <= 1.0:
            raise ValueError(f"CounterGuard.min_ratio must be in (0, 1], got {self.min_ratio}")
        if self.z < 0 or self.min_rounds < 2:
            raise ValueError("CounterGuard.z must be ≥ 0 and min_rounds ≥ 2")

    def verdict(self, new: AcceptanceTally, ref: AcceptanceTally | None) -> Verdict:
        """``pass``, ``collapse`` or ``undecided`` for the new draft's tally against the reference's."""
        if ref is None or new.rounds < self.min_rounds or ref.rounds < self.min_rounds:
            return "undecided"
        l_new, l_ref = new.mean_length(), ref.mean_length()
        if not (math.isfinite(l_ref) and l_ref > 1.0):
            return "undecided"
        se = math.hypot(
            length_stderr(new.rounds, new.per_position()), length_stderr(ref.rounds, ref.per_position())
        )
        if l_new - 1.0 < self.min_ratio * (l_ref - 1.0) and l_ref - l_new > self.z * se:
            return "collapse"
        return "pass"


def counter_guard(guard: RLGuardConfig) -> CounterGuard | None:
    """The guard ``rl.guard`` asks the job to apply: a CounterGuard at ``rl.guard.min_ratio`` for ``kind:
    counters``, else None (``probe``: the engine checks each load itself; ``none``)."""
    return CounterGuard(min_ratio=guard.min_ratio) if guard.kind == "counters" else None
