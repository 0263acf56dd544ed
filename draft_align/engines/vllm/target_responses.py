"""The target's own responses on vLLM's batched engine: the vLLM counterpart of
:func:`draft_align.hf.generate.generate_responses` for self-distillation.

:func:`generate_responses_vllm` keeps at most ``batch_size`` requests in flight and adds the next prompt as
soon as one finishes (continuous batching: nothing waits for the longest answer of a batch); finished
responses go to ``on_batch`` ``batch_size`` at a time, so a caller appends them to its resumable cache as
they come.  Request i is seeded ``seeds[i]`` (:func:`request_seed`: its answer does not depend on what else
is in flight, on chunking, or on a resume).  A response stops at ``max_new_tokens`` or after its first eos
token, which it keeps: exactly what the HF loop stores (``cut_at_eos``).

:func:`self_distill_env` is the vLLM-CPU environment of such a short-lived engine, undone when it stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from draft_align.engines.vllm.start import SEED_BITS, EngineError, import_vllm, set_cpu_env
from draft_align.hf.generate import cut_at_eos

log = logging.getLogger(__name__)

GIB = 1 << 30


def request_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt ``index`` in a run seeded ``seed`` (drawn from
    ``random.Random(f"selfdistill:{seed}:{index}")``)."""
    return random.Random(f"selfdistill:{seed}:{index}").getrandbits(SEED_BITS)


def kv_cache_gb(config: Any, tokens: int, dtype: torch.dtype) -> float:
    """GiB of KV cache that ``tokens`` tokens of the HF ``config``'s model take in ``dtype``:
    tokens · layers · 2 (K, V) · kv_heads · head_dim · bytes."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    per_token = int(config.num_hidden_layers) * 2 * kv_heads * head_dim * (torch.finfo(dtype).bits // 8)
    return tokens * per_token / GIB


@contextlib.contextmanager
def self_distill_env(kv_gb: float | None = None) -> Iterator[dict[str, str]]:
    """:func:`~draft_align.engines.vllm.start.set_cpu_env` for one engine's lifetime, undone after it.

    The defaults it sets (only those not set already) are removed again afterwards, and vLLM's cache of its
    environment is dropped, so a launcher's later choice (``rl.engine.kv_cache_gb``) holds for the next
    engine of this process.  The in-process CPU worker replaces ``torch.set_num_threads`` with a no-op for
    the whole process; the real one is put back too.  vLLM reseeds the global RNGs (Python, NumPy, torch) with
    its seed and draws from them: their states are restored, so what the caller draws next (a draft's init)
    does not depend on whether an engine ran.
    """
    set_threads = torch.set_num_threads
    py_state = random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    done = set_cpu_env(kv_gb)
    try:
        with torch.random.fork_rng(devices=cuda):
            yield done
    finally:
        torch.set_num_threads = set_threads
        random.setstate(py_state)
        if np_state is not None:
            numpy.random.set_state(np_state)  # type: ignore[union-attr]
        for name in done:
            os.environ.pop(name, None)
        drop_cache = getattr(
            sys.modules.get("vllm.envs"), "disable_envs_cache", None
        )  # cached once an engine started
        if drop_cache is not None:
            drop_cache()


def external_id(request_id: str) -> str:
    """The id a request's outputs carry, from the one ``LLM.enqueue`` returns: vLLM 0.32 appends ``-`` and 8
    random characters to the caller's id (its counter's digits) unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION."""
    return request_id.rsplit("-", 1)[0]


def generate_responses_vllm(
    llm: Any,
    prompts: Sequence[torch.Tensor],  # each [P_i] int64 token ids
    *,
    seeds: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    eos_ids: set[int],
    batch_size: int,
    on_batch: Callable[[list[int], list[torch.Tensor]], None] | None = None,
    deadline: float | None = None,
) -> list[torch.Tensor | None]:
    """One response per prompt from the running ``vllm.LLM`` ``llm`` (see the module docstring).

    Prompts are started shortest first (as the HF loop batches them); none is started at or after
    ``deadline`` (a ``time.time()`` value), while those in flight finish and are kept: the prompts never
    started get None.  ``on_batch(indices, responses)`` [R_j] int64 is called with every ``batch_size``
    finished responses and with the rest at the end.  Returns responses in the prompts' order.
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be ≥ 1, got {batch_size} and {max_new_tokens}")
    vllm = import_vllm()
    stops = sorted(int(i) for i in eos_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    in_flight: dict[str, int] = {}  # request id → prompt index
    ready: list[int] = []  # finished, not yet handed to on_batch
    started = 0

    def hand_over(n: int) -> None:
        take, ready[:] = ready[:n], ready[n:]
        if on_batch is not None and take:
            on_batch(take, [out[i] for i in take])  # type: ignore[misc]

    while True:
        while started < len(order) and len(in_flight) < batch_size:
            if deadline is not None and time.time() >= deadline:
                log.info("generation deadline reached: %d of %d prompts started", started, len(order))
                order = order[:started]
                break
            i = order[started]
            params = vllm.SamplingParams(
                temperature=float(temperature),
                max_tokens=int(max_new_tokens),
                seed=int(seeds[i]),
                stop_token_ids=stops,
                detokenize=False,
            )
            (rid,) = llm.enqueue(
                [{"prompt_token_ids": [int(t) for t in prompts[i].tolist()]}], params, use_tqdm=False
            )
            in_flight[external_id(str(rid))] = i
            started += 1
        if not in_flight:
            break
        for o in llm.llm_engine.step():
            if not o.finished:
                continue
            i = in_flight.pop(str(o.request_id), None)
            if i is None:
                raise EngineError(f"vLLM finished request {o.request_id!r}, which this call did not start")
            out[i] = cut_at_eos(torch.tensor(list(o.outputs[0].token_ids), dtype=torch.long), eos_ids)
            ready.append(i)
        while len(ready) >= batch_size:
            hand_over(batch_size)
    hand_over(len(ready))
    return out
