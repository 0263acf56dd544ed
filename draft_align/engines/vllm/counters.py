"""vLLM's spec-decode counters: one snapshot, and the difference of two (what happened in between).

The difference gives the mean acceptance length L = 1 + accepted / drafts (bonus token included) and the
per-position rates r_i = accepted_per_pos[i] / drafts, the probability that the first i+1 drafts were all
accepted (docs/acceptance.md).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from draft_align.acceptance import AcceptanceTally
from draft_align.engines.vllm.start import import_vllm

NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
ITERATION_TOKENS = "vllm:iteration_tokens_total"  # a histogram with one observation per engine step
_POSITION = re.compile(r'position="(\d+)"')


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters, or the difference of two snapshots.

    vLLM keeps them in the process-wide Prometheus registry: a snapshot sums every engine (label) it finds,
    so run one LLM per process when reading them.

    ``num_drafts``: verification rounds that carried drafts; ``num_draft_tokens`` = k · num_drafts;
    ``num_accepted_tokens`` = Σ_i accepted_per_pos[i]; ``accepted_per_pos[i]``: rounds whose first i+1
    drafts were all accepted.  ``engine_steps``: engine iterations (the count of vLLM's per-step token
    histogram), so seconds / engine_steps is the mean time of one (speculative) engine step.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    engine_steps: int = 0

    @classmethod
    def from_metrics(cls, metrics: Iterable[Any]) -> SpecCounters:
        """From ``LLM.get_metrics()`` (Counter ``.value`` / Vector ``.values`` / Histogram ``.count`` objects,
        matched by name)."""
        totals = {NUM_DRAFTS: 0, NUM_DRAFT_TOKENS: 0, NUM_ACCEPTED: 0}
        per_pos: list[int] = []
        steps = 0
        for m in metrics:
            name = getattr(m, "name", None)
            if name in totals:
                totals[name] += int(m.value)
            elif name == ITERATION_TOKENS:
                steps += int(m.count)
            elif name == ACCEPTED_PER_POS:
                values = [int(v) for v in m.values]
                width = max(len(per_pos), len(values))
                per_pos = [
                    (per_pos[i] if i < len(per_pos) else 0) + (values[i] if i < len(values) else 0)
                    for i in range(width)
                ]
        return cls(totals[NUM_DRAFTS], totals[NUM_DRAFT_TOKENS], totals[NUM_ACCEPTED], tuple(per_pos), steps)

    @classmethod
    def from_samples(cls, samples: Mapping[str, float]) -> SpecCounters:
        """From a server's ``/metrics`` page parsed by :func:`~draft_align.monitor.live.parse_metrics` (counter
        samples ``<name>_total{labels}``, summed over engines; per position by the ``position`` label)."""
        totals = {NUM_DRAFTS: 0, NUM_DRAFT_TOKENS: 0, NUM_ACCEPTED: 0}
        per_pos: dict[int, int] = {}
        steps = 0
        for key, value in samples.items():
            name, _, labels = key.partition("{")
            base = name.removesuffix("_total")
            if base in totals and name.endswith("_total"):
                totals[base] += int(value)
            elif base == ACCEPTED_PER_POS and name.endswith("_total"):
                match = _POSITION.search(labels)
                if match:
                    pos = int(match.group(1))
                    per_pos[pos] = per_pos.get(pos, 0) + int(value)
            elif name == ITERATION_TOKENS + "_count":
                steps += int(value)
        positions = tuple(per_pos.get(i, 0) for i in range(max(per_pos) + 1)) if per_pos else ()
        return cls(totals[NUM_DRAFTS], totals[NUM_DRAFT_TOKENS], totals[NUM_ACCEPTED], positions, steps)

    @classmethod
    def snapshot(cls, llm: Any) -> SpecCounters:
        """The engine's counters now (``llm``: a ``vllm.LLM`` started with statistics on)."""
        return cls.from_metrics(llm.get_metrics())

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        """Counts between ``earlier`` and this snapshot; ValueError when a counter went backwards (a restart)."""
        if not isinstance(earlier, SpecCounters):
            return NotImplemented
        if earlier.accepted_per_pos and len(earlier.accepted_per_pos) != len(self.accepted_per_pos):
            raise ValueError(
                f"snapshots disagree on k: {len(earlier.accepted_per_pos)} vs {len(self.accepted_per_pos)} positions"
            )
        before = earlier.accepted_per_pos or (0,) * len(self.accepted_per_pos)
        diff = SpecCounters(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            tuple(a - b for a, b in zip(self.accepted_per_pos, before, strict=True)),
            self.engine_steps - earlier.engine_steps,
        )
        counts = (diff.num_drafts, diff.num_draft_tokens, diff.num_accepted_tokens, diff.engine_steps)
        if min((*counts, *diff.accepted_per_pos)) < 0:
            raise ValueError(f"counters went backwards (engine restarted?): {earlier} → {self}")
        return diff

    @property
    def k(self) -> int:
        return len(self.accepted_per_pos)

    def mean_acceptance_length(self) -> float:
        """L = 1 + num_accepted_tokens / num_drafts (bonus token included); NaN without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    def per_position(self) -> list[float]:
        """r_i = accepted_per_pos[i] / num_drafts for i < k (NaN without drafts)."""
        return [a / self.num_drafts if self.num_drafts else math.nan for a in self.accepted_per_pos]

    def draft_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (NaN without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else math.nan

    def as_tally(self, k: int) -> AcceptanceTally:
        """The same counts as an :class:`~draft_align.acceptance.AcceptanceTally` of ``k`` positions
        (all zero while vLLM has reported no per-position vector yet)."""
        if self.accepted_per_pos and len(self.accepted_per_pos) != k:
            raise ValueError(f"counters of k={len(self.accepted_per_pos)} positions read as k={k}")
        return AcceptanceTally(float(self.num_drafts), [float(a) for a in self.accepted_per_pos] or [0.0] * k)

    def as_metrics(self, prefix: str = "vllm_") -> dict[str, float]:
        """Flat floats for a StepReport / monitor row: acceptance length, r_1..r_k, rounds."""
        out = {
            f"{prefix}acceptance_length": self.mean_acceptance_length(),
            f"{prefix}num_drafts": float(self.num_drafts),
            f"{prefix}draft_acceptance_rate": self.draft_acceptance_rate(),
        }
        for i, r in enumerate(self.per_position()):
            out[f"{prefix}r{i + 1}"] = r
        return out


def measured_generate(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    *,
    temperature: float,
    max_tokens: int,
    seed: int = 0,
    stop_token_ids: Sequence[int] = (),
) -> tuple[list[list[int]], SpecCounters, float]:
    """Decode token-id ``prompts`` (request i seeded ``seed + i``; it also stops at ``stop_token_ids``, which
    it keeps): (new token ids per prompt, the counters of exactly this decode, seconds it took)."""
    vllm = import_vllm()
    stops = [int(t) for t in stop_token_ids]
    params = [
        vllm.SamplingParams(
            temperature=float(temperature),
            max_tokens=int(max_tokens),
            seed=int(seed) + i,
            stop_token_ids=stops,
        )
        for i in range(len(prompts))
    ]
    requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
    before = SpecCounters.snapshot(llm)
    start = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [list(o.outputs[0].token_ids) for o in outs], SpecCounters.snapshot(llm) - before, seconds
