"""The per-token policy statistics a Tap ships beside the hidden states (the wire's ``next_logprob``,
``logit_lse``, ``topk_ids``, ``topk_logprobs``): from the logits, or from the final states × the lm_head when
the job's pass never materialises logits, in chunks, or from the job's own next-token log-probs and one head row
per position; where a sequence's statistics start (``stats_from``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from draft_align.tap.protocol import PolicyTapError


def stat_buffers(
    length: int, topk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The outputs of :func:`logit_stats` to fill: next_logprob [L] (zeros: the last position stays 0),
    logit_lse [L], topk_ids [L, K] and topk_logprobs [L, K] (None when topk = 0)."""
    nxt = torch.zeros(length, dtype=torch.float32, device=device)
    lse = torch.empty(length, dtype=torch.float32, device=device)
    k_ids = torch.empty(length, topk, dtype=torch.int64, device=device) if topk else None
    k_lp = torch.empty(length, topk, dtype=torch.float32, device=device) if topk else None
    return nxt, lse, k_ids, k_lp


def logit_stats(
    logits: torch.Tensor, input_ids: torch.Tensor, topk: int, max_elements: int = 1 << 26
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-token policy statistics of one sequence, at temperature 1, in float32.

    logits [L, V], input_ids [L] →
      next_logprob [L]: log_softmax(logits[t])[x_{t+1}], 0 at t = L−1
      logit_lse [L]:    logsumexp(logits[t])
      topk_ids [L, K], topk_logprobs [L, K] (None when topk = 0): the K most likely next tokens
    Works in chunks of ≤ ``max_elements`` logits so a long sequence never materialises [L, V] in float32.
    """
    length, vocab = logits.shape
    return _chunked_stats(
        lambda s, e: logits[s:e], length, vocab, input_ids, topk, logits.device, max_elements
    )


def head_logit_stats(
    final: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input_ids: torch.Tensor,
    topk: int,
    max_elements: int = 1 << 26,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`logit_stats` of one sequence whose logits were never materialised (a fused LM head computes
    only log-probs): final post-norm states [L, H] × the lm_head ``weight`` [V, H] (+ ``bias`` [V]), in the
    weight's dtype as the model's own head would, chunk by chunk (≤ ``max_elements`` logits at a time).
    A sharded weight (a DTensor under FSDP2) is gathered first, a collective; under ZeRO-3 the caller
    gathers it.  A caller looping over sequences must gather the head once itself (:func:`full_tensor`, on
    every rank, however many sequences that rank has) and pass the plain tensors: one gather per sequence
    issues different numbers of collectives on ranks with different numbers of sequences, and the job hangs."""
    weight = full_tensor(weight)
    bias = full_tensor(bias) if bias is not None else None
    if final.dim() != 2 or weight.dim() != 2 or int(final.shape[1]) != int(weight.shape[1]):
        raise PolicyTapError(
            f"final states {tuple(final.shape)} and lm_head weight {tuple(weight.shape)} do not multiply "
            "([L, H] × [V, H]ᵀ); under ZeRO-3 gather the head first"
        )
    h = final.to(device=weight.device, dtype=weight.dtype)

    def chunk(s: int, e: int) -> torch.Tensor:
        return torch.nn.functional.linear(h[s:e], weight, bias)

    return _chunked_stats(
        chunk, int(h.shape[0]), int(weight.shape[0]), input_ids, topk, weight.device, max_elements
    )


def logprob_stats(
    final: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input_ids: torch.Tensor,
    next_logprob: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, None, None]:
    """:func:`logit_stats` of one sequence (top-k omitted) from the job's own next-token log-probs, with no
    [L, V] product: where the job's pass already computed log p(x_{t+1}) at temperature 1 (TRL's fused head),
    the log-normaliser follows from one row of the head per position,

        logit_lse[t] = z_t(x_{t+1}) − next_logprob[t],   z_t(x) = final[t] · weight[x] (+ bias[x]),  t < L−1

    and only the last position, which has no next token, goes through the whole head.  final [L, H] post-norm
    states, weight [V, H] (whole: gather a sharded head first, :func:`full_tensor`), input_ids [L],
    next_logprob [L] (its last entry is ignored).  The dot products run in float32."""
    length = int(final.shape[0])
    if final.dim() != 2 or weight.dim() != 2 or int(final.shape[1]) != int(weight.shape[1]):
        raise PolicyTapError(
            f"final states {tuple(final.shape)} and lm_head weight {tuple(weight.shape)} do not "
            "multiply ([L, H] × [V, H]ᵀ)"
        )
    if tuple(next_logprob.shape) != (length,):
        raise PolicyTapError(f"next_logprob must be [{length}], got {tuple(next_logprob.shape)}")
    nxt, lse, _, _ = stat_buffers(length, 0, weight.device)
    h = final.to(device=weight.device)
    if length > 1:
        tgt = input_ids[1:].to(device=weight.device, dtype=torch.int64)
        z_tok = (h[:-1].float() * weight[tgt].float()).sum(-1)
        if bias is not None:
            z_tok = z_tok + bias[tgt].float()
        nxt[:-1] = next_logprob[:-1].to(device=weight.device, dtype=torch.float32)
        lse[:-1] = z_tok - nxt[:-1]
    last = torch.nn.functional.linear(h[-1:].to(weight.dtype), weight, bias).float()
    lse[-1] = torch.logsumexp(last[0], dim=-1)
    return nxt, lse, None, None


def stats_start(response: torch.Tensor) -> int:
    """Where a sequence's statistics start: the position predicting its first response token (loss_mask
    [L] bool, some True), first − 1, or 0.  Only the response is ever scored against them
    (:mod:`draft_align.monitor.tapped_estimate`); the position before it costs one row and keeps the wire's rule
    (``stats_from`` ≤ the first response position) with room to spare."""
    return max(int(response.to(torch.int8).argmax()) - 1, 0)


def pad_stats(
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], before: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The :func:`logit_stats` of a sequence's positions ``before``.. with ``before`` zero rows put in front
    (ids 0): the statistics of the whole sequence as the wire's ``stats_from`` defines them."""
    if before == 0:
        return stats

    def pad(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        return torch.cat([x.new_zeros((before, *x.shape[1:])), x])

    nxt, lse, k_ids, k_lp = stats
    return pad(nxt), pad(lse), pad(k_ids), pad(k_lp)  # type: ignore[return-value]


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x`` whole: a DTensor (FSDP2 / tensor-parallel shards) gathered, any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _chunked_stats(
    chunk_logits: Callable[[int, int], torch.Tensor],
    length: int,
    vocab: int,
    input_ids: torch.Tensor,
    topk: int,
    device: torch.device,
    max_elements: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The statistics of :func:`logit_stats` from ``chunk_logits(s, e)`` → the logits [e − s, V] of
    positions s..e−1, at most ``max_elements`` logits per chunk."""
    nxt, lse, k_ids, k_lp = stat_buffers(length, topk, device)
    ids = input_ids.to(device=device, dtype=torch.int64)
    rows = max(1, max_elements // max(vocab, 1))
    for s in range(0, length, rows):
        e = min(length, s + rows)
        lg = chunk_logits(s, e).float()  # [c, V]
        z = torch.logsumexp(lg, dim=-1)  # [c]
        lse[s:e] = z
        last = min(e, length - 1)  # positions s..last−1 have a next token
        if last > s:
            tgt = ids[s + 1 : last + 1, None]  # [c', 1]
            nxt[s:last] = lg[: last - s].gather(1, tgt).squeeze(1) - z[: last - s]
        if topk:
            vals, idx = lg.topk(topk, dim=-1)
            k_lp[s:e] = vals - z[:, None]
            k_ids[s:e] = idx
    return nxt, lse, k_ids, k_lp
