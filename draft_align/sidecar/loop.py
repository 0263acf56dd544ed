"""The sidecar's loop: receive → validate → replay buffer → TTT training → gate → versioned publish → notify.

One loop (:meth:`Sidecar.run`), all its state in :class:`~draft_align.sidecar.state.SidecarState`
(checkpointed beside the trainer): (1) drain the PULL socket for at most ``drain_s``: ``TapBatch`` records go
to the replay buffer (``sidecar/ingest.py``), ``HeadSync`` replaces the head rows the soft targets are
computed from, ``StepReport`` closes an RL step: the estimated acceptance of the published and frozen drafts
on the step's fresh records, merged with the RL job's own measurements into one monitoring row
(``monitor/rows.py``) for the sinks; (2) one optimizer step on a recency-weighted batch (a non-finite loss
skips it, counted); (3) every ``publish.every_s`` the candidate is gated against the published draft
(``sidecar/gate.py``); (4) every ``train.checkpoint_every_s`` the trainer state is saved atomically.  Published
versions are complete folders renamed into place, never half-visible.  Nothing here can reach the policy.

A full disk (OSError) or an export refused (ExportError: e.g. weights finite in fp32, ±inf in bf16) at
publish or checkpoint time is one logged line and a counter (``publish_failures``; an export refusal is a
gate rejection); the last published draft keeps serving and the next attempt waits (:class:`Backoff`).  After
``train.max_consecutive_nonfinite`` non-finite steps in a row the head in use is dropped (ERROR, ``nonfinite_alarms``)
and training waits for the next HeadSync.  A restart trusts only what verifies (``sidecar/resume.py``).
Published versions beyond the newest ``publish.keep_versions`` (never ``latest``) are deleted after each publish.
Under torchrun the multi-rank loop (``sidecar/ranked.py``) runs instead.  The parts are built from the recipe
in ``sidecar/build.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draft_align.config import CotrainRecipe
from draft_align.heads.draft_head import DraftHead
from draft_align.monitor.rows import SidecarStats, StepRow, estimate_key, row_estimates
from draft_align.publish.versions import discard_tmp_versions
from draft_align.sidecar.build import (
    build_gate,
    build_ingest,
    build_trainer,
    build_trigger,
    load_starting_drafts,
    load_target_side,
    open_recorder,
    open_sidecar_sinks,
    open_wire,
    trainable_draft,
)
from draft_align.sidecar.layout import (
    SIDECAR_DIR,
    STATE_FILE,
    TRAINER_DIR,
    guard_name,
    lock_name,
    recording_name,
    write_ready,
)
from draft_align.sidecar.lock import RunLock
from draft_align.sidecar.ranked import GatheredDraft, ranked_loop
from draft_align.sidecar.resume import set_aside
from draft_align.sidecar.state import Backoff, Rates, SidecarState, sidecar_stats
from draft_align.train.parallel import RankGroup, attach, rank_device
from draft_align.train.records import Batch, TappedRecord, collate
from draft_align.train.trainer import NonFiniteLossError
from draft_align.wire.channel import DRAIN_MAX_MESSAGES
from draft_align.wire.messages import HeadSync, Message, StepReport, TapBatch, TapPart
from draft_align.wire.recording import WireRecorder
from draft_align.wire.sequence_guard import save_guard

log = logging.getLogger(__name__)

Control = HeadSync | StepReport  # what every rank applies, whichever rank received it
GUARD_SAVE_S = 0.5  # the sequence guard is saved at most this often (and at close): a kill loses less


class Sidecar:
    """The co-training sidecar of one run (see the module docstring).

    ``Sidecar(recipe, start_draft).setup()`` builds it in a fixed order (:meth:`_setup_drafts`,
    :meth:`_setup_trainer`, :meth:`_setup_wire`, :meth:`_setup_sinks`); :meth:`run` loops until ``stop`` is
    set, ``max_seconds`` passed or (``exit_when_done``) the RL job's final report, then checkpoints and
    closes.  ``ranks``: the torchrun rank group (``train/parallel.py``), None for one process.
    Threads, the global seed and signal handlers are the process's business (``cli/runs.py``), not the sidecar's.
    """

    def __init__(
        self,
        recipe: CotrainRecipe,
        start_draft: Path,
        *,
        exit_when_done: bool = False,
        ranks: RankGroup | None = None,
        stop: threading.Event | None = None,
        lock: RunLock | None = None,
    ) -> None:
        self.recipe = recipe
        self.start_draft = Path(start_draft)
        self.exit_when_done = exit_when_done
        # under torchrun (train/parallel.py): rank 0 alone gates, publishes, monitors and checkpoints
        self.ranks = ranks
        self.is_lead = ranks is None or ranks.is_lead
        self.stop_event = stop if stop is not None else threading.Event()
        self.run_dir = recipe.run_dir
        self.dir = self.run_dir / SIDECAR_DIR
        self.device = torch.device(recipe.device) if ranks is None else rank_device(recipe.device, ranks.info)
        self.state = SidecarState()
        self.rates = Rates()
        self.backoff = Backoff()  # after a failed publish / checkpoint (disk full)
        self.nonfinite_in_a_row = 0
        self.resumed = False
        self.trigger = build_trigger(recipe.sidecar.trigger)
        self.waiting: str | None = "no head yet"  # why the last next_batch() gave no batch (None: it did)
        # RL step → the draft published when its first taps arrived: its row's "adapted" estimate (records
        # train on arrival, so a draft published later may have trained on them)
        self._step_drafts: dict[int, nn.Module] = {}
        self._shared_control: list[Control] = []  # received here, for every rank to apply (multi-rank only)
        self.recorder: WireRecorder | None = None  # sidecar.recording.enabled
        self.lock = lock  # one sidecar per run folder (sidecar/lock.py); taken at setup unless given
        self._guard_saved, self._guard_saved_at = 0, 0.0  # the guard's changes at its last save, and when
        self._guard_failing = False  # the last save failed (a full disk)

    # ------------------------------------------------------------------ setup
    def setup(self) -> Sidecar:
        """Build everything (in this order); returns self."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.lock is None:  # before anything in the run is touched
            self.lock = RunLock.acquire(self.dir / lock_name(self.rank))
        try:
            discard_tmp_versions(self.run_dir)
            draft = self._setup_drafts()
            self._setup_trainer(draft)
            self._setup_wire()
            self._setup_sinks()
        except BaseException:  # e.g. a busy Prometheus port: release the sockets already bound, and the lock
            self.close()
            raise
        self._last_ckpt = time.monotonic()
        self._t0 = time.monotonic()
        return self

    def _setup_drafts(self) -> DraftHead:
        """The target's frozen embedding and tokenizer fingerprint, the starting ("frozen") draft, the resumed
        state, the gate with the published draft it compares against; returns the draft to train."""
        recipe, sc = self.recipe, self.recipe.sidecar
        target = load_target_side(recipe.target, self.device)
        self.target_config, self.target_name = target.config, target.name
        self.tok_fp = target.tokenizer_fingerprint
        self.embed: nn.Module = target.embed
        start = load_starting_drafts(self.run_dir, self.start_draft, target, self.device)
        self.frozen, self.frozen_manifest = start.frozen, start.frozen_manifest
        self.aux_ids = tuple(self.frozen.cfg.aux_layer_ids)
        self.hidden = int(self.target_config.hidden_size)
        self.vocab = int(self.target_config.vocab_size)
        self.state, self.resumed = start.state, start.resumed
        self.gate = build_gate(
            sc, start, target, self.start_draft, self.device, run_dir=self.run_dir, run_id=recipe.run
        )
        draft = trainable_draft(sc.train, start.published, self.device, seed=recipe.seed)
        if sc.train.adapt == "lora" and (not self.resumed or not self.state.lora_base_dir):
            self.state.lora_base_dir = str(start.latest if start.latest is not None else self.start_draft)
        return draft

    def _setup_trainer(self, draft: DraftHead) -> None:
        """The trainer on ``draft`` (rows: the frozen head until the first HeadSync), attached to the ranks,
        resumed from the checkpoint."""
        sc, ranks = self.recipe.sidecar, self.ranks
        rows = self.frozen.lm_head.weight.detach().clone()  # until the first HeadSync
        self.trainer = build_trainer(sc.train, draft, self.embed, rows)
        # fsdp2 (train/parallel.py): the trainer's draft is sharded over the ranks; rank 0 gates and exports
        # a plain copy that sync_full() refreshes from the gathered full state (``full_state``)
        sharded = ranks is not None and sc.parallel == "fsdp2"
        self._gathered = GatheredDraft(draft, self.is_lead) if sharded else None
        if ranks is not None:  # before the load: under fsdp2 the checkpoint is loaded into the shards
            attach(self.trainer, ranks, sc.parallel)
        if self.resumed:
            try:
                self.trainer.load(self.dir / TRAINER_DIR)
            # unreadable or another configuration's: train on from the published draft
            except RuntimeError as e:
                set_aside(self.dir / TRAINER_DIR, e)
                self.resumed = False
                return
            log.info(
                "resumed sidecar at train step %d (restart %d)", self.state.train_steps, self.state.restarts
            )

    def _setup_wire(self) -> None:
        """The replay buffer and the ingest in front of it, the PULL socket (rank r: its own endpoint) and,
        on the lead rank, the DraftPublished PUB socket (``sidecar/build.py``)."""
        rank, lead = self.rank, self.is_lead
        recipe = self.recipe
        self.ingest = build_ingest(
            recipe.sidecar.buffer,
            recipe.tap,
            self.state,
            self.rates,
            self.frozen,
            self.target_config,
            rank,
            lead,
            seed=recipe.seed,
        )
        self.guard_file = self.dir / guard_name(rank)  # the sequence guard outlives a restart
        self.wire_key, self.receiver, self.gate.publisher = open_wire(
            recipe.wire, self.run_dir, rank=rank, is_lead=lead, guard_file=self.guard_file
        )
        rc = self.recipe.sidecar.recording
        if rc.enabled:  # every valid message, for adapt_playback.py (wire/recording.py)
            self.recorder = open_recorder(rc, self.dir / recording_name(rank), self.frozen)

    def _setup_sinks(self) -> None:
        """Lead rank: ``monitor.jsonl``, ``metrics.jsonl``, wandb, Prometheus; the other ranks: their training
        metrics only (``sidecar/build.py``)."""
        self.sinks = open_sidecar_sinks(self.recipe, self.dir, rank=self.rank, is_lead=self.is_lead)

    # ------------------------------------------------------------------ hooks the loops drive
    @property
    def rank(self) -> int | None:
        """This process's torchrun rank; None for a single-process sidecar."""
        return self.ranks.rank if self.ranks is not None else None

    @property
    def has_head(self) -> bool:
        """Whether a HeadSync was accepted (training, estimates and the gate wait for one)."""
        return self.ingest.has_head

    @property
    def rejected(self) -> Counter:
        """Wire rejections by reason (the receiver's, and the stage joiner's as ``join_<reason>``)."""
        joins = self.ingest.joiner.rejected
        return Counter(self.receiver.rejected) + Counter({f"join_{k}": v for k, v in joins.items()})

    @property
    def stop_requested(self) -> bool:
        return self.stop_event.is_set()

    def stop(self) -> None:
        """Ask the loop to end (it checkpoints and closes)."""
        self.stop_event.set()

    def time_up(self, max_seconds: float | None) -> bool:
        return max_seconds is not None and time.monotonic() - self._t0 >= max_seconds

    def checkpoint_due(self) -> bool:
        return (
            self.backoff.ready()
            and time.monotonic() - self._last_ckpt >= self.recipe.sidecar.train.checkpoint_every_s
        )

    def drain(self, budget_s: float, timeout_ms: int, max_messages: int = DRAIN_MAX_MESSAGES) -> int:
        """Handle the messages waiting on the PULL socket: up to ``max_messages`` consumed (rejected ones
        count, and never end the drain as if the queue were empty) within about ``budget_s`` (the first
        valid one waited for up to ``timeout_ms``); returns how many valid ones arrived."""
        self.ingest.joiner.expire()  # incomplete pipeline-stage joins time out (counted), never wait
        n = 0
        for msg in self.receiver.drain(budget_s, timeout_ms, max_messages):
            n += 1
            self.handle(msg)
        self.save_guard_state()
        return n

    def save_guard_state(self, force: bool = False) -> None:
        """Save the receiver's sequence guard when it accepted messages since the last save, at most every
        ``GUARD_SAVE_S`` (``force``: now); a failure (full disk) is logged and retried at the next call."""
        guard = self.receiver.guard
        if guard.changes == self._guard_saved or (
            not force and time.monotonic() - self._guard_saved_at < GUARD_SAVE_S
        ):
            return
        self._guard_saved_at = time.monotonic()
        try:
            save_guard(self.guard_file, guard, self.wire_key)
        except OSError as e:  # logged once per failing stretch; retried every GUARD_SAVE_S
            (log.debug if self._guard_failing else log.error)(
                "cannot save the sequence guard to %s: %s", self.guard_file, e
            )
            self._guard_failing = True
            return
        self._guard_saved, self._guard_failing = guard.changes, False

    def handle(self, msg: Message) -> None:
        """One valid message off the wire (or out of a recording: ``benchmarks/adapt_playback.py``)."""
        if getattr(msg, "run_id", None) != self.recipe.run:
            self.state.foreign_messages += 1
            return
        if self.recorder is not None:
            self.recorder.record(msg)
        if self.ranks is not None and isinstance(msg, (HeadSync, StepReport)):
            self._shared_control.append(msg)  # every rank applies it, at the next step boundary
            return
        if isinstance(msg, (TapBatch, TapPart)):
            self._step_drafts.setdefault(int(msg.step), self.gate.published)
        if isinstance(msg, TapBatch):
            self.ingest.on_batch(msg)
        elif isinstance(msg, TapPart):  # a pipeline stage's share: trained only once all stages joined
            self.ingest.on_part(msg)
        elif isinstance(msg, HeadSync):
            self.on_head(msg)
        elif isinstance(msg, StepReport):
            self.on_report(msg)
        else:
            self.state.mismatched_messages += 1

    def on_head(self, msg: HeadSync) -> None:
        """New head rows for the soft targets (MTP: also the drafts' shared lm_head), once accepted."""
        if not self.ingest.accept_head(msg):
            return
        self.trainer.rows = msg.rows.to(self.device)
        self.trigger.on_head(msg.rows)
        if self.frozen.shares_target_head:  # MTP: the engine uses the policy's own lm_head
            plain = self._gathered.plain if self._gathered is not None else None
            for d in (self.trainer.draft, self.gate.published, self.frozen, plain):
                if d is not None:
                    d.set_head(msg.rows)

    def on_report(self, msg: StepReport) -> None:
        """An RL step ended: estimate both drafts on its tapped records, hand one monitoring row to the sinks."""
        step = int(msg.step)
        if msg.is_final:
            self.ingest.end_run()
            self.state.done = True
            return
        if not self.is_lead:  # rank 0 writes the row (from its share of the step's records)
            self.ingest.flush(upto_step=step)
            self.state.last_step_report = max(self.state.last_step_report, step)
            return
        t = time.time()
        records, temp = self.ingest.step_records(step)
        temp = temp if temp is not None else self.recipe.rl.task.temperature
        adapted = self._step_drafts.pop(step, self.gate.published)
        for old in [s for s in self._step_drafts if s < step]:  # steps whose report never came
            del self._step_drafts[old]
        estimates: dict[str, float] = {}
        if not records:
            self.state.reports_without_taps += (
                1  # its taps were dropped or never sent: a row without estimates
            )
        if records and self.has_head:
            drafts = {"adapted": adapted, "frozen": self.frozen}
            estimates = row_estimates(drafts, lambda draft, mode: self.estimate(draft, records, mode, temp))
        self.ingest.flush(upto_step=step)
        self.state.last_step_report = max(self.state.last_step_report, step)
        gate_mode = "probabilistic" if self.recipe.sidecar.gate.mode == "probabilistic" else "greedy_draft"
        self.trigger.on_estimate(estimates.get(estimate_key("adapted", gate_mode)))
        row = StepRow.from_report(
            msg,
            self.stats(window=True),
            time=t,
            estimates=estimates,
            est_records=len(records) if estimates else None,
        )
        self.sinks.observe(row)
        self.state.monitor_rows += 1

    def estimate(
        self, draft: nn.Module, records: list[TappedRecord], mode: str, temperature: float
    ) -> dict[str, Any]:
        """:func:`~draft_align.monitor.tapped_estimate.estimate_records` with the current head rows and ``gate.k``."""
        from draft_align.monitor.tapped_estimate import estimate_records

        return estimate_records(
            draft, self.embed, self.trainer.rows, records, self.recipe.sidecar.gate.k, mode, temperature
        )

    def stats(self, window: bool = False) -> SidecarStats:
        """The sidecar's counters; ``window``: with the busy / waiting shares since the last windowed call (the
        per-step rows)."""
        return sidecar_stats(
            self.state,
            self.ingest.buffer.stats(),
            self.rates,
            self.rejected,
            trigger=self.trigger,
            waiting=self.waiting,
            window=window,
        )

    def train_one(self) -> bool:
        """One optimizer step if a batch is ready (True also when a non-finite loss skipped it)."""
        batch = self.next_batch()
        return batch is not None and self.train_on(batch)

    def next_batch(self) -> Batch | None:
        """A training batch from the replay buffer, or None while training should wait."""
        buf, tc = self.recipe.sidecar.buffer, self.recipe.sidecar.train
        if not self.has_head:
            self.waiting = "no head yet"
        elif not self.trigger.wants_training():
            self.waiting = self.trigger.reason  # drift trigger: the published draft holds
        elif self.state.trained_tokens >= buf.max_replay_ratio * self.state.buffered_tokens:
            self.waiting = "replay cap"  # wait for new data rather than over-fit what is there
        elif (trainable := self.ingest.buffer.trainable_tokens) < min(buf.min_tokens, buf.tokens):
            self.waiting = "min buffer"  # a few dozen sequences would be memorised, not learned from
        else:
            chosen = self.ingest.buffer.sample_records(tc.batch_tokens)
            self.waiting = None if chosen else "no trainable record"
            if not chosen:
                return None
            self.state.trained_policy_version = max(
                self.state.trained_policy_version, max(r.policy_version for r in chosen)
            )
            if tc.lr_ramp_tokens > 0:  # small early buffers take small steps
                self.trainer.set_lr_scale(min(1.0, max(trainable, 1) / tc.lr_ramp_tokens))
            return collate([r.record for r in chosen], tc.objective.ttt_steps)
        return None

    def train_on(self, batch: Batch) -> bool:
        """One optimizer step on ``batch`` (True also when a non-finite loss skipped it)."""
        sc = self.recipe.sidecar
        t0 = time.perf_counter()
        try:
            stats = self.trainer.train_step(batch)
        except NonFiniteLossError as e:
            self.state.nonfinite_steps += 1
            self.nonfinite_in_a_row += 1
            log.warning("%s", e)
            if self.nonfinite_in_a_row >= sc.train.max_consecutive_nonfinite:
                self.state.nonfinite_alarms += 1
                log.error(
                    "ALARM: %d non-finite steps in a row on the head of policy v%d: head dropped, waiting "
                    "for the next HeadSync",
                    self.nonfinite_in_a_row,
                    self.state.head_policy_version,
                )
                self.ingest.drop_head()
                self.nonfinite_in_a_row = 0
            return True
        self.nonfinite_in_a_row = 0
        self.rates.train_tokens += batch.num_tokens
        self.rates.train_s += time.perf_counter() - t0
        self.state.train_steps += 1
        self.state.trained_tokens += batch.num_tokens
        self.gate.steps_since_publish += 1
        if self.state.train_steps % max(1, sc.monitor.log_every) == 0:
            self.sinks.log({f"train/{k}": v for k, v in stats.items()}, step=self.state.train_steps)
        return True

    def _account(self, trained: bool, seconds: float) -> None:
        """One loop iteration's wall time: loop time, and waiting time by reason when it trained nothing."""
        self.rates.loop_s += seconds
        if not trained:
            self.rates.waited(self.waiting or "no trainable record", seconds)

    def publish_due(self, force: bool = False) -> bool:
        """Whether a publish attempt (gate) is due on this rank: the lead rank, a head to score with, enough
        steps, the interval passed (or ``force``)."""
        return self.is_lead and self.has_head and self.backoff.ready() and self.gate.due(force)

    def sync_full(self) -> None:
        """fsdp2: gather the trainer's full draft and optimizer state onto rank 0 (a collective: every rank
        calls it at the same step) and refresh the plain copy that rank 0 gates, exports and checkpoints."""
        if self._gathered is not None:
            self._gathered.sync(self.trainer)

    @property
    def full_state(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """fsdp2, rank 0: the (draft, optimizer) state dicts of the last :meth:`sync_full`; None otherwise."""
        return self._gathered.full if self._gathered is not None else None

    def _candidate(self) -> nn.Module:
        """The trainer's draft as a plain module (under fsdp2: as of the last :meth:`sync_full`)."""
        return self.trainer.draft if self._gathered is None else self._gathered.candidate()

    def maybe_publish(self, force: bool = False) -> bool:
        """Gate and publish the candidate; True when a new version was published (then checkpointed)."""
        if not self.publish_due(force):
            return False
        try:
            if not self.gate.maybe_publish(self._candidate, self.ingest.buffer.holdout(), self.estimate):
                return False
        except OSError as e:
            self._storage_failed("publish", e)
            return False
        self.trigger.on_publish(self.trainer.rows, gain=self.gate.last_gain)
        self.sinks.observe_stats(self.stats())
        self.checkpoint()  # the published version and the trainer state move together
        return True

    def _storage_failed(self, what: str, e: OSError) -> None:
        self.state.publish_failures += 1
        delay = self.backoff.fail()
        log.error(
            "%s failed: %s; still serving draft v%04d, next attempt in %.0f s",
            what,
            e,
            self.state.published_version,
            delay,
        )

    def checkpoint(self) -> None:
        if not self.is_lead:
            return  # rank 0's checkpoint is every rank's (DDP: the same weights; fsdp2: gathered by sync_full)
        assert self._gathered is None or self.full_state is not None, "sync_full() before checkpointing"
        self._last_ckpt = time.monotonic()
        try:
            self.trainer.save(self.dir / TRAINER_DIR, self.full_state)
            self.state.rejected = dict(self.rejected)
            self.state.save(self.dir / STATE_FILE)
        except OSError as e:
            self._storage_failed("checkpoint", e)
            return
        self.backoff.ok()

    # ------------------------------------------------------------------ the loop
    def run(self, max_seconds: float | None = None) -> SidecarState:
        """Loop until stopped, out of time or done (see the class docstring); returns the final state."""
        log.info(
            "sidecar %s listening; draft v%d; aux %s",
            self.recipe.run,
            self.state.published_version,
            self.aux_ids,
        )
        if self.is_lead:  # the launcher waits for it (ppid: torchrun's agent)
            write_ready(
                self.dir,
                {
                    "pid": os.getpid(),
                    "ppid": os.getppid(),
                    "time": time.time(),
                    "draft_version": self.state.published_version,
                    "tap_endpoint": self.receiver.endpoint,
                },
            )
        ended = False  # whether the loop ended normally (every rank leaves it at the same step)
        try:
            if self.ranks is not None:  # torchrun: the ranks agree on every step
                ranked_loop(self, max_seconds)
                self.sync_full()  # for the final checkpoint below
                ended = True
                return self.state
            while not self.stop_requested:
                t_iter = time.perf_counter()
                trained = self.train_one()
                self.drain(budget_s=0.05, timeout_ms=0 if trained else 200)
                self._account(trained, time.perf_counter() - t_iter)
                self.maybe_publish()
                if self.checkpoint_due():
                    self.checkpoint()
                if self.state.done and self.exit_when_done:
                    self.maybe_publish(force=True)
                    break
                if self.time_up(max_seconds):
                    break
        finally:
            if ended or self._gathered is None:  # a failed rank cannot take part in gathering the shards
                self.checkpoint()
            self.close()
        return self.state

    def close(self) -> None:
        """Close what was set up (also after a failed :meth:`setup`)."""
        if getattr(self, "receiver", None) is not None:
            self.save_guard_state(force=True)
        for part in (
            getattr(self, "receiver", None),
            getattr(getattr(self, "gate", None), "publisher", None),
            getattr(self, "sinks", None),
            self.recorder,
        ):
            if part is not None:
                part.close()
        if self.lock is not None:
            self.lock.release()
