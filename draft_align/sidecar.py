"""The sidecar: receive → validate → replay buffer → TTT training → gate → versioned publish → notify.

One loop (:meth:`Sidecar.run`), all its state in :class:`SidecarState` (checkpointed beside the trainer):

1. drain the PULL socket for at most ``drain_s``: ``TapBatch`` records go to the replay buffer (sequences
   with NaN/Inf states are dropped and counted), ``HeadSync`` replaces the head rows the soft targets are
   computed from, ``StepReport`` closes an RL step: the step's freshly tapped records (not trained on yet)
   give the estimated acceptance of the published and of the frozen draft, merged with the RL job's own
   measurements into one monitoring row (JSONL, wandb, Prometheus);
2. one optimizer step on a recency-weighted batch (a non-finite loss skips the step and is counted);
3. every ``publish_every_s`` (after ``min_train_steps_per_publish`` steps) the candidate is compared with the
   published draft on the freshest held-out records (paired, per sequence, engine-replay estimate); it is
   published only if not worse beyond noise: ``diff ≥ −max(gate_tolerance, 2·stderr)``;
4. every ``checkpoint_every_s`` the trainer state is saved (atomic), so a ``kill -9`` loses at most that much
   training; published versions are complete folders renamed into place, so none is ever half-visible.

Nothing here can reach the policy: the sidecar holds a frozen copy of the target's embedding and the head
rows it was sent, and its own optimizer.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draft_align.config import CotrainRecipe, step_decay
from draft_align.heads.eagle3 import Eagle3Draft
from draft_align.publish import load_draft
from draft_align.publish.compat import tokenizer_fingerprint
from draft_align.publish.folder import ExportError
from draft_align.publish.versions import discard_tmp_versions, publish_version, read_latest, resolve_draft_dir
from draft_align.train.batch import Batch, Record
from draft_align.train.distributed import RankGroup, attach, join_ranks, rank_device, ranked_loop
from draft_align.train.trainer import (
    DraftTrainer,
    LossSettings,
    NonFiniteLossError,
    OptimSettings,
    checkpoint_exists,
)
from draft_align.wire.join import StageJoiner

log = logging.getLogger(__name__)

SIDECAR_DIR = "sidecar"
TRAINER_DIR = "trainer"
STATE_FILE = "state.json"
MONITOR_FILE = "monitor.jsonl"
PUBLISH_FILE = "publish.jsonl"
PORT_FILE = "prometheus.port"
READY_FILE = "ready.json"  # written once the sockets are bound: {"pid", "time", "draft_version"}
TAP_SOCKET = "tap"
NOTIFY_SOCKET = "notify"


class SidecarError(RuntimeError):
    """The sidecar cannot start or continue (bad starting draft, incompatible target, …)."""


@dataclass
class SidecarState:
    """Everything about the sidecar's progress besides tensors (JSON, beside the trainer checkpoint)."""

    published_version: int = 0  # newest version this sidecar published (0 = the starting draft)
    published_policy_version: int = -1
    newest_policy_version: int = -1
    head_policy_version: int = -1
    train_steps: int = 0
    trained_tokens: int = 0
    ingested_tokens: int = 0
    buffered_tokens: int = 0  # tokens that entered the replay buffer (the replay ratio's denominator)
    ingested_messages: int = 0
    nonfinite_sequences: int = 0
    nonfinite_steps: int = 0
    nonfinite_heads: int = 0
    gate_rejections: int = 0
    foreign_messages: int = 0
    mismatched_messages: int = 0
    monitor_rows: int = 0
    restarts: int = 0
    last_step_report: int = -1
    done: bool = False
    lora_base_dir: str | None = None  # adapt=lora: the published draft the adapters are trained over
    rejected: dict[str, int] = field(default_factory=dict)


def starting_draft(recipe: CotrainRecipe, path: str | None = None) -> Path:
    """The folder of the draft co-training starts from: ``path``, ``recipe.draft`` (a draft folder or a run
    folder with ``latest``), else the warm-start recipe's published draft (which must exist)."""
    from draft_align.config import WarmstartRecipe, load_recipe

    given = path or recipe.draft
    if given is None:
        ws: WarmstartRecipe = load_recipe(recipe.warmstart_recipe)
        given = str(ws.run_dir)
    try:
        return resolve_draft_dir(Path(given))
    except ExportError as e:
        raise SidecarError(
            f"no starting draft at {given} ({e}): run the warm-start first (draft-align warmstart "
            f"{recipe.warmstart_recipe}) or set `draft:` to a published draft folder"
        ) from e


