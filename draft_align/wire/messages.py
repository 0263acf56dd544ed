"""Wire messages (docs/wire.md): the message dataclasses, their ``make_dummy`` test builders, and
:func:`decode` (frames → a message, through :mod:`~draft_align.wire.codec`).

The schema (field and tensor specs, validators, :class:`WireError`) is in ``schema.py``; the bytes, the
HMAC and the envelope (sender id, sequence number) in ``codec.py``; batch construction in ``packing.py``.
This module does not import zmq (see ``channel.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, ClassVar, Self

import torch

from draft_align.wire.codec import (
    Origin,
    decode_frames,
    encode,
)
from draft_align.wire.schema import _STAGE_LAST_TENSORS, _TENSOR_SPECS, WireError


class _WireMessage:
    """What every message has: its tensors in wire order (those present) and its frames both ways."""

    KIND: ClassVar[str]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present tensors in wire order."""
        return {n: getattr(self, n) for n in _TENSOR_SPECS[self.KIND] if getattr(self, n) is not None}

    def to_frames(self, key: bytes | None) -> list[bytes]:
        return encode(self, key)

    @classmethod
    def from_frames(cls, frames: Sequence[Any], key: bytes | None, **limits: int) -> Self:
        """Decode ``frames`` as this kind of message; another kind is a ``kind`` WireError."""
        msg = decode(frames, key, **limits)
        if type(msg) is not cls:
            raise WireError("kind", f"expected {cls.KIND}, got {type(msg).KIND}")
        return msg


