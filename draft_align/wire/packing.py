"""Batch construction (docs/wire.md, "TapBatch"): :func:`pack_sequences` packs per-sequence tensors into a
ragged TapBatch, :func:`drop_nonfinite` removes the sequences whose hidden states are not finite."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draft_align.wire.codec import validate
from draft_align.wire.messages import BatchHeader, TapBatch
from draft_align.wire.schema import _TENSOR_SPECS, HEADER_MAX_BYTES, MAC_BYTES


def tapped_token_bytes(hidden: int, n_aux: int, *, final: bool, topk: int) -> int:
    """The bytes one tapped token takes in a TapBatch (docs/sizing.md §1): its aux (and final) hidden states in
    bf16, its id (int64), loss mask (1 B), next log-prob and logit lse (f32 each), and ``topk`` ids (int64)
    with their log-probs (f32); the per-sequence tensors come on top (:func:`tokens_that_fit`)."""
    return 2 * hidden * (n_aux + int(final)) + 8 + 1 + 4 + 4 + 12 * topk


def tokens_that_fit(max_bytes: int, token_bytes: int) -> int:
    """The most tokens a TapBatch of ``token_bytes`` per token can hold within ``max_bytes`` (the receiver's
    ``wire.max_message_mb``): the largest header and the MAC taken off, and every sequence as short as a
    sequence may be (2 tokens: its cu_seqlens entry and stats_from, ≤ 6 B per token)."""
    return max(2, (max_bytes - HEADER_MAX_BYTES - MAC_BYTES - 8) // (token_bytes + 6))


def pack_sequences(
    seqs: Sequence[dict[str, torch.Tensor]],
    header: BatchHeader,
    *,
    stats_from: Sequence[int] | None = None,
) -> TapBatch:
    """Pack per-sequence tensors (``input_ids`` [T], ``loss_mask`` [T], ``aux_hidden`` [T, n_aux·H] and
    optionally ``final_hidden`` [T, H], ``next_logprob`` [T], ``logit_lse`` [T], ``topk_ids`` [T, K],
    ``topk_logprobs`` [T, K]) into one CPU TapBatch of ``header`` with wire dtypes; ``stats_from``: per sequence, the first
    position whose statistics are defined (they are 0 before; None: every position).  The result is
    validated as :func:`encode` would (raises :class:`WireError`).  The packed tensors are new memory."""
    if not seqs:
        raise ValueError("pack_sequences needs at least one sequence")
    spec = _TENSOR_SPECS["TapBatch"]
    names = [n for n in spec if n in seqs[0]]
    for i, s in enumerate(seqs):
        unknown = set(s) - (spec.keys() - {"cu_seqlens", "stats_from"})
        if unknown:
            raise ValueError(f"sequence {i}: unknown tensors {sorted(unknown)}")
        if [n for n in spec if n in s] != names:
            raise ValueError(f"sequence {i} has tensors {sorted(s)}, sequence 0 has {sorted(names)}")
    lengths = torch.tensor([s["input_ids"].shape[0] for s in seqs], dtype=torch.int64)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    packed = {n: torch.cat([s[n].detach().to("cpu", spec[n][0]) for s in seqs]) for n in names}
    if stats_from is not None:
        if len(stats_from) != len(seqs):
            raise ValueError(f"stats_from has {len(stats_from)} entries for {len(seqs)} sequences")
        packed["stats_from"] = torch.tensor([int(x) for x in stats_from], dtype=torch.int32)
    batch = TapBatch(**header.fields(), cu_seqlens=cu, **packed)
    validate(batch)
    return batch


def _all_finite(t: torch.Tensor) -> bool:
    """True only when every element of ``t`` is finite: NaN and ±Inf carry into a sum (Inf − Inf is NaN), so a
    finite sum proves it, ~30× faster than an element-wise test on bf16; a sum that overflows from finite values
    only sends the caller to that exact test."""
    return bool(torch.isfinite(t.sum()))


def drop_nonfinite(batch: TapBatch) -> tuple[TapBatch | None, int]:
    """Remove the sequences whose ``aux_hidden`` or ``final_hidden`` hold NaN/Inf.  Returns (the batch, or
    the same object when nothing is dropped, or None when nothing is left; the number of sequences dropped)."""
    states = [t for t in (batch.aux_hidden, batch.final_hidden) if t is not None]
    if all(_all_finite(t) for t in states):
        return batch, 0
    bad_tok = ~states[0].isfinite().all(dim=-1)  # [N]
    for t in states[1:]:
        bad_tok |= ~t.isfinite().all(dim=-1)
    if not bool(bad_tok.any()):
        return batch, 0
    cu = batch.cu_seqlens
    lengths = cu[1:] - cu[:-1]  # [S]
    seq_of_tok = torch.repeat_interleave(torch.arange(batch.num_sequences), lengths)  # [N]
    bad_seq = torch.zeros(batch.num_sequences, dtype=torch.bool)  # [S]
    bad_seq[seq_of_tok[bad_tok]] = True
    dropped = int(bad_seq.sum())
    if dropped == batch.num_sequences:
        return None, dropped
    keep_tok = ~bad_seq[seq_of_tok]  # [N]
    new_cu = torch.zeros(batch.num_sequences - dropped + 1, dtype=torch.int64)
    new_cu[1:] = lengths[~bad_seq].cumsum(0)
    kept = {n: t[keep_tok] for n, t in batch.tensors().items() if n not in ("cu_seqlens", "stats_from")}
    if batch.stats_from is not None:
        kept["stats_from"] = batch.stats_from[~bad_seq]
    return TapBatch(**BatchHeader.of(batch).fields(), cu_seqlens=new_cu, **kept), dropped