def split_records(batch: Any) -> list[tuple[Record, dict[str, torch.Tensor | None]]]:
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] → weight · x / sqrt(mean(x²) + eps), computed in float32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class Sidecar:
    """The co-training sidecar of one run (see the module docstring)."""

    def __init__(self, recipe: CotrainRecipe, start_draft: Path, *, exit_when_done: bool = False,
                 ranks: RankGroup | None = None) -> None:
        from draft_align import assets
        from draft_align.hf.parts import frozen_embedding
        from draft_align.monitor.prometheus import PromExporter
        from draft_align.train.replay import ReplayBuffer
        from draft_align.warmstart import MetricsSink
        from draft_align.wire import channel

        self.recipe = recipe
        self.exit_when_done = exit_when_done
        # under torchrun (train/distributed.py): rank 0 alone gates, publishes, monitors and checkpoints
        self.ranks = ranks
        self.is_lead = ranks is None or ranks.is_lead
        self.shared_control: list[Any] = []  # HeadSync/StepReport received here, for every rank to apply
        sc = recipe.sidecar
        torch.manual_seed(recipe.seed)
        self.run_dir = recipe.run_dir
        self.dir = self.run_dir / SIDECAR_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        discard_tmp_versions(self.run_dir)
        self.device = torch.device(recipe.device) if ranks is None else rank_device(recipe, ranks.info)

        target, tok = assets.load_target(recipe.target.model, getattr(torch, recipe.target.dtype), "cpu")
        self.target_config = target.config
        self.target_name = recipe.target.model
        self.tok_fp = tokenizer_fingerprint(tok)
        self.embed: nn.Module = frozen_embedding(target).to(self.device)
        del target

        self.frozen, self.frozen_manifest = load_draft(start_draft, device=self.device)
        self.frozen.eval()
        from draft_align.publish.compat import check_compatible

        check_compatible(self.frozen_manifest, self.target_config, self.tok_fp)
        self.aux_ids = tuple(self.frozen.cfg.aux_layer_ids)
        self.hidden = int(self.target_config.hidden_size)
        self.vocab = int(self.target_config.vocab_size)

        self.state = SidecarState()
        sfile = self.dir / STATE_FILE
        tdir = self.dir / TRAINER_DIR
        resumed = checkpoint_exists(tdir) and sfile.is_file()
        if resumed:
            self.state = SidecarState(**json.loads(sfile.read_text()))
            self.state.restarts += 1
            self.state.done = False
        # the published draft the gate compares against: the run's latest, else the starting draft
        latest = read_latest(self.run_dir)
        if latest is not None:
            self.published, man = load_draft(latest, device=self.device)
            self.state.published_version = max(self.state.published_version, int(man["draft_version"]))
            self.state.published_policy_version = int(man["policy_version"])
        else:
            self.published = self._copy(self.frozen)
        self.published.eval()
        draft = self._copy(self.published)
        lora = sc.adapt == "lora"
        if lora:  # adapters over the frozen starting point, with their own optimizer settings
            from draft_align.heads.lora import apply_lora, lora_settings

            apply_lora(draft, lora_settings(sc.lora), seed=recipe.seed)
            if not resumed or not self.state.lora_base_dir:
                self.state.lora_base_dir = str(latest if latest is not None else start_draft)
        head = draft.kind
        rows = self.frozen.lm_head.weight.detach().clone()  # until the first HeadSync
        self.trainer = DraftTrainer(
            draft,
            self.embed,
            rows,
            OptimSettings(
                lr=sc.lora.lr if lora else sc.lr, min_lr_ratio=sc.min_lr_ratio,
                weight_decay=sc.lora.weight_decay if lora else sc.weight_decay,
                warmup_steps=sc.lora.warmup_steps if lora else sc.warmup_steps, total_steps=10**9, grad_clip=sc.grad_clip,
            ),
            LossSettings(
                ttt_steps=sc.ttt_steps, step_decay=step_decay(sc.step_decay, head), kind=sc.loss, train_lm_head=True,
                autocast_bf16=sc.autocast_bf16,
            ),
        )
        # fsdp2 (train/distributed.py): the trainer's draft is sharded over the ranks; rank 0 gates and exports
        # a plain copy that sync_full() refreshes from the gathered full state (``_full``)
        self._sharded = ranks is not None and sc.parallel == "fsdp2"
        self._plain: nn.Module | None = copy.deepcopy(draft) if self._sharded and self.is_lead else None
        self._full: tuple[dict[str, torch.Tensor], dict] | None = None
        if ranks is not None:  # before the load: under fsdp2 the checkpoint is loaded into the shards
            attach(self.trainer, ranks, sc.parallel)
        if resumed:
            self.trainer.load(tdir)
            log.info("resumed sidecar at train step %d (restart %d)", self.state.train_steps, self.state.restarts)
        self.has_head = False
        # only rank 0 gates, so only its buffer holds records out; each rank samples with its own seed
        self.buffer = ReplayBuffer(sc.buffer_tokens, sc.recency_half_life, sc.holdout_records if self.is_lead else 0,
                                   recipe.seed + (ranks.rank if ranks is not None else 0))
        self.fresh: dict[int, list[Any]] = {}  # RL step → records tapped in it, not yet estimated
        self.joiner = StageJoiner()  # joins the TapParts of pipeline-parallel policies into TapBatches

        key = channel.resolve_key(recipe.wire.key_file, self.run_dir, create=True)
        self.wire_key = key
        tap_ep = recipe.wire.endpoint or channel.default_endpoint(self.run_dir, TAP_SOCKET)
        if ranks is not None:
            tap_ep = channel.rank_endpoint(tap_ep, ranks.rank)
        note_ep = recipe.wire.notify_endpoint or channel.default_endpoint(self.run_dir, NOTIFY_SOCKET)
        self.receiver = channel.Receiver(
            tap_ep, key, max_bytes=recipe.wire.max_message_mb << 20, max_tokens=recipe.wire.max_tokens,
            allow_remote=recipe.wire.allow_remote,
        )
        self.publisher = (channel.Publisher(note_ep, key, allow_remote=recipe.wire.allow_remote)
                          if self.is_lead else None)
        self.prom = None
        if sc.prometheus_port is not None and self.is_lead:
            self.prom = PromExporter(port=sc.prometheus_port)
            self.prom.write_port_file(self.dir / PORT_FILE)
        if self.is_lead:
            self.sink = MetricsSink(self.dir, recipe, f"{recipe.run}-sidecar")
        else:  # the other ranks' training metrics: <run>/sidecar/rank<r>/metrics.jsonl, no wandb
            quiet = replace(recipe, logging=replace(recipe.logging, wandb=False))
            self.sink = MetricsSink(self.dir / f"rank{ranks.rank}", quiet, f"{recipe.run}-sidecar")
        self._stop = False
        self._last_publish = time.monotonic()
        self._last_ckpt = time.monotonic()
        self._steps_since_publish = 0
        self._rates = {"train_tokens": 0.0, "train_s": 0.0, "ingest_tokens": 0.0, "ingest_s": 0.0}
        self._t0 = time.monotonic()

    # ------------------------------------------------------------------ helpers
    def _copy(self, draft: Eagle3Draft) -> Eagle3Draft:
        """A plain copy (EAGLE-3 or MTP; LoRA adapters merged) on the sidecar's device."""
        from draft_align.heads.lora import is_lora, merged

        if is_lora(draft):
            draft = merged(draft)
        out = type(draft)(draft.cfg).to(self.device)
        out.load_state_dict(draft.state_dict())
        return out

    def stop(self, *_: Any) -> None:
        self._stop = True

    @property
    def rejected(self) -> Counter:
        return Counter(self.receiver.rejected) + Counter({f"join_{k}": v for k, v in self.joiner.rejected.items()})

    # ------------------------------------------------------------------ ingest
    def _on_head(self, msg: Any) -> None:
        d2t = self.frozen.draft_to_target.cpu()
        if msg.hidden_size != self.hidden or msg.vocab_size != self.vocab or not torch.equal(
            msg.draft_to_target.cpu(), d2t
        ):
            self.state.mismatched_messages += 1
            log.warning("HeadSync v%d does not match the draft vocab/target: ignored", msg.policy_version)
            return
        if not (torch.isfinite(msg.rows).all() and torch.isfinite(msg.norm_weight).all()):
            self.state.nonfinite_heads += 1
            log.warning("HeadSync v%d has non-finite rows or norm: ignored", msg.policy_version)
            return
        if msg.policy_version < self.state.head_policy_version:
            return  # an older head arriving late
        self.trainer.rows = msg.rows.to(self.device)
        if self.frozen.shares_target_head:  # MTP: the engine uses the policy's own lm_head
            for d in (self.trainer.draft, self.published, self.frozen, self._plain):
                if d is not None:
                    d.set_head(msg.rows)
        self._norm = (msg.norm_weight, float(msg.norm_eps))
        self.state.head_policy_version = int(msg.policy_version)
        self.has_head = True

    def _on_batch(self, msg: Any) -> None:
        from draft_align.train.replay import TappedRecord
        from draft_align.wire.messages import drop_nonfinite

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
            if not self.has_head:
                self.state.mismatched_messages += 1
                return  # a pre-norm final state needs the HeadSync norm first
            w, eps = self._norm
            clean = _replace_final(clean, rms_norm(clean.final_hidden, w, eps))
        for rec, extras in split_records(clean):
            if not bool(rec.loss_mask.any()):
                continue
            tr = TappedRecord(
                record=rec, policy_version=int(clean.policy_version), step=int(clean.step), **extras
            )
            self.fresh.setdefault(int(clean.step), []).append((tr, clean.temperature))
        # a step whose report never came (dropped) must not hold its records back from training
        self._flush_fresh(upto_step=int(clean.step) - 1)
        self.state.newest_policy_version = max(self.state.newest_policy_version, int(clean.policy_version))
        self.state.ingested_tokens += clean.num_tokens
        self.state.ingested_messages += 1
        self._rates["ingest_tokens"] += clean.num_tokens
        self._rates["ingest_s"] += time.perf_counter() - t0

    def _flush_fresh(self, upto_step: int | None = None) -> None:
        """Move tapped records of steps ≤ upto_step (all if None) into the replay buffer."""
        for step in sorted(self.fresh):
            if upto_step is not None and step > upto_step:
                continue
            for tr, _ in self.fresh.pop(step):
                if self.buffer.add(tr) is not None:
                    self.state.buffered_tokens += tr.num_tokens

    def _estimate(self, draft: Eagle3Draft, records: list[Any], mode: str, temperature: float) -> dict[str, Any]:
        from draft_align.monitor.records import estimate_records

        return estimate_records(draft, self.embed, self.trainer.rows, records, self.recipe.sidecar.eval_k, mode,
                                temperature)

    def _on_report(self, msg: Any) -> None:
        """An RL step ended: estimate both drafts on its tapped records, write one monitoring row."""
        step = int(msg.step)
        if msg.metrics.get("final"):
            self.joiner.end_run()  # incomplete stage joins are dropped; later TapParts are refused
            self._flush_fresh()
            self.state.done = True
            return
        if not self.is_lead:  # rank 0 writes the row (from its share of the step's records)
            self._flush_fresh(upto_step=step)
            self.state.last_step_report = max(self.state.last_step_report, step)
            return
        fresh = self.fresh.get(step, [])
        records = [tr for tr, _ in fresh]
        temp = fresh[0][1] if fresh else self.recipe.rl.temperature
        row: dict[str, Any] = {"time": time.time(), "step": step, "policy_version": int(msg.policy_version)}
        row.update({k: v for k, v in msg.metrics.items() if k not in row})
        if records and self.has_head:
            for name, draft in (("adapted", self.published), ("frozen", self.frozen)):
                for mode, suffix in (("greedy_draft", ""), ("probabilistic", "_prob")):
                    est = self._estimate(draft, records, mode, temp)
                    row[f"accept_est_{name}{suffix}"] = est["acceptance_length_est"]
            row["est_records"] = len(records)
        self._flush_fresh(upto_step=step)
        self.state.last_step_report = max(self.state.last_step_report, step)
        row.update(self._sidecar_metrics())
        row["staleness_sidecar"] = int(msg.policy_version) - self.state.published_policy_version
        with open(self.dir / MONITOR_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self.state.monitor_rows += 1
        # wandb needs one monotonic step axis: the sidecar's train step (the RL step is a field of the row)
        self.sink.log({f"rl/{k}": v for k, v in row.items() if isinstance(v, (int, float)) and k != "time"},
                      step=self.state.train_steps)
        self._export(row)

    def _sidecar_metrics(self) -> dict[str, Any]:
        b = self.buffer.stats()
        r = self._rates
        rej = self.rejected
        return {
            "sidecar_draft_version": self.state.published_version,
            "sidecar_draft_policy_version": self.state.published_policy_version,
            "buffer_tokens": b["tokens"],
            "buffer_fill": b["fill"],
            "sidecar_train_steps": self.state.train_steps,
            "sidecar_trained_tokens": self.state.trained_tokens,
            "sidecar_train_tokens_per_s": r["train_tokens"] / r["train_s"] if r["train_s"] else None,
            "sidecar_ingest_tokens_per_s": r["ingest_tokens"] / r["ingest_s"] if r["ingest_s"] else None,
            "sidecar_ingested_tokens": self.state.ingested_tokens,
            "wire_rejected": sum(rej.values()),
            "wire_nonfinite": self.state.nonfinite_sequences,
            "wire_mismatched": self.state.mismatched_messages,
            "nonfinite_steps": self.state.nonfinite_steps,
            "nonfinite_heads": self.state.nonfinite_heads,
            "published_versions": self.state.published_version,
            "gate_rejections": self.state.gate_rejections,
            "sidecar_restarts": self.state.restarts,
        }

    def _export(self, row: dict[str, Any]) -> None:
        if self.prom is None:
            return
        for k, v in row.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or k == "time":
                continue
            self.prom.set_gauge(f"draft_align_{k}", float(v))
        for reason, n in self.rejected.items():
            self.prom.set_counter("draft_align_wire_rejected_total", float(n), labels={"reason": reason})

    def _drain(self, budget_s: float, timeout_ms: int) -> int:
        from draft_align.wire.messages import HeadSync, StepReport, TapBatch, TapPart

        self.joiner.expire()  # incomplete pipeline-stage joins time out (counted), never wait
        n = 0
        end = time.monotonic() + budget_s
        first = True
        while first or time.monotonic() < end:
            msg = self.receiver.recv(timeout_ms if first else 0)
            first = False
            if msg is None:
                break
            n += 1
            if getattr(msg, "run_id", None) != self.recipe.run:
                self.state.foreign_messages += 1
                continue
            if self.ranks is not None and isinstance(msg, (HeadSync, StepReport)):
                self.shared_control.append(msg)  # every rank applies it, at the next step boundary
                continue
            if isinstance(msg, TapBatch):
                self._on_batch(msg)
            elif isinstance(msg, TapPart):  # a pipeline stage's share: trained only once all stages joined
                joined = self.joiner.offer(msg)
                if joined is not None:
                    self._on_batch(joined)
            elif isinstance(msg, HeadSync):
                self._on_head(msg)
            elif isinstance(msg, StepReport):
                self._on_report(msg)
            else:
                self.state.mismatched_messages += 1
        return n

    def _on_control(self, msg: Any) -> None:
        """A HeadSync or StepReport that one of the ranks received (multi-rank only)."""
        from draft_align.wire.messages import HeadSync

        if isinstance(msg, HeadSync):
            self._on_head(msg)
        else:
            self._on_report(msg)

    # ------------------------------------------------------------------ train / publish
    def _train_one(self) -> bool:
        batch = self._next_batch()
        return batch is not None and self._train_on(batch)

    def _next_batch(self) -> Batch | None:
        """A training batch from the replay buffer, or None while training should wait."""
        sc = self.recipe.sidecar
        if not self.has_head:
            return None
        if self.state.trained_tokens >= sc.max_replay_ratio * self.state.buffered_tokens:
            return None  # wait for new data rather than over-fit what is there
        if self.buffer.trainable_tokens < min(sc.min_buffer_tokens, sc.buffer_tokens):
            return None  # a few dozen sequences would be memorised, not learned from
        return self.buffer.sample(sc.batch_tokens, sc.ttt_steps)

    def _train_on(self, batch: Batch) -> bool:
        """One optimizer step on ``batch`` (True also when a non-finite loss skipped it)."""
        sc = self.recipe.sidecar
        t0 = time.perf_counter()
        try:
            stats = self.trainer.train_step(batch)
        except NonFiniteLossError as e:
            self.state.nonfinite_steps += 1
            log.warning("%s", e)
            return True
        self._rates["train_tokens"] += batch.num_tokens
        self._rates["train_s"] += time.perf_counter() - t0
        self.state.train_steps += 1
        self.state.trained_tokens += batch.num_tokens
        self._steps_since_publish += 1
        if self.state.train_steps % max(1, sc.log_every) == 0:
            self.sink.log({f"train/{k}": v for k, v in stats.items()}, step=self.state.train_steps)
        return True

    def publish_due(self, force: bool = False) -> bool:
        """Whether a publish attempt (gate) is due on this rank: enough steps, the interval passed (or
        ``force``), a head to score with."""
        sc = self.recipe.sidecar
        if not self.is_lead or self._steps_since_publish < sc.min_train_steps_per_publish or not self.has_head:
            return False
        return force or time.monotonic() - self._last_publish >= sc.publish_every_s

    def sync_full(self) -> None:
        """fsdp2: gather the trainer's full draft and optimizer state onto rank 0 (a collective: every rank
        calls it at the same step) and refresh the plain copy that rank 0 gates, exports and checkpoints."""
        if not self._sharded:
            return
        self._full = self.trainer.parallel.state_dicts()
        if self._plain is not None and self._full is not None:
            self._plain.load_state_dict(self._full[0], strict=True)

    def _candidate(self) -> nn.Module:
        """The trainer's draft as a plain module (under fsdp2: as of the last :meth:`sync_full`)."""
        if not self._sharded:
            return self.trainer.draft
        assert self._plain is not None and self._full is not None, "sync_full() before gating or exporting"
        return self._plain

    def maybe_publish(self, force: bool = False) -> bool:
        """Gate and publish the candidate; True when a new version was published."""
        from draft_align.monitor.records import paired_gate

        sc = self.recipe.sidecar
        if not self.publish_due(force):
            return False
        self._last_publish = time.monotonic()
        holdout = self.buffer.holdout()
        if not holdout:
            return False
        cand = self._candidate()
        if not all(torch.isfinite(p).all() for p in cand.parameters()):
            self.state.gate_rejections += 1
            log.error("candidate draft has non-finite weights: not published")
            return False
        temp = sc.eval_temperature
        c = self._estimate(cand, holdout, sc.eval_mode, temp)
        b = self._estimate(self.published, holdout, sc.eval_mode, temp)
        ok, diff, stderr = paired_gate(c, b, sc.gate_tolerance)
        if not ok:
            self.state.gate_rejections += 1
            log.info("gate: candidate %.4f vs published %.4f (diff %.4f ± %.4f): not published",
                     c["acceptance_length_est"], b["acceptance_length_est"], diff, stderr)
            return False
        policy_version = max(tr.policy_version for tr in holdout)
        self._publish(c, b, diff, stderr, policy_version)
        return True

    def _publish(self, cand: dict, base: dict, diff: float, stderr: float, policy_version: int) -> None:
        from draft_align.wire.messages import DraftPublished

        metrics = {
            "gate_candidate": cand["acceptance_length_est"],
            "gate_published": base["acceptance_length_est"],
            "gate_diff": diff,
            "gate_stderr": stderr,
            "train_steps": self.state.train_steps,
            "trained_tokens": self.state.trained_tokens,
        }
        cand_draft = self._candidate()
        sc = self.recipe.sidecar
        delta_base = Path(self.state.lora_base_dir or "") if sc.adapt == "lora" and sc.lora.publish_delta else None
        pub = publish_version(
            self.run_dir, cand_draft, target_config=self.target_config, target_name=self.target_name,
            tokenizer_fingerprint=self.tok_fp, metrics=metrics, policy_version=policy_version,
            extra_manifest={"trained_from": str(self.frozen_manifest.get("draft_version", 0)),
                            "run": self.recipe.run},
            at_least=self.state.published_version + 1, delta_base=delta_base, strict_delta=False,
        )  # fmt: skip
        v = pub.version
        self.published = self._copy(cand_draft)
        self.published.eval()
        self.state.published_version = v
        self.state.published_policy_version = policy_version
        self._steps_since_publish = 0
        self.publisher.publish(DraftPublished(
            run_id=self.recipe.run, draft_version=v, policy_version=policy_version, path=str(pub.path),
            sha256=pub.weights_sha256,
            metrics={k: float(x) for k, x in metrics.items()},
        ))
        with open(self.dir / PUBLISH_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), "draft_version": v, "policy_version": policy_version,
                                **metrics}) + "\n")
        log.info("published draft v%04d (policy v%d): gate %.4f vs %.4f", v, policy_version,
                 cand["acceptance_length_est"], base["acceptance_length_est"])
        self._export(self._sidecar_metrics())
        self.checkpoint()  # the published version and the trainer state move together

    def checkpoint(self) -> None:
        if not self.is_lead:
            return  # rank 0's checkpoint is every rank's (DDP: the same weights; fsdp2: gathered by sync_full)
        assert not self._sharded or self._full is not None, "sync_full() before checkpointing"
        self.trainer.save(self.dir / TRAINER_DIR, self._full if self._sharded else None)
        self.state.rejected = dict(self.rejected)
        tmp = self.dir / f".{STATE_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(asdict(self.state)))
        os.replace(tmp, self.dir / STATE_FILE)
        self._last_ckpt = time.monotonic()

    # ------------------------------------------------------------------ the loop
    def run(self, max_seconds: float | None = None) -> SidecarState:
        sc = self.recipe.sidecar
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        log.info("sidecar %s listening; draft v%d; aux %s", self.recipe.run, self.state.published_version,
                 self.aux_ids)
        # ppid: the launcher's pid when torchrun started this rank
        ready = {"pid": os.getpid(), "ppid": os.getppid(), "time": time.time(),
                 "draft_version": self.state.published_version, "tap_endpoint": self.receiver.endpoint}
        tmp = self.dir / f".{READY_FILE}.tmp-{os.getpid()}"
        if self.is_lead:
            tmp.write_text(json.dumps(ready))
            os.replace(tmp, self.dir / READY_FILE)
        ended = False  # whether the loop ended normally (every rank leaves it at the same step)
        try:
            if self.ranks is not None:  # torchrun: the ranks agree on every step (train/distributed.py)
                ranked_loop(self, max_seconds)
                self.sync_full()  # for the final checkpoint below
                ended = True
                return self.state
            while not self._stop:
                trained = self._train_one()
                self._drain(budget_s=0.05, timeout_ms=0 if trained else 200)
                self.maybe_publish()
                if time.monotonic() - self._last_ckpt >= sc.checkpoint_every_s:
                    self.checkpoint()
                if self.state.done and self.exit_when_done:
                    self.maybe_publish(force=True)
                    break
                if max_seconds is not None and time.monotonic() - self._t0 >= max_seconds:
                    break
        finally:
            if ended or not self._sharded:  # a failed rank cannot take part in gathering the shards
                self.checkpoint()
            self.close()
        return self.state

    def close(self) -> None:
        self.receiver.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.prom is not None:
            self.prom.close()
        self.sink.close()


def _replace_final(batch: Any, final: torch.Tensor) -> Any:
    import dataclasses

    return dataclasses.replace(batch, final_hidden=final, final_norm="post")


def run_sidecar(recipe: CotrainRecipe, start: str | None = None, *, exit_when_done: bool = False,
                max_seconds: float | None = None) -> SidecarState:
    torch.set_num_threads(recipe.sidecar.num_threads)
    start_dir = starting_draft(recipe, start)
    # None unless torchrun started several ranks; rank 0 first restores a checkpoint a killed save left aside
    with join_ranks(recipe, start_dir, lambda: checkpoint_exists(recipe.run_dir / SIDECAR_DIR / TRAINER_DIR)) as ranks:
        sidecar = Sidecar(recipe, start_dir, exit_when_done=exit_when_done, ranks=ranks)
        return sidecar.run(max_seconds=max_seconds)

