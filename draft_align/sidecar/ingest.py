"""Tapped messages → validated per-sequence records → the replay buffer.

``TapBatch``es (and ``TapPart``s once all pipeline stages joined) whose shapes fit the draft are split into
:class:`~draft_align.train.records.TappedRecord`s; sequences with NaN/Inf states are dropped and counted,
a pre-norm final state is normalised with the HeadSync's norm.  Records enter the replay buffer as they
arrive (training on RL step n's taps starts before step n's ``StepReport``, which the RL job sends only after
its update); :attr:`Ingest.fresh` keeps references to step n's records until that report, for the monitoring
row's estimates (the sidecar estimates them with the draft published when they arrived, which no training on
them reached).  Those references are bounded: beyond ``max_held_tokens`` (the sidecar: ``sidecar.buffer.tokens // 4``)
the longest-held leave the step's estimate and are counted (``held_dropped_records``/``held_dropped_tokens``),
so steps whose report never comes cannot pile up.  ``HeadSync`` messages are checked here (:meth:`Ingest.accept_head`: shapes, finite,
``|x| ≤ HEAD_MAX_ABS``); the sidecar applies the accepted ones.

Policy versions: a HeadSync whose version is lower than the one in use is a restart of the RL job (it
started again from version 0 beside this sidecar, or the head in use came with a bogus version): it is
logged, counted (``rl_restarts``) and accepted, and from then on every version the RL job sends is shifted
by ``policy_offset`` so that the versions the sidecar trains, weights and publishes with keep increasing.
They end at :data:`~draft_align.conventions.MAX_VERSION` (the wire's int64): a HeadSync or TapBatch whose
version would go past it (a restart after a bogus head at 2^63 − 1) is refused, counted in
``version_overflows`` and logged once, never carried into a publish the wire cannot announce.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from draft_align.conventions import MAX_VERSION
from draft_align.heads.layers import rms_norm
from draft_align.sidecar.state import Rates, SidecarState
from draft_align.train.records import Record, TappedRecord
from draft_align.train.replay import ReplayBuffer
from draft_align.wire.join import StageJoiner
from draft_align.wire.messages import HeadSync, TapBatch, TapPart
from draft_align.wire.packing import drop_nonfinite

log = logging.getLogger(__name__)

MAX_VERSION_JUMP = 1 << 20  # a HeadSync may move the policy version this far ahead of the head in use
MAX_FIRST_VERSION = 1 << 40  # the first HeadSync's version (a job resumed late is still far below)

#: the largest |value| accepted in a HeadSync's rows and norm weight (real lm_head rows and RMSNorm weights
#: are O(1); 3e38 rows make every logit non-finite)
HEAD_MAX_ABS = 1e4


def split_records(batch: TapBatch) -> list[tuple[Record, dict[str, torch.Tensor | int | None]]]:
    """Per-sequence (Record, extras) of a decoded TapBatch (post-norm final hidden expected); the extras are
    the statistics and ``stats_from``, where they start (0: every position)."""
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
        extras: dict[str, torch.Tensor | int | None] = {
            name: (None if getattr(batch, name) is None else getattr(batch, name)[a:b])
            for name in ("next_logprob", "logit_lse", "topk_ids")
        }
        extras["stats_from"] = batch.stats_start(i)
        out.append((rec, extras))
    return out


class Ingest:
    """The sidecar's data path from the wire to its replay buffer (see the module docstring).

    ``aux_ids``/``hidden``/``vocab``/``draft_to_target``: what every message must match (the starting
    draft's aux layers and vocabulary map, the target's sizes).  Counters go to ``state``, throughput to
    ``rates``.
    """

    def __init__(
        self,
        buffer: ReplayBuffer,
        state: SidecarState,
        rates: Rates,
        *,
        aux_ids: tuple[int, ...],
        hidden: int,
        vocab: int,
        draft_to_target: torch.Tensor,
        max_held_tokens: int | None = None,
    ) -> None:
        self.buffer = buffer
        self.state = state
        self.rates = rates
        self.aux_ids = tuple(aux_ids)
        self.hidden = int(hidden)
        self.vocab = int(vocab)
        self.draft_to_target = draft_to_target.cpu()
        # RL step → (record, temperature) until the step's report (the records are in the buffer already)
        self.fresh: dict[int, list[tuple[TappedRecord, float]]] = {}
        self.max_held_tokens = max_held_tokens  # None: unbounded
        self.held_tokens = 0  # tokens in ``fresh``
        self.joiner = StageJoiner()  # joins the TapParts of pipeline-parallel policies into TapBatches
        self.has_head = False  # a HeadSync was accepted: training and estimates can start
        self.norm: tuple[torch.Tensor, float] | None = None  # the HeadSync's final-norm (weight, eps)
        self.head_tapped = False  # whether a TapBatch of the head's policy version came since it

    def policy_version(self, sent: int) -> int:
        """The sidecar's policy version for a version the RL job sent (shifted after an RL restart)."""
        return int(sent) + self.state.policy_offset

    def accept_head(self, msg: HeadSync) -> bool:
        """Whether ``msg`` should replace the head rows: it matches the draft's vocabulary and the target, is
        finite and within ``HEAD_MAX_ABS`` (mismatched and rejected ones are counted); a version lower than
        the one in use is an RL restart (the module docstring)."""
        if (
            msg.hidden_size != self.hidden
            or msg.vocab_size != self.vocab
            or not torch.equal(msg.draft_to_target.cpu(), self.draft_to_target)
        ):
            self.state.mismatched_messages += 1
            log.warning("HeadSync v%d does not match the draft vocab/target: ignored", msg.policy_version)
            return False
        bad = _head_problem(msg)
        if bad is not None:
            self.state.nonfinite_heads += 1
            log.warning("HeadSync v%d rejected: %s", msg.policy_version, bad)
            return False
        version = self.policy_version(msg.policy_version)
        restart = version < self.state.head_policy_version
        if (self.state.head_policy_version + 1 if restart else version) > MAX_VERSION:
            self._out_of_range("HeadSync", msg.policy_version)
            return False
        jump = (
            MAX_FIRST_VERSION
            if not self.has_head
            else max(self.state.head_policy_version, 0) + MAX_VERSION_JUMP
        )
        if not restart and version > jump:  # one bogus version must not pin every later one out
            self.state.version_overflows += 1
            log.warning(
                "HeadSync policy version %d jumps past v%d (the head in use v%d + 2^20; a first head ≤ 2^40): "
                "refused (counted in version_overflows)",
                msg.policy_version,
                jump,
                self.state.head_policy_version,
            )
            return False
        if restart:
            offset = self.state.head_policy_version + 1 - int(msg.policy_version)
            log.warning(
                "HeadSync policy version %d is lower than the head in use (v%d): the RL job restarted; its "
                "versions are counted from v%d on (offset %d)",
                msg.policy_version,
                self.state.head_policy_version,
                self.state.head_policy_version + 1,
                offset,
            )
            self.state.rl_restarts += 1
            self.state.policy_offset = offset
            self.flush()  # the previous run's steps get no estimate (their step numbers start again)
            version = self.policy_version(msg.policy_version)
        if self.has_head and not self.head_tapped and version != self.state.head_policy_version:
            self.state.untapped_heads += (
                1  # its version's taps were dropped (or it had none): nothing to train
            )
        self.head_tapped = self.head_tapped and version == self.state.head_policy_version
        self.norm = (msg.norm_weight, float(msg.norm_eps))
        self.state.head_policy_version = version
        self.has_head = True
        return True

    def _out_of_range(self, what: str, sent: int) -> None:
        """Count (``version_overflows``) and log a message whose policy version cannot be counted."""
        self.state.version_overflows += 1
        (log.error if self.state.version_overflows == 1 else log.debug)(
            "%s policy version %d cannot be counted after the head in use (v%d, offset %d): sidecar policy "
            "versions end at 2^63 - 1; refused (counted in version_overflows).  A bogus version was accepted "
            "earlier: start a new run (or move %s aside) to count from 0 again",
            what,
            sent,
            self.state.head_policy_version,
            self.state.policy_offset,
            "<run>/sidecar",
        )

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
                msg.batch_id,
                msg.source_rank,
                msg.aux_layer_ids,
                msg.hidden_size,
                msg.vocab_size,
                msg.final_hidden is not None,
                self.aux_ids,
                self.hidden,
                self.vocab,
            )
            return
        t0 = time.perf_counter()
        version = self.policy_version(msg.policy_version)
        if version > MAX_VERSION:
            self._out_of_range("TapBatch", msg.policy_version)
            return
        if version < self.state.head_policy_version:
            # older than the head in use, with no HeadSync saying the RL job restarted: kept under the version
            # it names (weighted as old data), counted
            self.state.old_version_batches += 1
        elif version == self.state.head_policy_version:
            self.head_tapped = True
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
            if not bool(rec.loss_mask[2:].any()):  # no chain start: no step of any cut could train on it
                self.state.untrainable_records += 1
                continue
            tr = TappedRecord(
                record=rec,
                policy_version=self.policy_version(clean.policy_version),
                step=int(clean.step),
                **extras,
            )
            self.buffer_record(tr)
            self.fresh.setdefault(int(clean.step), []).append((tr, clean.temperature))
            self.held_tokens += tr.num_tokens
        # a step whose report never came (dropped) gets no estimate
        self.flush(upto_step=int(clean.step) - 1)
        self._bound_held()
        self.state.newest_policy_version = max(
            self.state.newest_policy_version, self.policy_version(clean.policy_version)
        )
        self.state.ingested_tokens += clean.num_tokens
        self.state.ingested_messages += 1
        self.rates.ingest_tokens += clean.num_tokens
        self.rates.ingest_s += time.perf_counter() - t0

    def step_records(self, step: int) -> tuple[list[TappedRecord], float | None]:
        """The records tapped in RL step ``step`` (until its report), and their rollouts' temperature (None
        when there are none)."""
        fresh = self.fresh.get(step, [])
        return [tr for tr, _ in fresh], (fresh[0][1] if fresh else None)

    def buffer_record(self, rec: TappedRecord) -> bool:
        """Add one record to the replay buffer (counted in ``buffered_tokens``); False if it refused it."""
        if self.buffer.add(rec) is None:
            return False
        self.state.buffered_tokens += rec.num_tokens
        return True

    def flush(self, upto_step: int | None = None) -> None:
        """Forget the step records of steps ≤ upto_step (all if None): their estimate is made or given up."""
        for step in sorted(self.fresh):
            if upto_step is not None and step > upto_step:
                continue
            for tr, _ in self.fresh.pop(step):
                self.held_tokens -= tr.num_tokens

    def _bound_held(self) -> None:
        """Drop (and count) the longest-held records while more than ``max_held_tokens`` are held."""
        if self.max_held_tokens is None:
            return
        dropped = 0
        while self.held_tokens > self.max_held_tokens and self.fresh:
            step = next(iter(self.fresh))  # dicts keep insertion order: the step held longest
            tr, _ = self.fresh[step].pop(0)
            if not self.fresh[step]:
                del self.fresh[step]
            self.held_tokens -= tr.num_tokens
            self.state.held_dropped_records += 1
            self.state.held_dropped_tokens += tr.num_tokens
            dropped += 1
        if dropped:
            log.warning(
                "%d tapped records of steps without a StepReport left their step's estimate (%d tokens "
                "held at most; they still train)",
                dropped,
                self.max_held_tokens,
            )

    def drop_head(self) -> None:
        """Stop using the head in use (training and estimates wait for the next HeadSync)."""
        self.has_head = False

    def end_run(self) -> None:
        """The RL job's final report: incomplete stage joins are dropped (later TapParts are refused) and
        every record still held goes to the buffer."""
        self.joiner.end_run()
        self.flush()


def _head_problem(msg: HeadSync) -> str | None:
    """Why a HeadSync's rows or norm weight cannot be used (None: they can)."""
    for name, t in (("rows", msg.rows), ("norm_weight", msg.norm_weight)):
        if not bool(torch.isfinite(t).all()):
            return f"non-finite {name}"
        peak = float(t.detach().abs().max()) if t.numel() else 0.0
        if peak > HEAD_MAX_ABS:
            return f"{name} magnitude {peak:.3g} > {HEAD_MAX_ABS:g}"
    return None
