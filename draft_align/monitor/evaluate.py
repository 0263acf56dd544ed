"""Measured vs estimated acceptance of a draft: an engine's counters beside the estimator on its outputs.

:func:`scored` is the scoring half of ``draft-align eval``; an engine does the decoding and counts the
measurement: ``engines/reference/reference_eval.py`` with the lossless reference decoder (batch 1),
``engines/vllm/vllm_eval.py`` with vLLM (batched, the engine's own counters).  Nothing here decodes.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from draft_align.acceptance import AcceptanceTally, VerifyMode
from draft_align.heads.draft_head import DraftHead
from draft_align.monitor.estimator import estimate

REQUIRED_KEYS = frozenset(
    {
        "engine",
        "acceptance_length_est",
        "acceptance_length_measured",
        "per_position_est",
        "per_position_measured",
        "k",
        "verify_mode",
        "temperature",
        "num_tokens",
    }
)  # what `draft-align eval --json` promises


def eos_ids(target: nn.Module, tokenizer: Any | None) -> set[int]:
    """The target's end-of-sequence ids: the tokenizer's and the generation config's."""
    ids: set[int] = set()
    sources = [getattr(tokenizer, "eos_token_id", None)]
    gen_cfg = getattr(target, "generation_config", None)
    sources.append(getattr(gen_cfg, "eos_token_id", None))
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif s is not None:
            ids.update(int(i) for i in s)
    return ids


def scored(
    target: nn.Module,
    draft: DraftHead,
    sequences: list[tuple[torch.Tensor, torch.Tensor]],  # (prompt [P], decoded new tokens [R]) per prompt
    measured: AcceptanceTally,
    *,
    mode: VerifyMode,
    temperature: float,
    engine: str,
    seconds_decode: float,
    started: float,
) -> dict[str, Any]:
    """The eval result: ``measured`` (the decoding engine's counters over exactly these sequences) beside the
    estimator's round walk on them (k = ``measured.k``); ``engine`` names what decoded (``reference``: the
    lossless batch-1 decoder here, ``vllm``), ``started`` is the ``time.perf_counter()`` the eval began at."""
    k = measured.k
    est = estimate(target, draft, sequences, k, mode, temperature)
    return {
        "engine": engine,
        "verify_mode": mode,
        "temperature": float(temperature),
        "k": k,
        "acceptance_length_est": est["acceptance_length_est"],
        "acceptance_length_all_starts": est["acceptance_length_all_starts"],
        "acceptance_length_measured": measured.mean_length(),
        "acceptance_length_observed": est["acceptance_length_observed"],
        "per_position_est": est["per_position_est"],
        "per_position_all_starts": est["per_position_all_starts"],
        "per_position_measured": measured.per_position(),
        "per_position_observed": est["per_position_observed"],
        "rounds_est": est["rounds_est"],
        "rounds_measured": measured.rounds,
        "num_tokens": est["num_tokens"],
        "num_prompts": len(sequences),
        "seconds": time.perf_counter() - started,
        "seconds_decode": seconds_decode,
    }


def format_table(results: list[dict[str, Any]]) -> str:
    """A text table, one row per result: mode, T, k, est (round walk), all-starts, measured, then r_i as
    measured/est for i = 1..max k."""
    kmax = max((int(r["k"]) for r in results), default=0)
    head = ["mode", "T", "k", "est", "all-starts", "measured"] + [f"r{i + 1} meas/est" for i in range(kmax)]
    rows = [head]
    for r in results:
        cells = [
            str(r["verify_mode"]),
            f"{r['temperature']:g}",
            str(r["k"]),
            f"{r['acceptance_length_est']:.3f}",
            f"{r['acceptance_length_all_starts']:.3f}",
            f"{r['acceptance_length_measured']:.3f}",
        ]
        meas, est = r["per_position_measured"], r["per_position_est"]
        for i in range(kmax):
            cells.append(f"{meas[i]:.3f}/{est[i]:.3f}" if i < len(meas) else "")
        rows.append(cells)
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    lines = [
        "  ".join(
            cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