@dataclass(frozen=True)
class BatchHeader:
    """The ten fields a TapBatch and each of its TapParts carry besides their tensors (and, for a part, its
    stage): which run, policy version, pipeline and batch the sequences are, and what their tensors mean.  Built
    in one place, :meth:`of` (from a message) or by a Tap, and spread into a message with :meth:`fields`."""

    run_id: str
    policy_version: int
    source_rank: int
    batch_id: int
    step: int
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    vocab_size: int
    final_norm: str | None
    temperature: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))

    @classmethod
    def of(cls, message: TapBatch | TapPart, **changes: Any) -> BatchHeader:
        """The header ``message`` carries, with ``changes`` (field → value) applied."""
        return cls(**{**{f.name: getattr(message, f.name) for f in dataclass_fields(cls)}, **changes})

    def fields(self) -> dict[str, Any]:
        """The header as a message's keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclass_fields(self)}


@dataclass(frozen=True, eq=False)
class TapBatch(_WireMessage):
    """Policy → sidecar: S sequences, N tokens, ragged-packed by ``cu_seqlens``."""

    run_id: str
    policy_version: int
    source_rank: int
    batch_id: int
    step: int
    aux_layer_ids: tuple[int, ...]  # HF hidden_states indices, ascending
    hidden_size: int  # H
    vocab_size: int  # V
    final_norm: str | None  # "post" | "pre" | None (None iff final_hidden is None)
    temperature: float  # the rollouts' sampling temperature
    cu_seqlens: torch.Tensor  # [S+1] int64, 0 = cu[0] < … < cu[S] = N, every sequence ≥ 2 tokens
    input_ids: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [N] bool: response tokens
    aux_hidden: torch.Tensor  # [N, n_aux·H] bf16
    final_hidden: torch.Tensor | None = None  # [N, H] bf16
    next_logprob: torch.Tensor | None = None  # [N] f32: log p(x_{t+1} | x_≤t) at T=1; 0 at a sequence's end
    logit_lse: torch.Tensor | None = None  # [N] f32: logsumexp of the full-vocab logits at t (T=1)
    topk_ids: torch.Tensor | None = None  # [N, K] int64
    topk_logprobs: torch.Tensor | None = None  # [N, K] f32
    # [S] int32: in sequence i the four statistics above are defined at positions ≥ stats_from[i] (from the
    # sequence's start, ≤ its first response token) and 0 before; None: at every position
    stats_from: torch.Tensor | None = None

    KIND: ClassVar[str] = "TapBatch"

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def sequence(self, i: int) -> dict[str, torch.Tensor]:
        """Views of sequence ``i``'s tokens: every present per-token tensor (not ``cu_seqlens`` or
        ``stats_from``: see :meth:`stats_start`), sliced to [T, ...]."""
        i = self._index(i)
        a, b = int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1])
        per_token = (n for n in self.tensors() if n not in ("cu_seqlens", "stats_from"))
        return {name: getattr(self, name)[a:b] for name in per_token}

    def stats_start(self, i: int) -> int:
        """The first position of sequence ``i`` (from its start) whose statistics are defined (0 without
        ``stats_from``)."""
        i = self._index(i)
        return 0 if self.stats_from is None else int(self.stats_from[i])

    def _index(self, i: int) -> int:
        s = self.num_sequences
        if not -s <= i < s:
            raise IndexError(f"sequence {i} of a batch of {s}")
        return i % s

    @classmethod
    def make_dummy(
        cls,
        num_sequences: int = 3,
        *,
        min_len: int = 2,
        max_len: int = 9,
        hidden_size: int = 8,
        vocab_size: int = 50,
        aux_layer_ids: tuple[int, ...] = (1, 2, 3),
        final: bool = True,
        logprobs: bool = True,
        topk: int = 2,
        stats_from: bool = False,
        policy_version: int = 0,
        batch_id: int = 0,
        seed: int = 0,
    ) -> TapBatch:
        """A small valid batch with seeded random contents (tests only); ``stats_from``: statistics only from
        the position before each sequence's first response token (0 before), as the HF Tap sends them."""
        g = torch.Generator().manual_seed(seed)
        seqs = []
        starts = []
        for _ in range(num_sequences):
            t = int(torch.randint(min_len, max_len + 1, (), generator=g))
            prompt = int(torch.randint(1, t, (), generator=g))
            s: dict[str, torch.Tensor] = {
                "input_ids": torch.randint(0, vocab_size, (t,), generator=g),
                "loss_mask": torch.arange(t) >= prompt,
                "aux_hidden": torch.randn(t, len(aux_layer_ids) * hidden_size, generator=g).bfloat16(),
            }
            if final:
                s["final_hidden"] = torch.randn(t, hidden_size, generator=g).bfloat16()
            if logprobs:
                lp = -torch.rand(t, generator=g) * 5
                lp[-1] = 0.0
                s["next_logprob"] = lp
                s["logit_lse"] = torch.randn(t, generator=g) + 4
            if topk:
                s["topk_ids"] = torch.randint(0, vocab_size, (t, topk), generator=g)
                s["topk_logprobs"] = -(torch.rand(t, topk, generator=g) * 5).sort(dim=-1).values
            starts.append(prompt - 1 if stats_from else 0)
            for name in ("next_logprob", "logit_lse", "topk_ids", "topk_logprobs"):
                if name in s:
                    s[name][: starts[-1]] = 0
            seqs.append(s)
        cu = torch.zeros(num_sequences + 1, dtype=torch.int64)
        cu[1:] = torch.tensor([s["input_ids"].shape[0] for s in seqs]).cumsum(0)
        return cls(
            run_id="dummy",
            policy_version=policy_version,
            source_rank=0,
            batch_id=batch_id,
            step=0,
            aux_layer_ids=aux_layer_ids,
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            final_norm="post" if final else None,
            temperature=1.0,
            cu_seqlens=cu,
            **{n: torch.cat([s[n] for s in seqs]) for n in seqs[0]},
            stats_from=torch.tensor(starts, dtype=torch.int32) if stats_from and (logprobs or topk) else None,
        )


