"""The log-prob gap: a rollout engine's log-probs of its sampled tokens minus the RL job's recomputed ones.

Both are log π_T(y) of the same tokens at the same temperature; a gap far from 0 means the engine samples
from another policy than the one the job trains (a missed weight sync, a dtype or kernel difference).
"""

from __future__ import annotations

import math

import torch


def logprob_gap(engine: torch.Tensor, recomputed: torch.Tensor) -> dict[str, float]:
    """Engine − recomputed log-probs of the same sampled tokens: mean, mean |·|, max |·| (NaN when empty)."""
    if engine.shape != recomputed.shape:
        raise ValueError(f"log-prob gap: shapes differ {tuple(engine.shape)} vs {tuple(recomputed.shape)}")
    if engine.numel() == 0:
        return {
            "engine_logprob_gap_mean": math.nan,
            "engine_logprob_gap_abs_mean": math.nan,
            "engine_logprob_gap_abs_max": math.nan,
        }
    d = engine.double() - recomputed.double()
    return {
        "engine_logprob_gap_mean": float(d.mean()),
        "engine_logprob_gap_abs_mean": float(d.abs().mean()),
        "engine_logprob_gap_abs_max": float(d.abs().max()),
    }
