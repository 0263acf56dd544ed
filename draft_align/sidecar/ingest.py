"""Tapped messages → validated per-sequence records → the replay buffer.

``TapBatch``es (and ``TapPart``s once all pipeline stages joined) whose shapes fit the draft are split into
:class:`~draft_align.train.records.TappedRecord`s; sequences with NaN/Inf states are dropped and counted,
a pre-norm final state is normalised with the HeadSync's norm.  The records of RL step n wait in
:attr:`Ingest.fresh` until step n's ``StepReport`` (so the monitoring row estimates acceptance on records no
draft was trained on) or until a batch of a later step arrives, then enter the replay buffer.  ``HeadSync``
messages are checked here (:meth:`Ingest.accept_head`); the sidecar applies the accepted ones.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from draft_align.heads.layers import rms_norm
from draft_align.sidecar.state import Rates, SidecarState
from draft_align.train.records import Record, TappedRecord
from draft_align.train.replay import ReplayBuffer
from draft_align.wire.join import StageJoiner
from draft_align.wire.messages import HeadSync, TapBatch, TapPart
from draft_align.wire.packing import drop_nonfinite

log = logging.getLogger(__name__)


def split_records(batch: TapBatch) -> list[tuple[Record, dict[str, torch.Tensor | None]]]:
    """Per-sequence (Record, extras) of a decoded TapBatch (post-norm final hidden expected)."""
    out = []
    cu = batch.cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        rec = Record(
            input_ids=batch.input_ids[a:b],
            loss_mask=batch.loss_mask[a:b],
            aux=batch.aux_hidden[a:b],
            final=batch.final_hidden[a:b],
        )
        extras = {
            name: (None if getattr(batch, name) is None else getattr(batch, name)[a:b])
            for name in ("next_logprob", "logit_lse", "topk_ids")
        }
        out.append((rec, extras))
    return out


class Ingest:
    """The sidecar's data path from the wire to its replay buffer (see the module docstring).

    ``aux_ids``/``hidden``/``vocab``/``draft_to_target``: what every message must match (the starting
    draft's aux layers and vocabulary map, the target's sizes).  Counters go to ``state``, throughput to
    ``rates``.
    """

    def __init__(self, buffer: ReplayBuffer, state: SidecarState, rates: Rates, *, aux_ids: tuple[int, ...],
                 hidden: int, vocab: int, draft_to_target: torch.Tensor) -> None:
        self.buffer = buffer
        self.state = state
        self.rates = rates
        self.aux_ids = tuple(aux_ids)
        self.hidden = int(hidden)
        self.vocab = int(vocab)
        self.draft_to_target = draft_to_target.cpu()
        self.fresh: dict[int, list[tuple[TappedRecord, float]]] = {}  # RL step → (record, temperature)
        self.joiner = StageJoiner()  # joins the TapParts of pipeline-parallel policies into TapBatches
        self.has_head = False  # a HeadSync was accepted: training and estimates can start
        self.norm: tuple[torch.Tensor, float] | None = None  # the HeadSync's final-norm (weight, eps)

    def accept_head(self, msg: HeadSync) -> bool:
        """Whether ``msg`` should replace the head rows: it matches the draft's vocabulary and the target, is
        finite and not older than the head in use (mismatched and non-finite ones are counted)."""
        if msg.hidden_size != self.hidden or msg.vocab_size != self.vocab or not torch.equal(
            msg.draft_to_target.cpu(), self.draft_to_target
        ):
            self.state.mismatched_messages += 1
            log.warning("HeadSync v%d does not match the draft vocab/target: ignored", msg.policy_version)
            return False
        if not (torch.isfinite(msg.rows).all() and torch.isfinite(msg.norm_weight).all()):
            self.state.nonfinite_heads += 1
            log.warning("HeadSync v%d has non-finite rows or norm: ignored", msg.policy_version)
            return False
        if msg.policy_version < self.state.head_policy_version:
            return False  # an older head arriving late
        self.norm = (msg.norm_weight, float(msg.norm_eps))
        self.state.head_policy_version = int(msg.policy_version)
        self.has_head = True
        return True

    def on_part(self, msg: TapPart) -> None:
        """A pipeline stage's share: ingested only once all stages joined."""
        joined = self.joiner.offer(msg)
        if joined is not None:
            self.on_batch(joined)

    def on_batch(self, msg: TapBatch) -> None:
        if (
            tuple(msg.aux_layer_ids) != self.aux_ids
            or msg.hidden_size != self.hidden
            or msg.vocab_size != self.vocab
            or msg.final_hidden is None
        ):
            self.state.mismatched_messages += 1
            log.warning(
                "TapBatch %d from rank %d: aux %s / hidden %d / vocab %d / final %s do not match the draft "
                "(aux %s, hidden %d, vocab %d, final needed): dropped",
                msg.batch_id, msg.source_rank, msg.aux_layer_ids, msg.hidden_size, msg.vocab_size,
                msg.final_hidden is not None, self.aux_ids, self.hidden, self.vocab,
            )
            return
        t0 = time.perf_counter()
        clean, dropped = drop_nonfinite(msg)
        self.state.nonfinite_sequences += dropped
        if clean is None:
            return
        if clean.final_norm == "pre":
            if self.norm is None:
                self.state.mismatched_messages += 1
                return  # a pre-norm final state needs the HeadSync norm first
            w, eps = self.norm
            final = clean.final_hidden
            # normalised and scaled in float32, rounded once to the wire dtype
            normed = rms_norm(final.float(), w.float(), eps).to(final.dtype)
            clean = dataclasses.replace(clean, final_hidden=normed, final_norm="post")
        for rec, extras in split_records(clean):
            if not bool(rec.loss_mask.any()):
                continue
            tr = TappedRecord(
                record=rec, policy_version=int(clean.policy_version), step=int(clean.step), **extras
            )
            self.fresh.setdefault(int(clean.step), []).append((tr, clean.temperature))
        # a step whose report never came (dropped) must not hold its records back from training
        self.flush(upto_step=int(clean.step) - 1)
        self.state.newest_policy_version = max(self.state.newest_policy_version, int(clean.policy_version))
        self.state.ingested_tokens += clean.num_tokens
        self.state.ingested_messages += 1
        self.rates.ingest_tokens += clean.num_tokens
        self.rates.ingest_s += time.perf_counter() - t0

    def step_records(self, step: int) -> tuple[list[TappedRecord], float | None]:
        """The records tapped in RL step ``step`` not yet in the buffer, and their rollouts' temperature
        (None when there are none)."""
        fresh = self.fresh.get(step, [])
        return [tr for tr, _ in fresh], (fresh[0][1] if fresh else None)

    def buffer_record(self, rec: TappedRecord) -> bool:
        """Add one record to the replay buffer (counted in ``buffered_tokens``); False if it refused it."""
        if self.buffer.add(rec) is None:
            return False
        self.state.buffered_tokens += rec.num_tokens
        return True

    def flush(self, upto_step: int | None = None) -> None:
        """Move tapped records of steps ≤ upto_step (all if None) into the replay buffer."""
        for step in sorted(self.fresh):
            if upto_step is not None and step > upto_step:
                continue
            for tr, _ in self.fresh.pop(step):
                self.buffer_record(tr)

    def end_run(self) -> None:
        """The RL job's final report: incomplete stage joins are dropped (later TapParts are refused) and
        every record still held goes to the buffer."""
        self.joiner.end_run()
        self.flush()