@dataclass(frozen=True, eq=False)
class TapPart(_WireMessage):
    """Policy → sidecar: one pipeline stage's share of a TapBatch (megatron pipeline parallelism).

    Every stage of pipeline ``source_rank`` sends one part per ``batch_id`` with the same sequences
    (``cu_seqlens``, ``input_ids``, ``loss_mask``) and the aux states of the layers it owns (``layer_ids``,
    a subset of the joined batch's ``aux_layer_ids``); the stage holding the final norm and output layer
    adds ``final_hidden`` and the log-prob tensors.  :mod:`draft_align.wire.join` joins the ``num_stages``
    parts into one TapBatch; a part alone is never trained on.
    """

    run_id: str
    policy_version: int
    source_rank: int  # the pipeline (its data-parallel rank): the joined TapBatch's source_rank
    batch_id: int
    step: int
    stage: int  # 0 ≤ stage < num_stages
    num_stages: int
    layer_ids: tuple[int, ...]  # HF hidden_states indices captured by this stage, ascending (may be empty)
    aux_layer_ids: tuple[int, ...]  # the joined batch's aux_layer_ids (all stages together)
    hidden_size: int
    vocab_size: int
    final_norm: str | None
    temperature: float
    cu_seqlens: torch.Tensor  # [S+1] int64
    input_ids: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [N] bool
    aux_hidden: torch.Tensor  # [N, len(layer_ids)·H] bf16
    final_hidden: torch.Tensor | None = None  # [N, H] bf16
    next_logprob: torch.Tensor | None = None  # [N] f32
    logit_lse: torch.Tensor | None = None  # [N] f32
    topk_ids: torch.Tensor | None = None  # [N, K] int64
    topk_logprobs: torch.Tensor | None = None  # [N, K] f32

    KIND: ClassVar[str] = "TapPart"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @classmethod
    def split(cls, batch: TapBatch, layers_per_stage: Sequence[Sequence[int]]) -> list[TapPart]:
        """The parts pipeline stages would send for ``batch`` (tests, and a reference for the join):
        stage i carries the aux layers ``layers_per_stage[i]``; the last stage carries final hidden and
        log-prob tensors."""
        if batch.stats_from is not None:
            raise ValueError(
                "a TapPart carries no stats_from: split a batch with statistics at every position"
            )
        n_stages = len(layers_per_stage)
        h = batch.hidden_size
        col = {lid: j for j, lid in enumerate(batch.aux_layer_ids)}
        stray = {i for ids in layers_per_stage for i in ids} - set(col)
        if stray:
            raise ValueError(
                f"layers {sorted(stray)} are not in the batch's aux_layer_ids {batch.aux_layer_ids}"
            )
        parts = []
        for stage, ids in enumerate(layers_per_stage):
            last = stage == n_stages - 1
            aux = [batch.aux_hidden[:, col[i] * h : (col[i] + 1) * h] for i in ids]
            extra = {n: t for n, t in batch.tensors().items() if n in _STAGE_LAST_TENSORS} if last else {}
            parts.append(
                cls(
                    **BatchHeader.of(batch, final_norm=batch.final_norm if last else None).fields(),
                    stage=stage,
                    num_stages=n_stages,
                    layer_ids=tuple(ids),
                    cu_seqlens=batch.cu_seqlens.clone(),
                    input_ids=batch.input_ids.clone(),
                    loss_mask=batch.loss_mask.clone(),
                    aux_hidden=torch.cat(aux, dim=1)
                    if aux
                    else batch.aux_hidden.new_empty(batch.num_tokens, 0),
                    **extra,
                )
            )
        return parts

    @classmethod
    def make_dummy(
        cls, stage: int = 0, layers_per_stage: Sequence[Sequence[int]] = ((1,), (2, 3)), **batch_kwargs: Any
    ) -> TapPart:
        """Stage ``stage``'s part of ``TapBatch.make_dummy(**batch_kwargs)`` (tests only)."""
        return cls.split(TapBatch.make_dummy(**batch_kwargs), layers_per_stage)[stage]


