"""Calibration: an engine's measured acceptance vs :func:`~draft_align.monitor.estimator.estimate`'s round walk
on the engine's own outputs (docs/acceptance.md).

The engine side decodes and counts (for vLLM:
:func:`draft_align.engines.vllm.counters.measured_generate`, its counters read as an
:class:`~draft_align.acceptance.AcceptanceTally`); this side re-scores the outputs with the HF target
and the draft the engine serves, and reports both and their relative gap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from draft_align.acceptance import AcceptanceTally
from draft_align.conventions import VerifyMode
from draft_align.heads.draft_head import DraftHead
from draft_align.monitor.estimator import estimate


def calibrate(
    target: torch.nn.Module,
    draft: DraftHead,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    measured: AcceptanceTally,
    *,
    temperature: float,
    mode: VerifyMode = "greedy_draft",
    generate_seconds: float = math.nan,
) -> dict[str, Any]:
    """The engine's measured acceptance vs the estimator's on the same outputs.

    ``target`` (HF) and ``draft`` must be the models the engine serves; ``outputs[i]``: the engine's new
    tokens after ``prompts[i]``; ``measured``: the engine's counters over exactly this batch (k =
    ``measured.k``).  Returns ``measured`` (L and r_i), the estimator's round walk (``est``), its observed
    round walk (``observed``: the counters an argmax draft would report on these outputs) and the all-starts
    average, plus the relative gap (est − measured) / measured.
    """
    k = measured.k
    dev = next(target.parameters()).device
    sequences = [
        (
            torch.tensor(list(p), dtype=torch.long, device=dev),
            torch.tensor(list(o), dtype=torch.long, device=dev),
        )
        for p, o in zip(prompts, outputs, strict=True)
    ]
    est = estimate(target, draft, sequences, k, mode, float(temperature))
    l_meas = measured.mean_length()
    return {
        "temperature": float(temperature),
        "mode": mode,
        "k": k,
        "num_prompts": len(prompts),
        "num_tokens": sum(len(o) for o in outputs),
        "generate_seconds": generate_seconds,
        "measured": l_meas,
        "measured_per_position": measured.per_position(),
        "measured_rounds": int(measured.rounds),
        "est": est["acceptance_length_est"],
        "est_per_position": est["per_position_est"],
        "observed": est["acceptance_length_observed"],
        "observed_per_position": est["per_position_observed"],
        "all_starts": est["acceptance_length_all_starts"],
        "rounds_est": est["rounds_est"],
        "rel_gap": (est["acceptance_length_est"] - l_meas) / l_meas if l_meas == l_meas else math.nan,
    }
