"""``draft-align eval`` on the reference decoder: decode each prompt with :class:`SpecDecoder` (batch 1, its
rounds counted as the measurement), then score its outputs with the estimator
(:func:`draft_align.monitor.evaluate.scored`), as :mod:`draft_align.engines.vllm.vllm_eval` does vLLM's.

The decoder is lossless, so its outputs are target samples and the estimator's round walk on them predicts
the measured counters: in expectation at T > 0, exactly at T = 0.  ``acceptance_length_observed`` (argmax
drafts) reconstructs the counters from the outputs themselves and equals the measured value at any T.
Both exact statements hold up to each prompt's last round, whose drafts accepted past max_new_tokens or
eos the decoder counts (as engines do) and the output cannot show: at most k per prompt.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from draft_align.acceptance import AcceptanceTally
from draft_align.conventions import VerifyMode
from draft_align.engines.reference.specdec import SpecDecoder
from draft_align.heads.draft_head import DraftHead
from draft_align.monitor.evaluate import eos_ids, scored


def evaluate(
    target: nn.Module,
    tokenizer: Any | None,
    draft: DraftHead,
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
