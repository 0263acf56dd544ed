"""Where an RL step's wall time goes, stage by stage, as NeMo RL reports a GRPO step, plus what draft_align adds.

Stages (seconds of one step, each measured by a timer around its own code):

- ``data``: choosing the step's prompts, rewards, advantages, packing the sequences (NeMo RL's
  data_processing + reward_calculation);
- ``weight_sync``: the policy's weights into the rollout engine (NeMo RL's refit, prepare_for_generation);
- ``generation``: the engine decoding the rollouts (its generate calls alone);
- ``logprob``: the no-grad log-prob passes (old, reference, the KL probe), without the Tap inside them
  (NeMo RL's policy_and_reference_logprobs);
- ``train``: forward, backward and optimizer step (policy_training);
- ``draft_refresh``: picking up a new draft, loading it into the engine, swapping between the frozen and
  adapted drafts, the verify-mode measurement and the silent-zero guard;
- ``tap``: capturing and shipping the draft's training data;
- ``checkpoint``: saving the policy;
- ``other``: the step's wall time minus all of the above (what no timer covers).

``step_s`` = Σ stages + other.  A :class:`StepProfile` is the numbers only; the RL job and the TRL adapter put
:meth:`StepProfile.to_metrics` into the step's metrics, from where the monitor row, the report and ``advise``
read them back (:meth:`StepProfile.from_metrics`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STAGES: tuple[str, ...] = (
    "data",
    "weight_sync",
    "generation",
    "logprob",
    "train",
    "draft_refresh",
    "tap",
    "checkpoint",
)
OTHER = "other"
LABELS: dict[str, str] = {
    "data": "data (prompts, rewards, advantages)",
    "weight_sync": "weight sync (policy → engine)",
    "generation": "generation",
    "logprob": "log-prob (old, reference, KL probe)",
    "train": "train (forward, backward, optimizer)",
    "draft_refresh": "draft refresh (pick-up, load, swaps, guard)",
    "tap": "Tap",
    "checkpoint": "checkpoint",
    OTHER: "other (untimed)",
}
PREFIX = "stage_"


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


@dataclass(frozen=True)
class StepProfile:
    """One step's (or a mean step's) seconds per stage (module docstring); stages not timed are 0."""

    step_s: float
    seconds: Mapping[str, float]

    def __post_init__(self) -> None:
        unknown = set(self.seconds) - set(STAGES)
        if unknown:
            raise ValueError(f"unknown stages {sorted(unknown)}; expected some of {STAGES}")

    def stage_s(self, stage: str) -> float:
        """Seconds of ``stage`` (``other``: the untimed rest, never below 0)."""
        if stage == OTHER:
            return self.other_s
        return float(self.seconds.get(stage, 0.0))

    @property
    def timed_s(self) -> float:
        return sum(self.stage_s(s) for s in STAGES)

    @property
    def other_s(self) -> float:
        return max(self.step_s - self.timed_s, 0.0)

    def share(self, stage: str) -> float | None:
        """Seconds of ``stage`` / step seconds (None for a step of 0 s)."""
        return self.stage_s(stage) / self.step_s if self.step_s > 0 else None

    def to_metrics(self) -> dict[str, float | None]:
        """``stage_<name>_s`` and ``stage_<name>_share`` for every stage and ``other``, and ``stage_step_s``."""
        out: dict[str, float | None] = {f"{PREFIX}step_s": self.step_s}
        for stage in (*STAGES, OTHER):
            out[f"{PREFIX}{stage}_s"] = self.stage_s(stage)
            out[f"{PREFIX}{stage}_share"] = self.share(stage)
        return out

    @classmethod
    def from_metrics(cls, record: Mapping[str, Any]) -> StepProfile | None:
        """A step's profile from its metrics: the ``stage_*`` keys when present, else derived from the raw
        timers older runs logged (their data stage is untimed, so it falls into ``other``); None without
        ``step_s``."""
        step = _num(record.get(f"{PREFIX}step_s"))
        if step is not None:
            secs = {s: v for s in STAGES if (v := _num(record.get(f"{PREFIX}{s}_s"))) is not None}
            return cls(step, secs)
        step = _num(record.get("step_s"))
        if step is None:
            return None

        def get(key: str) -> float:
            return _num(record.get(key)) or 0.0

        gens = [v for k in ("adapted", "frozen") if (v := _num(record.get(f"generate_s_{k}"))) is not None]
        swap = get("draft_swap_s")
        tap = get("tap_s")
        return cls(
            step,
            {
                "weight_sync": get("policy_sync_s"),
                "generation": sum(gens) if gens else max(get("rollout_s") - swap, 0.0),
                "logprob": max(get("logprob_s") - tap, 0.0) + get("kl_s"),
                "train": get("update_s"),
                "draft_refresh": get("draft_poll_s") + get("draft_offer_s") + swap,
                "tap": tap,
                "checkpoint": get("save_s"),
            },
        )

    @classmethod
    def mean(cls, profiles: Sequence[StepProfile]) -> StepProfile:
        """The mean step of ``profiles`` (stage by stage); ValueError when there are none."""
        if not profiles:
            raise ValueError("no step profiles to average")
        n = len(profiles)
        return cls(
            sum(p.step_s for p in profiles) / n,
            {s: sum(p.stage_s(s) for p in profiles) / n for s in STAGES},
        )