@dataclass(frozen=True, eq=False)
class HeadSync(_WireMessage):
    """Policy → sidecar, once per policy version: what turns ``final_hidden`` into draft-vocab logits."""

    run_id: str
    policy_version: int
    hidden_size: int  # H
    vocab_size: int  # V
    norm_eps: float
    norm_weight: torch.Tensor  # [H] f32, the final RMSNorm weight
    draft_to_target: torch.Tensor  # [Vd] int64, distinct, in 0..V-1
    rows: torch.Tensor  # [Vd, H] bf16, lm_head rows in draft-id order

    KIND: ClassVar[str] = "HeadSync"

    @classmethod
    def make_dummy(
        cls,
        *,
        hidden_size: int = 8,
        vocab_size: int = 50,
        draft_vocab: int = 16,
        policy_version: int = 0,
        seed: int = 0,
    ) -> HeadSync:
        g = torch.Generator().manual_seed(seed)
        d2t = torch.randperm(vocab_size, generator=g)[:draft_vocab].sort().values
        return cls(
            run_id="dummy",
            policy_version=policy_version,
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            norm_eps=1e-5,
            norm_weight=1 + 0.1 * torch.randn(hidden_size, generator=g),
            draft_to_target=d2t,
            rows=torch.randn(draft_vocab, hidden_size, generator=g).bfloat16(),
        )


@dataclass(frozen=True)
class DraftPublished(_WireMessage):
    """Sidecar → anyone (PUB/SUB): a new draft version is on disk."""

    run_id: str
    draft_version: int  # ≥ 1
    policy_version: int  # newest policy version in the training data
    path: str  # the version folder
    sha256: str  # 64 hex chars, of model.safetensors
    metrics: dict[str, float] = field(default_factory=dict)

    KIND: ClassVar[str] = "DraftPublished"

    @classmethod
    def make_dummy(
        cls, *, draft_version: int = 1, policy_version: int = 0, path: str = "/tmp/drafts/v0001"
    ) -> DraftPublished:
        return cls(
            run_id="dummy",
            draft_version=draft_version,
            policy_version=policy_version,
            path=path,
            sha256=hashlib.sha256(f"{path}:{draft_version}".encode()).hexdigest(),
            metrics={"acceptance_length": 2.5, "loss": 0.75},
        )


@dataclass(frozen=True)
class StepReport(_WireMessage):
    """RL job → sidecar: the job's own per-step measurements (None = not measured this step)."""

    run_id: str
    step: int
    policy_version: int
    metrics: dict[str, float | None] = field(default_factory=dict)

    KIND: ClassVar[str] = "StepReport"
    FINAL: ClassVar[str] = "final"  # the metric (1.0) that marks the RL job's last report

    @classmethod
    def final(cls, run_id: str, step: int, policy_version: int) -> StepReport:
        """The RL job's last report: the sidecar ends its run on it (``exit_when_done``: it checkpoints and
        exits)."""
        return cls(run_id=run_id, step=step, policy_version=policy_version, metrics={cls.FINAL: 1.0})

    @property
    def is_final(self) -> bool:
        return bool(self.metrics.get(self.FINAL))

    @classmethod
    def make_dummy(cls, *, step: int = 0, policy_version: int = 0) -> StepReport:
        return cls(
            run_id="dummy",
            step=step,
            policy_version=policy_version,
            metrics={"reward": 0.5, "kl": 0.01, "acceptance_length/v0001": None, "tap_dropped": 0.0},
        )


Message = TapBatch | HeadSync | DraftPublished | StepReport | TapPart
_CLASSES: dict[str, type] = {c.KIND: c for c in (TapBatch, HeadSync, DraftPublished, StepReport, TapPart)}


def decode_with_origin(frames: Sequence[Any], key: bytes | None, **limits: int) -> tuple[Message, Origin]:
    """Validate and decode one message and its envelope (sender id, sequence number): see
    :func:`~draft_align.wire.codec.decode_frames`, whose ``max_bytes``/``max_tokens`` ``limits`` are.  Raises
    :class:`WireError` on any violation."""
    d = decode_frames(frames, key, **limits)
    cls = _CLASSES[d.kind]
    order = _TENSOR_SPECS[d.kind]
    return cls(**d.fields, **{n: d.tensors[n] for n in order if n in d.tensors}), d.origin


def decode(frames: Sequence[Any], key: bytes | None, **limits: int) -> Message:
    """Validate and decode one message (frames as bytes, memoryviews or zmq.Frame), without its envelope:
    :func:`decode_with_origin`.  Raises :class:`WireError` on any violation; the returned tensors own their
    memory."""
    return decode_with_origin(frames, key, **limits)[0]
