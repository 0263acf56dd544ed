"""Round costs on vLLM: seconds of one engine step, plain and speculative, at given batch sizes.

``LLM.generate`` runs the engine's loop, one ``llm_engine.step()`` per iteration (schedule, forward, sample; with
a draft also its k draft forwards and the verification of k + 1 tokens per request).  :func:`timed_steps` times
each call together with the number of unfinished requests before it.  :func:`decode_step_seconds` decodes
``batch_size`` requests for exactly ``max_tokens`` tokens (``ignore_eos``) and takes the median over the steps
with all of them still decoding, the first ``skip`` steps of each pass (prefill) left out.
:func:`calibrate_round_cost` does that on a plain engine and on one speculative engine per k (one engine at a
time in this process), giving the :class:`~draft_align.monitor.round_cost.RoundCostTable` that
``draft-align advise`` divides by: c(k) = step_s(k) / step_s(plain) at the same batch size.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from draft_align.engines.vllm.start import (
    DraftSampleMethod,
    EngineError,
    import_vllm,
    start_engine,
    start_plain_engine,
    stop_engine,
)
from draft_align.monitor.round_cost import RoundCostTable, StepTiming

log = logging.getLogger(__name__)


@contextmanager
def timed_steps(llm: Any) -> Iterator[list[tuple[int, float]]]:
    """Inside the block every ``llm.llm_engine.step()`` appends (unfinished requests before it, its seconds)."""
    engine = llm.llm_engine
    original = engine.step
    record: list[tuple[int, float]] = []

    def step() -> Any:
        n = engine.get_num_unfinished_requests()
        t0 = time.perf_counter()
        out = original()
        record.append((n, time.perf_counter() - t0))
        return out

    engine.step = step
    try:
        yield record
    finally:
        del engine.step  # the class's method again


def decode_step_seconds(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    batch_size: int,
    k: int,
    *,
    max_tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    reps: int = 2,
    skip: int = 2,
) -> StepTiming:
    """Median seconds of one engine step with ``batch_size`` requests decoding (prompts reused cyclically)."""
    if batch_size < 1 or not prompts:
        raise ValueError(f"need batch_size ≥ 1 and prompts, got {batch_size} and {len(prompts)} prompts")
    vllm = import_vllm()
    reqs = [{"prompt_token_ids": [int(t) for t in prompts[i % len(prompts)]]} for i in range(batch_size)]

    def params(n: int, base: int) -> list[Any]:
        return [
            vllm.SamplingParams(
                temperature=float(temperature), max_tokens=n, seed=base + i, ignore_eos=True, detokenize=False
            )
            for i in range(batch_size)
        ]

    llm.generate(reqs, params(skip + 2, seed + 10_000), use_tqdm=False)  # warm-up at this batch size
    steps: list[float] = []
    for rep in range(reps):
        with timed_steps(llm) as rec:
            llm.generate(reqs, params(max_tokens, seed + rep * batch_size), use_tqdm=False)
        steps += [s for n, s in rec[skip:] if n == batch_size]
    if not steps:
        raise EngineError(
            f"no engine step had all {batch_size} requests decoding: raise max_tokens ({max_tokens})"
        )
    return StepTiming(batch_size, k, statistics.median(steps), len(steps))


def calibrate_round_cost(
    target: str,
    draft_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    ks: Sequence[int],
    batch_sizes: Sequence[int],
    temperature: float,
    draft_sample_method: DraftSampleMethod | None = None,
    max_tokens: int = 32,
    reps: int = 2,
    dtype: str = "bfloat16",
    max_model_len: int = 1024,
    seed: int = 0,
    source: str = "vLLM calibration (draft-align advise --calibrate)",
    **llm_kwargs: Any,
) -> RoundCostTable:
    """Step timings of a plain engine and of one EAGLE-3 engine per k in ``ks``, each at every batch size."""
    ks = sorted({int(k) for k in ks})
    sizes = sorted({int(b) for b in batch_sizes})
    if not ks or ks[0] < 1 or not sizes or sizes[0] < 1:
        raise ValueError(f"calibration needs ks ≥ 1 and batch sizes ≥ 1, got {ks} and {sizes}")
    vllm = import_vllm()
    timings: list[StepTiming] = []
    t_start = time.perf_counter()
    for k in (0, *ks):
        if k == 0:
            llm = start_plain_engine(
                target, max_model_len=max_model_len, seed=seed, dtype=dtype, **llm_kwargs
            )
        else:
            llm = start_engine(
                target,
                draft_dir,
                k=k,
                draft_sample_method=draft_sample_method,
                max_model_len=max_model_len,
                seed=seed,
                dtype=dtype,
                **llm_kwargs,
            )
        try:
            for b in sizes:
                t = decode_step_seconds(
                    llm, prompts, b, k, max_tokens=max_tokens, temperature=temperature, seed=seed, reps=reps
                )
                log.info(
                    "round cost: batch %d, k=%d: %.4f s per engine step (%d steps)", b, k, t.step_s, t.steps
                )
                timings.append(t)
        finally:
            stop_engine(llm)
            del llm
            gc.collect()
    details = {
        "engine": f"vllm {vllm.__version__}",
        "target": str(target),
        "draft": str(draft_dir),
        "temperature": float(temperature),
        "draft_sample_method": draft_sample_method or "vllm default",
        "max_tokens": int(max_tokens),
        "reps": int(reps),
        "dtype": dtype,
        "ks": ks,
        "batch_sizes": sizes,
        "seconds": round(time.perf_counter() - t_start, 1),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    return RoundCostTable(tuple(timings), source, details)
