"""Join the per-stage :class:`~draft_align.wire.messages.TapPart` messages of a pipeline-parallel policy
into whole :class:`~draft_align.wire.messages.TapBatch` messages (docs/wire.md, "TapPart").

A batch is keyed by ``(run_id, source_rank, batch_id)``; it is complete when all ``num_stages`` stages
have sent their part.  Nothing waits on a missing part: an incomplete batch is dropped once it is older
than ``timeout_s`` (checked on every :meth:`StageJoiner.add` and :meth:`StageJoiner.expire`), and only a
complete, consistent join is ever returned, so nothing is trained on a partial batch.

Every dropped part or batch is counted by reason (:data:`JOIN_REASONS`):

- ``expired``: a batch still incomplete ``timeout_s`` after its first part (a stage died or dropped it);
- ``ended_incomplete``: a batch still incomplete when the run ended (:meth:`StageJoiner.end_run`);
- ``after_end``: a part that arrived after the run ended;
- ``layer_mismatch``: the stages disagree on the joined ``aux_layer_ids``, two stages claim the same
  layer, or the stages' layers together are not exactly ``aux_layer_ids`` (the whole batch is dropped);
- ``inconsistent``: the stages disagree on the sequences (``cu_seqlens``, ``input_ids``, ``loss_mask``),
  on a scalar field (policy version, step, sizes, temperature, stage count), or more than one stage sent
  final/log-prob tensors (the whole batch is dropped);
- ``duplicate``: a second part for a stage that already sent one (the newcomer is dropped);
- ``late``: a part of a batch that was already dropped (expired or rejected);
- ``overflow``: the oldest incomplete batch, dropped because ``max_pending`` batches were waiting.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draft_align.wire.codec import validate
from draft_align.wire.messages import BatchHeader, TapBatch, TapPart
from draft_align.wire.schema import ReasonError

logger = logging.getLogger(__name__)

JOIN_REASONS: tuple[str, ...] = (
    "expired",
    "ended_incomplete",
    "after_end",
    "layer_mismatch",
    "inconsistent",
    "duplicate",
    "late",
    "overflow",
)
DEFAULT_TIMEOUT_S = 60.0
_DEAD_KEYS = 4096  # how many dropped batch keys are remembered (to count their stragglers as ``late``)
_SCALARS = ("policy_version", "step", "num_stages", "hidden_size", "vocab_size", "temperature")
_SEQUENCE_TENSORS = ("cu_seqlens", "input_ids", "loss_mask")
_LAST_STAGE_TENSORS = ("final_hidden", "next_logprob", "logit_lse", "topk_ids", "topk_logprobs")

Key = tuple[str, int, int]  # (run_id, source_rank, batch_id)


class JoinError(ReasonError):
    """A part the joiner dropped; ``reason`` is one of :data:`JOIN_REASONS`."""

    reasons = JOIN_REASONS


@dataclass
class _Pending:
    first_seen: float
    parts: dict[int, TapPart] = field(default_factory=dict)  # stage → part


def _key(part: TapPart) -> Key:
    return (part.run_id, int(part.source_rank), int(part.batch_id))


def _describe(key: Key) -> str:
    return f"batch {key[2]} of pipeline {key[1]} (run {key[0]!r})"


class StageJoiner:
    """Joins TapParts into TapBatches (see the module docstring).  Not thread-safe; ``clock`` is injectable
    so tests can expire batches without sleeping."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        max_pending: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if int(max_pending) < 1:
            raise ValueError(f"max_pending must be ≥ 1, got {max_pending}")
        self.timeout_s = float(timeout_s)
        self.max_pending = int(max_pending)
        self.clock = clock
        self.rejected: Counter[str] = Counter()  # reason → parts or batches dropped
        self.joined = 0
        self.ended = False
        self._pending: OrderedDict[Key, _Pending] = OrderedDict()  # oldest first
        self._dead: OrderedDict[Key, str] = OrderedDict()  # dropped batch → why

    # ------------------------------------------------------------------------------------------ public
    def add(self, part: TapPart) -> TapBatch | None:
        """Take one part; returns the joined TapBatch when it completes its batch, else None.  Raises
        :class:`JoinError` (already counted) when the part, or the batch it belongs to, is dropped."""
        if not isinstance(part, TapPart):
            raise TypeError(f"StageJoiner.add takes a TapPart, got {type(part).__name__}")
        key = _key(part)
        if self.ended:
            self._reject("after_end", f"{_describe(key)} stage {part.stage}: the run has ended")
        self.expire()
        if key in self._dead:
            self._reject(
                "late", f"{_describe(key)} stage {part.stage}: the batch was dropped ({self._dead[key]})"
            )
        pending = self._pending.get(key)
        if pending is None:
            if part.num_stages == 1:
                return self._join(key, {part.stage: part})
            while len(self._pending) >= self.max_pending:
                old_key, old = self._pending.popitem(last=False)
                self._count_drop(
                    old_key, "overflow", f"{self._missing(old)}; {self.max_pending} batches waited"
                )
            self._pending[key] = _Pending(first_seen=self.clock(), parts={part.stage: part})
            return None
        if part.stage in pending.parts:
            self._reject("duplicate", f"{_describe(key)}: stage {part.stage} sent twice")
        ref = next(iter(pending.parts.values()))
        problem = self._compare(ref, part)
        if problem is not None:
            del self._pending[key]
            self._drop(key, *problem)
        pending.parts[part.stage] = part
        if len(pending.parts) < part.num_stages:
            return None
        del self._pending[key]
        return self._join(key, pending.parts)

    def offer(self, part: TapPart) -> TapBatch | None:
        """:meth:`add` for a receive loop: a dropped part is logged (first of each reason at warning
        level) and None returned; the counters say what was dropped."""
        try:
            return self.add(part)
        except JoinError as e:
            log = logger.warning if self.rejected[e.reason] == 1 else logger.debug
            log("stage join: dropped (%s)", e)
            return None

    def expire(self) -> int:
        """Drop the batches still incomplete ``timeout_s`` after their first part; returns how many."""
        now = self.clock()
        n = 0
        while self._pending:
            key, pending = next(iter(self._pending.items()))
            if now - pending.first_seen < self.timeout_s:
                break
            del self._pending[key]
            n += 1
            self._count_drop(key, "expired", self._missing(pending))
        return n

    def end_run(self) -> int:
        """The run ended: drop every incomplete batch (``ended_incomplete``) and refuse later parts
        (``after_end``).  Returns the number of batches dropped."""
        self.ended = True
        n = len(self._pending)
        while self._pending:
            key, pending = self._pending.popitem(last=False)
            self._count_drop(key, "ended_incomplete", self._missing(pending))
        return n

    @property
    def pending(self) -> int:
        """Incomplete batches waiting for parts."""
        return len(self._pending)

    def stats(self) -> dict[str, int]:
        """joined, pending, and one counter per reason in :data:`JOIN_REASONS`."""
        return {"joined": self.joined, "pending": self.pending, **{r: self.rejected[r] for r in JOIN_REASONS}}

    # ----------------------------------------------------------------------------------------- helpers
    def _reject(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        raise JoinError(reason, detail)

    def _count_drop(self, key: Key, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        self._dead[key] = reason
        while len(self._dead) > _DEAD_KEYS:
            self._dead.popitem(last=False)
        logger.warning("stage join: dropped %s (%s: %s)", _describe(key), reason, detail)

    def _drop(self, key: Key, reason: str, detail: str) -> None:
        self._count_drop(key, reason, detail)
        raise JoinError(reason, f"{_describe(key)}: {detail}")

    @staticmethod
    def _missing(pending: _Pending) -> str:
        n = next(iter(pending.parts.values())).num_stages
        missing = sorted(set(range(n)) - set(pending.parts))
        return f"stages {missing} of {n} never arrived"

    @staticmethod
    def _compare(ref: TapPart, part: TapPart) -> tuple[str, str] | None:
        """Why ``part`` cannot join the batch ``ref`` belongs to, or None."""
        if ref.aux_layer_ids != part.aux_layer_ids:
            return (
                "layer_mismatch",
                f"stage {part.stage} joins aux layers {list(part.aux_layer_ids)}, stage "
                f"{ref.stage} joins {list(ref.aux_layer_ids)}",
            )
        for name in _SCALARS:
            if getattr(ref, name) != getattr(part, name):
                return (
                    "inconsistent",
                    f"{name}: stage {ref.stage} sent {getattr(ref, name)}, stage "
                    f"{part.stage} sent {getattr(part, name)}",
                )
        for name in _SEQUENCE_TENSORS:
            a, b = getattr(ref, name), getattr(part, name)
            if a.shape != b.shape or not torch.equal(a, b):
                return ("inconsistent", f"{name} differs between stage {ref.stage} and stage {part.stage}")
        return None

    def _join(self, key: Key, parts: dict[int, TapPart]) -> TapBatch:
        """One TapBatch from a full set of consistent parts; drops the batch (raising) on a layer or
        last-stage-tensor conflict."""
        ordered = [parts[s] for s in sorted(parts)]
        ref = ordered[0]
        owner: dict[int, int] = {}  # layer id → stage
        for p in ordered:
            for lid in p.layer_ids:
                if lid in owner:
                    self._drop(
                        key, "layer_mismatch", f"layer {lid} sent by stages {owner[lid]} and {p.stage}"
                    )
                owner[lid] = p.stage
        if tuple(sorted(owner)) != ref.aux_layer_ids:
            self._drop(
                key,
                "layer_mismatch",
                f"the stages sent layers {sorted(owner)}, the batch needs {list(ref.aux_layer_ids)}",
            )
        extra: dict[str, torch.Tensor] = {}
        final_norm = None
        for name in _LAST_STAGE_TENSORS:
            senders = [p for p in ordered if getattr(p, name) is not None]
            if len(senders) > 1:
                self._drop(key, "inconsistent", f"{name} sent by stages {[p.stage for p in senders]}")
            if senders:
                extra[name] = getattr(senders[0], name)
                if name == "final_hidden":
                    final_norm = senders[0].final_norm
        if ("topk_ids" in extra) != ("topk_logprobs" in extra):
            self._drop(key, "inconsistent", "topk_ids and topk_logprobs came from different stages")
        h = ref.hidden_size
        columns = []
        for lid in ref.aux_layer_ids:
            p = parts[owner[lid]]
            j = p.layer_ids.index(lid)
            columns.append(p.aux_hidden[:, j * h : (j + 1) * h])
        batch = TapBatch(
            **BatchHeader.of(ref, final_norm=final_norm).fields(),
            cu_seqlens=ref.cu_seqlens,
            input_ids=ref.input_ids,
            loss_mask=ref.loss_mask,
            aux_hidden=torch.cat(columns, dim=1).contiguous(),
            **extra,
        )
        validate(batch)  # every part was valid on the wire, so this only guards the join itself
        self.joined += 1
        return batch
