"""Which draft sampling pays at T > 0, measured on the running engine (``rl.engine.verify_mode: auto``).

vLLM verifies at T > 0 in one of two lossless ways (docs/acceptance.md): ``greedy_draft`` (its default: the
draft proposes argmax q, accepted with probability p(x)) and ``probabilistic`` (x ~ q, accepted with
min(1, p/q), α = Σ min(p, q)).  Which one accepts more depends on the draft: a sharp, well-aligned draft gains
from sampling, a flat one can lose.  :func:`choose_verify_mode` decodes the same probe prompts with the same
seeds in each mode (switched in place by :func:`~draft_align.engines.vllm.worker_rpc.rpc_set_draft_sample_method`,
no restart) and keeps the one whose mean acceptance length L, read from vLLM's counters, is higher; it leaves
the mode it starts from only when the other is higher by more than ``margin_se`` standard errors of the
difference, so that probe noise does not flip it back and forth.  ``MARGIN_SE`` = 1 was chosen by measurement
(benchmarks/verify_choice.py): with 2 SE on 4 probe prompts × 32 tokens the chooser kept ``greedy_draft`` for
a draft whose held-out acceptance was 0.070 ± 0.014 higher with ``probabilistic``; both modes are lossless, so a
choice within noise costs nothing but speed.

Standard error: with A the drafts accepted in a round, P(A > i) = r_i (the per-position rates), so
E[A] = Σ_i r_i and E[A²] = Σ_i (2i + 1) r_i; SE(L) = sqrt((E[A²] − E[A]²) / rounds).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from draft_align.acceptance import AcceptanceTally

log = logging.getLogger(__name__)

#: The modes vLLM can verify with at T > 0, vLLM's default first (the one a tie keeps).
CANDIDATES: tuple[str, ...] = ("greedy_draft", "probabilistic")
MARGIN_SE = 1.0  # leave the current mode only past this many standard errors of the difference (docstring)


def length_se(tally: AcceptanceTally) -> float:
    """Standard error of the mean acceptance length of ``tally`` (NaN without rounds)."""
    if tally.rounds <= 0:
        return math.nan
    r = [a / tally.rounds for a in tally.accepted_per_pos]
    mean = sum(r)
    second = sum((2 * i + 1) * ri for i, ri in enumerate(r))
    return math.sqrt(max(second - mean * mean, 0.0) / tally.rounds)


@dataclass(frozen=True)
class VerifyChoice:
    """The outcome of one measurement: the chosen mode and what each candidate measured on the probe."""

    mode: str
    length: dict[str, float]  # mean acceptance length per candidate (vLLM's counters)
    se: dict[str, float]  # its standard error
    rounds: dict[str, float]
    draft: str  # the draft version folder it was measured with
    temperature: float

    def metrics(self) -> dict[str, float]:
        """Step metrics: each candidate's measured L (``verify_measured_L_<mode>``)."""
        return {f"verify_measured_L_{m}": v for m, v in self.length.items()}

    def describe(self) -> str:
        parts = ", ".join(
            f"{m} L={self.length[m]:.3f}±{self.se[m]:.3f} ({self.rounds[m]:.0f} rounds)" for m in self.length
        )
        return f"verify mode {self.mode} at T={self.temperature:g} (measured: {parts})"


def choose_verify_mode(
    measure: Callable[[str], AcceptanceTally],
    *,
    current: str,
    draft: str,
    temperature: float,
    candidates: Sequence[str] = CANDIDATES,
    margin_se: float = MARGIN_SE,
) -> VerifyChoice:
    """Measure every candidate with ``measure(mode)`` (the engine's counters over the probe in that mode) and
    choose: the best one, if it beats ``current`` by more than ``margin_se`` standard errors of the
    difference, else ``current``.  A mode whose probe yields no round cannot be chosen."""
    if current not in candidates:
        raise ValueError(f"current verify mode {current!r} is not a candidate {tuple(candidates)}")
    tallies = {m: measure(m) for m in candidates}
    length = {m: 1.0 + t.num_accepted / t.rounds if t.rounds > 0 else math.nan for m, t in tallies.items()}
    se = {m: length_se(t) for m, t in tallies.items()}
    best = max((m for m in candidates if not math.isnan(length[m])), key=lambda m: length[m], default=current)
    chosen = current
    if best != current:
        if math.isnan(length[current]):
            chosen = best
        else:
            diff_se = math.sqrt(se[best] ** 2 + se[current] ** 2)
            if length[best] - length[current] > margin_se * diff_se:
                chosen = best
    choice = VerifyChoice(
        chosen, length, se, {m: t.rounds for m, t in tallies.items()}, draft, float(temperature)
    )
    log.info("engine: %s", choice.describe())
    return choice
