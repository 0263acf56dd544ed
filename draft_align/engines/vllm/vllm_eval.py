"""``draft-align eval`` on vLLM: decode the prompts in one batched ``generate`` with the draft as vLLM's EAGLE-3
drafter, take the engine's spec-decode counters as the measured acceptance, and score the outputs with the HF
target like the reference evaluation does (:func:`draft_align.monitor.evaluate.scored`).

Verify modes: at T = 0 every mode is greedy verification, and vLLM's is exact.  At T > 0 vLLM verifies by
rejection sampling with its ``greedy`` draft sampling (our ``greedy_draft``) or ``probabilistic``; it has no
argmax-everywhere verification, so ``greedy`` at T > 0 needs the reference decoder.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draft_align.conventions import VerifyMode
from draft_align.engines.vllm.counters import measured_generate
from draft_align.engines.vllm.start import start_engine
from draft_align.monitor.evaluate import scored


def draft_sample_method(mode: VerifyMode, temperature: float) -> str:
    """vLLM's draft sampling for ``mode`` at ``temperature``; ValueError where vLLM has no equivalent."""
    if mode == "probabilistic":
        return "probabilistic"
    if mode == "greedy" and temperature > 0:
        raise ValueError(
            f"verify mode greedy at T={temperature:g}: vLLM has no argmax-everywhere verification at T > 0 "
            f"(use --verify-mode greedy_draft, or --engine reference)"
        )
    return "greedy"


def model_len(prompts: list[torch.Tensor], max_new_tokens: int, k: int) -> int:
    """The engine's ``max_model_len``: the longest prompt, the new tokens, and one round of drafts beyond."""
    return max(int(p.numel()) for p in prompts) + int(max_new_tokens) + int(k) + 1


def evaluate_vllm(
    target_name: str,
    draft_dir: Path,
    target: nn.Module,
    draft: nn.Module,
    prompts: list[torch.Tensor],  # each [P] token ids
    eos: set[int],
    *,
    k: int,
    mode: VerifyMode,
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
    dtype: str = "bfloat16",
    **llm_kwargs: Any,
) -> dict[str, Any]:
    """Measured acceptance of the published draft ``draft_dir`` under vLLM on ``target_name``, estimated
    acceptance of ``draft`` (the same draft, loaded) with the HF ``target`` on vLLM's outputs.

    Request i is seeded ``seed + i``; decoding stops at ``max_new_tokens`` or a token of ``eos``.  The engine
    is started for this call and shut down after it (vLLM keeps its counters process-wide: one engine at a
    time); ``llm_kwargs`` go to ``vllm.LLM``.  EngineError when vLLM cannot start; ValueError for a mode vLLM
    has no equivalent of.
    """
    method = draft_sample_method(mode, temperature)
    started = time.perf_counter()
    llm = start_engine(
        target_name,
        draft_dir,
        k=k,
        draft_sample_method=method,  # type: ignore[arg-type]
        max_model_len=model_len(prompts, max_new_tokens, k),
        seed=seed,
        dtype=dtype,
        enforce_eager=True,
        **llm_kwargs,
    )
    start_s = time.perf_counter() - started
    try:
        outs, counters, seconds = measured_generate(
            llm,
            [p.tolist() for p in prompts],
            temperature=temperature,
            max_tokens=max_new_tokens,
            seed=seed,
            stop_token_ids=sorted(eos),
        )
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
    dev = next(target.parameters()).device
    sequences = [
        (p.flatten().to(dev), torch.tensor(o, dtype=torch.long, device=dev))
        for p, o in zip(prompts, outs, strict=True)
    ]
    res = scored(
        target,
        draft,
        sequences,
        counters.as_tally(k),
        mode=mode,
        temperature=temperature,
        engine="vllm",
        seconds_decode=seconds,
        started=started,
    )
    res["seconds_engine_start"] = start_s
    return res
