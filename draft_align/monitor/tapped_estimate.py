"""Acceptance of a draft estimated on tapped records: no target forward, only the tapped states.

A :class:`~draft_align.train.records.TappedRecord` carries the policy's aux states (the draft's input) and
its final post-norm hidden state; with the HeadSync rows W_d [Vd, H] (lm_head rows of the draft vocabulary)
the policy's logits over the draft vocabulary are z_t = final[t] · W_dᵀ (``draft_logits``).  The rest is
:mod:`draft_align.monitor.estimator`'s layout: chain starts s = P−1 .. T−2 (P = the record's prompt_len),
step j of start s predicts x[s+2+j] from ``draft.unroll`` and is scored against the policy at position
s+1+j; valid iff s+2+j ≤ T−1.  Chains run to the end of the record, also across later non-response
stretches (e.g. a user turn), as the estimator does.

The policy distribution p over the draft vocabulary (docs/acceptance.md for the modes):

- with ``logit_lse`` (logsumexp of the FULL-vocab logits): log p(x) = z_x − lse, the exact full-vocab
  probability of each draft-vocab token; the mass outside the draft vocabulary can never be accepted.
- without it: softmax(z) renormalised over the draft vocabulary, which overstates every p(x) by
  1 / p(Vd) and so overestimates ``greedy_draft`` and ``probabilistic`` acceptance.
- at T ≠ 1 the full-vocab normaliser of z / T is unknown (lse is at T = 1), so p_T = softmax(z / T) over
  the draft vocabulary (renormalised, an overestimate) with or without ``logit_lse``.
- argmax p (``greedy``, T = 0): ``topk_ids[t, 0]`` (full vocabulary) when present, else the draft-vocab
  argmax mapped through d2t (an overestimate when the policy's argmax lies outside the draft vocabulary).

``logit_lse`` and ``topk_ids`` are read at positions ≥ P only; a record whose statistics start later
(``stats_from`` > P, which the wire refuses) is refused (RecordEstimateError), never read as zeros.

With a full draft vocabulary (Vd = V, rows = lm_head) and tensors from one target forward this equals
:func:`draft_align.monitor.estimator.alpha_table`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from draft_align.acceptance import (
    EstimatePool,
    VerifyMode,
    check_mode,
    verifies_by_argmax,
)
from draft_align.heads.draft_head import DraftHead
from draft_align.heads.vocab import draft_logits
from draft_align.train.records import TappedRecord


class RecordEstimateError(ValueError):
    """The draft, the head rows and a record do not fit together, or paired results do not pair."""


@contextmanager
def _eval_mode(draft: nn.Module) -> Iterator[None]:
    was = draft.training
    draft.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        draft.train(was)


def _check(draft: DraftHead, rows: torch.Tensor, rec: TappedRecord, k: int) -> None:
    cfg = draft.cfg
    if k < 1:
        raise RecordEstimateError(f"k must be ≥ 1, got {k}")
    if rows.dim() != 2 or rows.shape[0] != cfg.draft_vocab_size:
        raise RecordEstimateError(
            f"rows {tuple(rows.shape)} must be [draft_vocab_size={cfg.draft_vocab_size}, H]"
        )
    r = rec.record
    if r.aux.shape[1] != cfg.fc_in_features:
        raise RecordEstimateError(
            f"record aux width {r.aux.shape[1]} ≠ the draft's fc input {cfg.fc_in_features}"
        )
    if r.final.shape[1] != rows.shape[1]:
        raise RecordEstimateError(f"record final width {r.final.shape[1]} ≠ rows width {rows.shape[1]}")


def _policy_logprobs(
    final: torch.Tensor,  # [N, H] policy final post-norm hidden
    rows: torch.Tensor,  # [Vd, H]
    lse: torch.Tensor | None,  # [N] full-vocab logsumexp at T = 1
    temperature: float,
) -> torch.Tensor:
    """log p_T over the draft vocabulary [N, Vd] float32 (full-vocab normaliser where known, see module doc)."""
    z = draft_logits(final.float(), rows.float())  # fp32: bf16 logits would round probabilities
    if temperature == 1.0 and lse is not None:
        # z is recomputed from bf16 states; a hair above lse would make p > 1
        return (z - lse.float().unsqueeze(-1)).clamp(max=0.0)
    return torch.log_softmax(z / temperature, dim=-1)


def _unroll_tables(
    draft: DraftHead,
    embed: nn.Module,
    rows: torch.Tensor,
    rec: TappedRecord,
    k: int,
    mode: VerifyMode,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha [S, k], observed [S, k], valid [S, k]) of one record; observed = 1[d2t(argmax q) == x[s+2+j]]."""
    check_mode(mode)
    _check(draft, rows, rec, k)
    r = rec.record
    p_len = max(rec.prompt_len, 1)  # a response token at 0 follows no position: nothing drafts it
    p = next(draft.parameters())
    dev, ddtype = p.device, p.dtype
    ids = r.input_ids.to(dev).long()
    t = ids.numel()
    starts = torch.arange(p_len - 1, t - 1, device=dev)  # [S]
    q = draft.unroll(
        r.aux.to(dev, ddtype)[None],
        lambda x: embed(x).to(ddtype),
        ids[None],
        torch.ones(1, t, dtype=torch.bool, device=dev),
        starts[None],
        torch.ones(1, starts.numel(), dtype=torch.bool, device=dev),
        k,
    )
    d2t = draft.draft_to_target.to(dev)
    # the policy side is needed at positions s+1+j ∈ [P, T−1] only; row i holds position P + i
    final = r.final[p_len:].to(dev)
    argmax_mode = verifies_by_argmax(mode, temperature)
    reads = rec.topk_ids is not None if argmax_mode else rec.logit_lse is not None
    if reads and rec.stats_from > p_len:
        raise RecordEstimateError(
            f"record (arrival {rec.arrival}): statistics start at {rec.stats_from}, after position {p_len} "
            "where the estimate reads them"
        )
    if argmax_mode:
        if rec.topk_ids is not None:
            p_arg = rec.topk_ids[p_len:, 0].to(dev).long()
        else:
            p_arg = d2t[draft_logits(final.float(), rows.to(dev).float()).argmax(-1)]
    else:
        lse = rec.logit_lse[p_len:].to(dev) if rec.logit_lse is not None else None
        logp = _policy_logprobs(final, rows.to(dev), lse, temperature)  # [T−P, Vd]
    alpha_cols, obs_cols = [], []
    for j, qj in enumerate(q):
        qj = qj[0].float()  # [S, Vd]
        pos = (starts + 1 + j).clamp(max=t - 1) - p_len
        top = qj.argmax(-1)
        obs_cols.append((d2t[top] == ids[(starts + 2 + j).clamp(max=t - 1)]).float())
        if argmax_mode:
            alpha_cols.append((d2t[top] == p_arg[pos]).float())
            continue
        lp = logp[pos]  # [S, Vd]
        if mode == "greedy_draft":
            alpha_cols.append(lp.gather(-1, top.unsqueeze(-1)).squeeze(-1).exp())
        else:
            alpha_cols.append(torch.minimum(lp.exp(), torch.softmax(qj / temperature, dim=-1)).sum(-1))
    valid = starts.view(-1, 1) + 2 + torch.arange(k, device=dev).view(1, -1) <= t - 1
    return torch.stack(alpha_cols, 1).cpu(), torch.stack(obs_cols, 1).cpu(), valid.cpu()


