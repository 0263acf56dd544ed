"""The record types every part shares: a captured sequence (:class:`Record`), the same sequence as tapped
from the policy (:class:`TappedRecord`), and their collation into padded TTT batches (:class:`Batch`).

Warm-start captures Records from its own target forwards; the sidecar receives TappedRecords (docs/wire.md);
the replay buffer, the trainer, the hidden-state store and the record estimates (``monitor/tapped_estimate.py``) all
read them from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


class RecordError(ValueError):
    """A malformed record: shapes, dtypes or versions that do not fit together."""


@dataclass
class Record:
    """One captured sequence (a slice of a packed shard; no copy)."""

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool: token t is a response token the draft must learn to predict
    aux: torch.Tensor  # [T, n_aux·H] bf16 target aux states
    final: torch.Tensor  # [T, H] bf16 target final post-norm hidden

    def __len__(self) -> int:
        return self.input_ids.numel()

    def num_targets(self) -> int:
        """Positions whose next token is a response token (what the draft is trained on)."""
        return int(self.loss_mask[1:].sum())


@dataclass
class TappedRecord:
    """One tapped sequence plus what the policy side sent with it (tensors as received, no copy).

    ``arrival``: monotonic index of arrival; −1 lets :meth:`~draft_align.train.replay.ReplayBuffer.add` assign the next one.
    """

    record: Record
    policy_version: int
    step: int
    arrival: int = -1
    next_logprob: torch.Tensor | None = None  # [T] float32: log p(x[t+1] | x[≤t]) at T = 1
    logit_lse: torch.Tensor | None = None  # [T] float32: logsumexp of the policy's full-vocab logits at t
    topk_ids: torch.Tensor | None = None  # [T, K] int64: the policy's top-K next tokens at t
    stats_from: int = 0  # the three above are defined at t ≥ stats_from (0 before, not sent; ≤ prompt_len)

    def __post_init__(self) -> None:
        r = self.record
        t = r.input_ids.numel()
        if r.input_ids.dim() != 1 or t < 2:
            raise RecordError(f"input_ids must be [T] with T ≥ 2, got {tuple(r.input_ids.shape)}")
        if r.loss_mask.shape != (t,) or r.loss_mask.dtype != torch.bool:
            raise RecordError(
                f"loss_mask must be bool [{t}], got {r.loss_mask.dtype} {tuple(r.loss_mask.shape)}"
            )
        for name, x in (("aux", r.aux), ("final", r.final)):
            if x.dim() != 2 or x.shape[0] != t or not x.is_floating_point():
                raise RecordError(
                    f"{name} must be a float [{t}, width] tensor, got {x.dtype} {tuple(x.shape)}"
                )
        for name, x in (("next_logprob", self.next_logprob), ("logit_lse", self.logit_lse)):
            if x is not None and x.shape != (t,):
                raise RecordError(f"{name} must be [{t}], got {tuple(x.shape)}")
        if self.topk_ids is not None and (
            self.topk_ids.dim() != 2 or self.topk_ids.shape[0] != t or self.topk_ids.shape[1] < 1
        ):
            raise RecordError(f"topk_ids must be [{t}, K ≥ 1], got {tuple(self.topk_ids.shape)}")
        if not 0 <= self.stats_from <= t:
            raise RecordError(f"stats_from {self.stats_from} outside [0, {t}]")
        if self.policy_version < 0 or self.step < 0:
            raise RecordError(f"policy_version {self.policy_version} and step {self.step} must be ≥ 0")

    @property
    def num_tokens(self) -> int:
        return self.record.input_ids.numel()

    @property
    def has_response(self) -> bool:
        return bool(self.record.loss_mask.any())

    @property
    def prompt_len(self) -> int:
        """Index of the first response (loss_mask) token; RecordError if there is none."""
        hit = torch.nonzero(self.record.loss_mask)
        if hit.numel() == 0:
            raise RecordError("record has no response token (loss_mask is all False)")
        return int(hit[0, 0])


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T] bool, False on padding
    loss_mask: torch.Tensor  # [B, T] bool
    aux: torch.Tensor  # [B, T, n_aux·H]
    final: torch.Tensor  # [B, T, H]
    starts: torch.Tensor  # [B, M] chain starts (positions s with a trainable step)
    starts_valid: torch.Tensor  # [B, M] bool

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())

    def cast(self, dtype: torch.dtype) -> Batch:
        """The states (aux, final) in ``dtype``: bf16-stored taps meet an fp32 draft without autocast."""
        if self.aux.dtype == dtype and self.final.dtype == dtype:
            return self
        return dataclasses.replace(self, aux=self.aux.to(dtype), final=self.final.to(dtype))

    def to(self, device: torch.device | str) -> Batch:
        if self.input_ids.device == torch.device(device):
            return self
        return Batch(
            *(
                t.to(device, non_blocking=True)
                for t in (
                    self.input_ids,
                    self.valid,
                    self.loss_mask,
                    self.aux,
                    self.final,
                    self.starts,
                    self.starts_valid,
                )
            )
        )


def chain_starts(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Positions s (of one row, loss_mask [T]) for which some step j < steps predicts a response token,
    i.e. loss_mask[s+2+j] for some j.  Returns sorted [M] int64."""
    t = loss_mask.numel()
    hit = torch.zeros(t, dtype=torch.bool)
    for j in range(steps):
        off = 2 + j
        if off < t:
            hit[: t - off] |= loss_mask[off:]
    return torch.nonzero(hit).flatten()


def collate(records: list[Record], steps: int) -> Batch:
    """Right-pad records into a batch and list each row's chain starts (padded with 0, masked)."""
    b = len(records)
    t = max(len(r) for r in records)
    r0 = records[0]
    ids = torch.zeros(b, t, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    lmask = torch.zeros(b, t, dtype=torch.bool)
    aux = torch.zeros(b, t, r0.aux.shape[-1], dtype=r0.aux.dtype)
    final = torch.zeros(b, t, r0.final.shape[-1], dtype=r0.final.dtype)
    starts_list = []
    for i, r in enumerate(records):
        n = len(r)
        ids[i, :n] = r.input_ids
        valid[i, :n] = True
        lmask[i, :n] = r.loss_mask
        aux[i, :n] = r.aux
        final[i, :n] = r.final
        starts_list.append(chain_starts(r.loss_mask, steps))
    m = max(1, max(s.numel() for s in starts_list))
    starts = torch.zeros(b, m, dtype=torch.long)
    sv = torch.zeros(b, m, dtype=torch.bool)
    for i, s in enumerate(starts_list):
        starts[i, : s.numel()] = s
        sv[i, : s.numel()] = True
    return Batch(ids, valid, lmask, aux, final, starts, sv)


def make_batches(lengths: list[int], batch_tokens: int, generator: torch.Generator) -> list[list[int]]:
    """Length-bucketed batches of record indices, each with at most ``batch_tokens`` padded tokens
    (a longer single record forms its own batch), in a seeded random order."""
    order = torch.randperm(len(lengths), generator=generator).tolist()
    # sort within chunks of 64 by length: little padding, still shuffled across the epoch
    chunks = [sorted(order[i : i + 64], key=lambda k: lengths[k]) for i in range(0, len(order), 64)]
    batches: list[list[int]] = []
    for chunk in chunks:
        cur: list[int] = []
        longest = 0
        for k in chunk:
            longest2 = max(longest, lengths[k])
            if cur and longest2 * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur, longest2 = [], lengths[k]
            cur.append(k)
            longest = longest2
        if cur:
            batches.append(cur)
    perm = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in perm]
