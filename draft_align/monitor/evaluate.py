"""Measured vs estimated acceptance of a draft: decode with :class:`SpecDecoder`, then re-score its output.

The decoder is lossless, so its outputs are target samples and the estimator's round walk on them predicts
the measured counters: in expectation at T > 0, exactly at T = 0.  ``acceptance_length_observed`` (argmax
drafts) reconstructs the counters from the outputs themselves and equals the measured value at any T.
Both exact statements hold up to each prompt's last round, whose drafts accepted past max_new_tokens or
eos the decoder counts (as engines do) and the output cannot show: at most k per prompt.

:func:`scored` is the scoring half alone: ``engines/vllm/vllm_eval.py`` decodes with vLLM (batched, the
engine's own counters as the measurement) and scores its outputs the same way.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from draft_align.heads.eagle3 import Eagle3Draft
from draft_align.monitor.acceptance import AcceptanceTally, VerifyMode
from draft_align.monitor.estimator import estimate
from draft_align.monitor.specdec import SpecDecoder

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


def evaluate(
    target: nn.Module,
    tokenizer: Any | None,
    draft: Eagle3Draft,
    prompts: list[torch.Tensor],  # each [P] token ids
    *,
    k: int = 3,
    mode: VerifyMode = "greedy_draft",
    temperature: float = 0.0,
    max_new_tokens: int = 128,
    seed: int = 0,
) -> dict[str, Any]:
    """Decode every prompt with the reference decoder (measured acceptance, batch 1) and estimate acceptance
    on the decoded sequences.

    ``tokenizer`` only supplies the eos id (None: the target's generation config alone).  One generator
    seeded with ``seed`` drives all prompts in order.  Returns a JSON-able dict (:func:`scored`).
    """
    start = time.perf_counter()
    dev = next(target.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    decoder = SpecDecoder(target, draft, k, mode, temperature)
    eos = eos_ids(target, tokenizer)
    measured = AcceptanceTally.empty(k)
    sequences: list[tuple[torch.Tensor, torch.Tensor]] = []
    for prompt in prompts:
        out, tally = decoder.generate(prompt, max_new_tokens, eos, gen)
        measured.merge(tally)
        sequences.append((prompt.flatten(), out))
    decode_s = time.perf_counter() - start
    return scored(
        target,
        draft,
        sequences,
        measured,
        mode=mode,
        temperature=temperature,
        engine="reference",
        seconds_decode=decode_s,
        started=start,
    )


def scored(
    target: nn.Module,
    draft: Eagle3Draft,
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
