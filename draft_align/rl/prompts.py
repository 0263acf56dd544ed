"""The RL job's prompts: chat-templated prompt ids from conversations, and the fixed sequences KL(π ‖ π0) is
measured on."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from draft_align import data
from draft_align.hf.generate import generate_responses
from draft_align.rl.loss import GRPOError
from draft_align.rl.policy import Policy, Sequences

log = logging.getLogger(__name__)


def build_prompts(
    tokenizer: Any, conversations: Sequence[data.Conversation], n: int, max_prompt_tokens: int
) -> list[torch.Tensor]:
    """The first ``n`` conversations' prompts (chat template + generation prompt) of ≤ ``max_prompt_tokens``;
    longer prompts and conversations the template cannot render are skipped."""
    return select_prompts(tokenizer, conversations, n, max_prompt_tokens)[0]


def select_prompts(
    tokenizer: Any, conversations: Sequence[data.Conversation], n: int, max_prompt_tokens: int
) -> tuple[list[torch.Tensor], list[int]]:
    """The first ``n`` conversations' prompts (chat template + generation prompt) of ≤ ``max_prompt_tokens``,
    and the index in ``conversations`` of each one kept.

    Longer prompts and conversations the template cannot render are skipped.
    """
    if n < 1 or max_prompt_tokens < 1:
        raise GRPOError(f"n ({n}) and max_prompt_tokens ({max_prompt_tokens}) must be ≥ 1")
    out: list[torch.Tensor] = []
    kept: list[int] = []
    skipped = 0
    for index, conv in enumerate(conversations):
        if len(out) >= n:
            break
        try:
            ids = data.encode_prompt(tokenizer, conv)
        except data.DataError:
            skipped += 1
            continue
        if 1 <= ids.numel() <= max_prompt_tokens:
            out.append(ids)
            kept.append(index)
        else:
            skipped += 1
    if skipped:
        log.info("build_prompts: %d prompts kept, %d skipped (too long or unrenderable)", len(out), skipped)
    return out, kept


@torch.no_grad()
def make_kl_sequences(
    policy: Policy,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    eos_ids: set[int],
    seed: int,
    *,
    temperature: float = 0.0,
    pad_id: int | None = None,
    batch_size: int = 16,
) -> Sequences:
    """Fixed teacher-forced sequences for :meth:`Policy.kl_to_initial`: prompt ⧺ continuation of the
    initial policy (adapter disabled, whatever the current version), greedy by default (T = 1 with
    ``temperature=1.0``)."""
    if not prompts:
        raise GRPOError("make_kl_sequences: no prompts")
    pad = pad_id if pad_id is not None else (min(eos_ids) if eos_ids else 0)
    was_training = policy.hf_model.training
    policy.hf_model.eval()
    with policy.initial():
        responses = generate_responses(
            policy.hf_model,
            list(prompts),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            eos_ids=set(eos_ids),
            pad_id=pad,
            batch_size=batch_size,
            seed=seed,
        )
    policy.hf_model.train(was_training)
    pairs = [(p, r) for p, r in zip(prompts, responses, strict=True) if r is not None and r.numel() > 0]
    return Sequences.pack(pairs, pad)
