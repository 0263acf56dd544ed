"""Batched response generation by the target itself (self-distillation data, eval sequences)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)


def cut_at_eos(tokens: torch.Tensor, eos_ids: set[int]) -> torch.Tensor:
    """tokens [n] → tokens up to and including the first eos (all of them if none)."""
    for i, t in enumerate(tokens.tolist()):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def generate_responses(
    model: nn.Module,
    prompts: list[torch.Tensor],
    *,
    max_new_tokens: int,
    temperature: float,
    eos_ids: set[int],
    pad_id: int,
    batch_size: int,
    seed: int,
    on_batch: Callable[[list[int], list[torch.Tensor]], None] | None = None,
    deadline: float | None = None,
) -> list[torch.Tensor | None]:
    """Generate one response per prompt (prompts [P_i] int64) with the target's KV cache.

    Prompts are batched by length (left padding) and processed shortest first; ``temperature`` 0 is
    greedy.  Each response is cut after its first eos.  ``on_batch(indices, responses)`` is called
    after each batch so a caller can persist progress.  Batches that would start after ``deadline``
    (a ``time.time()`` value) are skipped and their responses are None.  Returns responses in the prompts'
    order.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, len(order), batch_size):
        if deadline is not None and time.time() >= deadline:
            log.info("generation deadline reached: %d of %d prompts answered", start, len(order))
            break
        idx = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        attn = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            p = prompts[i]
            ids[r, width - len(p) :] = p
            attn[r, width - len(p) :] = 1
        res = sample_batch(model, ids, attn, max_new_tokens, temperature, eos_ids, pad_id, gen)
        new = [cut_at_eos(res[r], eos_ids) for r in range(len(idx))]
        for r, i in enumerate(idx):
            out[i] = new[r]
        if on_batch is not None:
            on_batch(idx, new)
    return out


@torch.no_grad()
def sample_batch(
    model: nn.Module,
    ids: torch.Tensor,
    attn: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    eos_ids: set[int],
    pad_id: int,
    gen: torch.Generator,
) -> torch.Tensor:
    """Plain KV-cached sampling loop.  ids, attn [B, W] left-padded → new tokens [B, max_new] (pad after eos).

    Written out rather than ``model.generate`` because on CPU the generic path costs ~10× per step
    here; logits are computed for the last position only, and finished rows are dropped from the batch
    so short answers do not pay for the longest one.
    """
    b = ids.shape[0]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
    result = torch.full((b, max_new_tokens), pad_id, dtype=torch.long)
    live = torch.arange(b)  # rows still generating; finished rows leave the batch (and the KV cache)
    last_pos = pos[:, -1:]
    logits = out.logits[:, -1].float()
    for step in range(max_new_tokens):
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen).squeeze(-1)
        else:
            nxt = logits.argmax(-1)
        result[live, step] = nxt
        finished = torch.isin(nxt, eos)
        if step + 1 == max_new_tokens or bool(finished.all()):
            break
        if bool(finished.any()):
            keep = torch.nonzero(~finished).flatten()
            cache.batch_select_indices(keep)
            live, nxt, attn, last_pos = live[keep], nxt[keep], attn[keep], last_pos[keep]
        attn = torch.cat((attn, torch.ones(attn.shape[0], 1, dtype=attn.dtype)), dim=1)
        last_pos = last_pos + 1
        out = model(
            input_ids=nxt.unsqueeze(-1),
            attention_mask=attn,
            position_ids=last_pos,
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1].float()
    return result
