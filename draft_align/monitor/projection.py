"""Projected speed-up of chain speculative decoding from measured acceptance and round costs: pure math.

Inputs (all measured somewhere else):

- ``rates``: the cumulative per-position acceptance P_1..P_K of one draft, P_i = the probability that the first
  i drafts of a round were all accepted (vLLM's ``num_accepted_tokens_per_pos[i-1] / num_drafts``, the
  ``accept_r{i-1}_*`` keys of a step row).  P_0 = 1.
- round costs c(k): seconds of one speculative engine step with k drafts per request (k draft forwards + one
  verify of k + 1 tokens per request) divided by the seconds of one plain decode step, both at the same batch
  size B.

Formulas:

    tokens per round        E(k) = 1 + Σ_{i=1..k} P_i                (the bonus token included)
    extrapolation (i > K)   P_i = P_K · ρ^(i−K),  ρ = P_K / P_{K−1}   (the last measured conditional rate held)
    round cost model        c(k) = a + b·k                           (a: the verify and fixed overhead, b: one
                                                                      draft forward + one more verified token)
    rollout speed-up        s(k) = E(k) / c(k)                       (vs plain decoding at the same batch size)
    best k                  argmax_k s(k) over k = 1..k_max
    step speed-up (Amdahl)  S(k) = (T_rest + T_plain) / (T_rest + T_plain / s(k))

where T_plain = the generation seconds of the step without speculative decoding and T_rest the rest of the step.
Holding ρ constant overstates acceptance where conditional acceptance falls with depth (as it usually does for
EAGLE drafts), so extrapolated positions are an upper bound and are labelled projected.  ``a`` and ``b`` are the
least-squares line through the measured (k, c(k)) points (exact through two); with a single point b = 0 is not
assumed: the cost of the other k is unknown (None).  s(k) assumes the batch stays at B for the whole decode.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Label = Literal["measured", "projected"]
MEASURED: Label = "measured"
PROJECTED: Label = "projected"
K_MAX = 7


class ProjectionError(ValueError):
    """Rates or costs that cannot be projected from (empty, out of range, not finite)."""


@dataclass(frozen=True)
class Labelled:
    """A number and whether it was measured or projected."""

    value: float
    label: Label

    def __str__(self) -> str:
        return f"{self.value:.3f} {self.label}"


def _check_rates(rates: Sequence[float]) -> list[float]:
    if not rates:
        raise ProjectionError("no per-position acceptance rates")
    out = [float(r) for r in rates]
    if any(not math.isfinite(r) or r < 0.0 or r > 1.0 for r in out):
        raise ProjectionError(f"acceptance rates must be finite and in [0, 1], got {out}")
    if any(b > a + 1e-9 for a, b in zip(out, out[1:], strict=False)):
        raise ProjectionError(f"cumulative acceptance rates cannot rise with position, got {out}")
    return out


def conditional_rates(rates: Sequence[float]) -> list[float]:
    """α_i = P_i / P_{i−1} (P_0 = 1; 0 where P_{i−1} = 0): the acceptance of draft i given the earlier ones."""
    p = _check_rates(rates)
    prev = [1.0, *p[:-1]]
    return [b / a if a > 0.0 else 0.0 for a, b in zip(prev, p, strict=True)]


def extend_rates(rates: Sequence[float], k_max: int = K_MAX) -> list[Labelled]:
    """P_1..P_{k_max}: the measured P_1..P_K, then P_K·ρ^(i−K) (ρ = the last conditional rate), projected."""
    p = _check_rates(rates)
    if k_max < 1:
        raise ProjectionError(f"k_max must be ≥ 1, got {k_max}")
    rho = conditional_rates(p)[-1]
    out = [Labelled(r, MEASURED) for r in p[:k_max]]
    for i in range(len(p), k_max):
        out.append(Labelled(p[-1] * rho ** (i + 1 - len(p)), PROJECTED))
    return out


def tokens_per_round(rates: Sequence[float], k: int) -> float:
    """E(k) = 1 + Σ_{i≤k} P_i, extrapolating beyond the measured positions (see :func:`extend_rates`)."""
    if k < 0:
        raise ProjectionError(f"k must be ≥ 0, got {k}")
    if k == 0:
        return 1.0
    return 1.0 + sum(x.value for x in extend_rates(rates, k)[:k])


@dataclass(frozen=True)
class CostModel:
    """c(k) = a + b·k, relative to one plain decode step at batch size ``batch_size``; ``measured`` holds the
    measured points (k → c) it was fitted to."""

    a: float
    b: float | None  # None: one measured k only, the slope is unknown
    measured: Mapping[int, float]
    batch_size: int

    @classmethod
    def fit(cls, points: Mapping[int, float], batch_size: int) -> CostModel:
        """Least squares through ``points`` (k → relative cost); ProjectionError when there are none."""
        pts = {int(k): float(c) for k, c in points.items()}
        if not pts:
            raise ProjectionError(f"no measured round cost at batch size {batch_size}")
        if any(k < 1 or not math.isfinite(c) or c <= 0.0 for k, c in pts.items()):
            raise ProjectionError(f"round costs need k ≥ 1 and a finite cost > 0, got {pts}")
        if len(pts) == 1:
            (c,) = pts.values()
            return cls(c, None, pts, batch_size)
        ks, cs = list(pts), list(pts.values())
        mk, mc = sum(ks) / len(ks), sum(cs) / len(cs)
        b = sum((k - mk) * (c - mc) for k, c in zip(ks, cs, strict=True)) / sum((k - mk) ** 2 for k in ks)
        return cls(mc - b * mk, b, pts, batch_size)

    def cost(self, k: int) -> Labelled | None:
        """c(k): the measured value at a measured k, else the line (projected); None when it is unknown."""
        if k in self.measured:
            return Labelled(self.measured[k], MEASURED)
        if self.b is None:
            return None
        return Labelled(max(self.a + self.b * k, 1e-9), PROJECTED)


@dataclass(frozen=True)
class KRow:
    """One k of a projection: tokens per round, round cost, rollout speed-up (None where the cost is unknown)."""

    k: int
    tokens_per_round: Labelled
    round_cost: Labelled | None
    speedup: Labelled | None


def project(
    rates: Sequence[float], measured_k: int, costs: CostModel | None, k_max: int = K_MAX
) -> list[KRow]:
    """Rows k = 1..k_max.  E(k) is measured only at ``measured_k`` (the k the rates were measured at: there
    E(k) is the measured mean acceptance length); everywhere else, and every speed-up, is projected."""
    rows = []
    for k in range(1, k_max + 1):
        e = Labelled(
            tokens_per_round(rates, k), MEASURED if k == measured_k and k <= len(rates) else PROJECTED
        )
        c = costs.cost(k) if costs is not None else None
        s = Labelled(e.value / c.value, PROJECTED) if c is not None else None
        rows.append(KRow(k, e, c, s))
    return rows


def best_k(rows: Sequence[KRow]) -> KRow | None:
    """The row of the highest projected speed-up (the smallest k on ties); None when no row has one."""
    have = [r for r in rows if r.speedup is not None]
    if not have:
        return None
    return max(have, key=lambda r: (r.speedup.value, -r.k))  # type: ignore[union-attr]


def amdahl(plain_generation_s: float, rest_s: float, speedup: float) -> float:
    """S = (T_rest + T_plain) / (T_rest + T_plain / s): the whole step's speed-up when only generation speeds up."""
    if plain_generation_s < 0 or rest_s < 0 or speedup <= 0:
        raise ProjectionError(
            f"amdahl needs times ≥ 0 and a speed-up > 0, got {plain_generation_s}, {rest_s}, {speedup}"
        )
    total = rest_s + plain_generation_s
    return total / (rest_s + plain_generation_s / speedup) if total > 0 else 1.0
