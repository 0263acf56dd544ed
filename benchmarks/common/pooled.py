"""Shared by the drift benchmarks: measured acceptance pooled over RL steps."""

from __future__ import annotations

from typing import Any


def pooled_acceptance(steps: list[dict[str, Any]], kind: str, first: int = 0) -> float | None:
    """Mean acceptance length (tokens per round) of the ``kind`` draft over the rounds of steps ``first``…,
    rounds-weighted (not a mean of per-step means): Σ L_s·n_s / Σ n_s with the per-step ``accept_measured_<kind>``
    L_s and ``accept_rounds_<kind>`` n_s; None when no step measured any round."""
    num = den = 0.0
    for r in steps[first:]:
        m, n = r.get(f"accept_measured_{kind}"), r.get(f"accept_rounds_{kind}")
        if m is not None and n:
            num += m * n
            den += n
    return num / den if den else None
