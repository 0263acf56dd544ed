"""Measured engine-step times, plain and speculative, per batch size: the round costs a projection divides by.

One :class:`StepTiming` is the median wall time of one engine step (one iteration of the engine's loop: schedule,
forward, sample, and with a draft its k draft forwards) while exactly ``batch_size`` requests were decoding;
``k`` = 0 is plain decoding, k ≥ 1 speculative decoding with k drafts per round.  The relative round cost at a
batch size is c(k) = step_s(k) / step_s(0) (:meth:`RoundCostTable.relative`).  A table is written to
``<run>/round_cost.json`` by ``draft-align advise RUN --calibrate`` (built by
``draft_align.engines.vllm.round_timing``), with ``source`` saying what measured it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROUND_COST_FILE = "round_cost.json"


class RoundCostError(ValueError):
    """A round-cost file that is missing fields or holds impossible values."""


@dataclass(frozen=True)
class StepTiming:
    """Median seconds of one engine step with ``batch_size`` requests decoding, ``k`` drafts each (0: plain)."""

    batch_size: int
    k: int
    step_s: float
    steps: int  # engine steps the median is over

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.k < 0 or self.steps < 1:
            raise RoundCostError(f"step timing needs batch_size ≥ 1, k ≥ 0, steps ≥ 1: {self}")
        if not math.isfinite(self.step_s) or self.step_s <= 0:
            raise RoundCostError(f"step timing needs a finite step_s > 0: {self}")


@dataclass(frozen=True)
class RoundCostTable:
    """Step timings of one calibration; ``source`` names what measured them, ``details`` how (engine, target,
    draft, temperature, tokens, date)."""

    timings: tuple[StepTiming, ...]
    source: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def batch_sizes(self) -> list[int]:
        """Batch sizes with a plain timing and at least one speculative one, ascending."""
        out = []
        for b in sorted({t.batch_size for t in self.timings}):
            ks = {t.k for t in self.timings if t.batch_size == b}
            if 0 in ks and len(ks) > 1:
                out.append(b)
        return out

    def step_s(self, batch_size: int, k: int) -> float | None:
        for t in self.timings:
            if t.batch_size == batch_size and t.k == k:
                return t.step_s
        return None

    def relative(self, batch_size: int) -> dict[int, float]:
        """k → c(k) = step_s(k) / step_s(0) at ``batch_size`` (empty without a plain timing there)."""
        plain = self.step_s(batch_size, 0)
        if plain is None:
            return {}
        return {t.k: t.step_s / plain for t in self.timings if t.batch_size == batch_size and t.k > 0}

    def nearest_batch(self, batch_size: int) -> int | None:
        """The calibrated batch size closest to ``batch_size`` (in ratio; the smaller one on ties)."""
        have = self.batch_sizes()
        if not have:
            return None
        return min(have, key=lambda b: (abs(math.log(b / batch_size)), b))

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "details": dict(self.details),
            "timings": [vars(t) for t in self.timings],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RoundCostTable:
        try:
            timings = tuple(
                StepTiming(int(t["batch_size"]), int(t["k"]), float(t["step_s"]), int(t["steps"]))
                for t in d["timings"]
            )
            return cls(timings, str(d["source"]), dict(d.get("details") or {}))
        except (KeyError, TypeError) as e:
            raise RoundCostError(f"round-cost table is missing {e}") from e

    def save(self, path: str | os.PathLike[str]) -> Path:
        p = Path(path)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, p)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoundCostTable:
        """FileNotFoundError when absent; RoundCostError (one line) when malformed."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise RoundCostError(f"{p} is not JSON: {e}") from e
        if not isinstance(data, dict):
            raise RoundCostError(f"{p}: expected a JSON object")
        return cls.from_dict(data)