def record_alpha(
    draft: DraftHead,
    embed: nn.Module,
    rows: torch.Tensor,  # [Vd, H] HeadSync rows of the record's policy version
    rec: TappedRecord,
    k: int,
    mode: VerifyMode,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-start acceptance of one record: (alpha [S, k] float32, valid [S, k] bool), S = T − max(P, 1).

    ``embed``: the target's frozen embedding module; ``temperature``: the rollouts' (TapBatch.temperature).
    Formulas and the policy distribution used are in the module docstring.  The draft runs in eval mode
    under no_grad; its mode is restored afterwards.
    """
    with _eval_mode(draft):
        alpha, _, valid = _unroll_tables(draft, embed, rows, rec, k, mode, temperature)
    return alpha, valid


def estimate_records(
    draft: DraftHead,
    embed: nn.Module,
    rows: torch.Tensor,  # [Vd, H]
    records: list[TappedRecord],
    k: int,
    mode: VerifyMode,
    temperature: float,
) -> dict[str, Any]:
    """Estimated acceptance of ``draft`` on tapped records, pooled like :func:`estimator.estimate`.

    ``acceptance_length_est``: round walk pooled as Σ accepted / Σ rounds; ``..._all_starts``: Π α
    averaged over every chain start; ``..._observed``: round walk of 1[d2t(argmax q) == next token] (None for
    ``probabilistic`` at T > 0).  ``per_sequence``: (round-walk mean length, rounds) of each record in order
    (NaN, 0.0 for a record with no chain start) and ``sequence_ids`` their arrivals, for the sidecar's
    :func:`~draft_align.sidecar.gate.paired_gate`.  ``num_tokens`` counts response tokens.  Records without a response token are
    refused (RecordEstimateError): the buffer never holds them.
    """
    check_mode(mode)
    pool = EstimatePool(k)
    num_tokens = 0
    per_sequence: list[tuple[float, float]] = []
    with _eval_mode(draft):
        for rec in records:
            if not rec.has_response:
                raise RecordEstimateError(f"record (arrival {rec.arrival}) has no response token")
            alpha, obs, valid = _unroll_tables(draft, embed, rows, rec, k, mode, temperature)
            num_tokens += int(rec.record.loss_mask.sum())
            one = pool.add(alpha, obs, valid)
            per_sequence.append((one.mean_length(), one.rounds))
    return {
        **pool.result(mode, temperature),
        "per_sequence": per_sequence,
        "sequence_ids": [rec.arrival for rec in records],
        "num_tokens": num_tokens,
        "num_sequences": len(records),
    }
