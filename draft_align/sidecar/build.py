"""The sidecar's parts built from its recipe: what it keeps of the target, the drafts it starts from, the trainer and its settings, the
ingest in front of the replay buffer, the sockets, the sinks.  Plain functions, each taking the recipe sections it
reads (``target``, ``sidecar.train``, ``sidecar.buffer``, ``wire``, ...) and the run's own values (its folder, name
and seed); :class:`~draft_align.sidecar.loop.Sidecar` calls them in its fixed setup order and holds what they
return."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draft_align.config import CotrainRecipe, recipe_to_dict, step_decay
from draft_align.config.sections import (
    SidecarBufferConfig,
    SidecarConfig,
    SidecarRecordingConfig,
    SidecarTrainConfig,
    SidecarTriggerConfig,
    TapConfig,
    TargetConfig,
    WireConfig,
)
from draft_align.conventions import float_dtype
from draft_align.heads.draft_head import DraftHead
from draft_align.monitor.sinks import METRICS_FILE, JsonlSink, PromSink, Sinks, open_sinks
from draft_align.publish import load_draft
from draft_align.publish.compat import check_compatible, tokenizer_fingerprint
from draft_align.sidecar.gate import Gate, plain_copy
from draft_align.sidecar.ingest import Ingest
from draft_align.sidecar.layout import MONITOR_FILE, PORT_FILE, SIDECAR_DIR
from draft_align.sidecar.resume import resume_state, set_aside, start_published
from draft_align.sidecar.state import Rates, SidecarState
from draft_align.sidecar.trigger import DriftTrigger
from draft_align.train.objective import LossSettings
from draft_align.train.replay import ReplayBuffer
from draft_align.train.trainer import DraftTrainer, OptimSettings
from draft_align.wire.recording import WireRecorder


@dataclass(frozen=True)
class TargetSide:
    """What the sidecar keeps of the target model: its config, its name, its tokenizer's fingerprint and its
    frozen input embedding (the model itself is dropped once these are taken)."""

    config: Any  # transformers PretrainedConfig
    name: str
    tokenizer_fingerprint: str
    embed: nn.Module


def load_target_side(target: TargetConfig, device: torch.device) -> TargetSide:
    """Load the ``target`` on the CPU and keep :class:`TargetSide` of it (the embedding on ``device``)."""
    from draft_align import assets
    from draft_align.hf.parts import frozen_embedding

    model, tok = assets.load_target(target.model, float_dtype(target.dtype), "cpu")
    return TargetSide(
        model.config, target.model, tokenizer_fingerprint(tok), frozen_embedding(model).to(device)
    )


@dataclass(frozen=True)
class StartingDrafts:
    """The drafts a sidecar starts from: the frozen starting draft (checked against the target) and its manifest,
    the state a restart resumes (``resumed``: whether there was one to trust), the published draft the gate
    compares against and the version folder it came from (None: the starting draft)."""

    frozen: DraftHead
    frozen_manifest: dict[str, Any]
    state: SidecarState
    resumed: bool
    published: DraftHead
    latest: Path | None


def load_starting_drafts(
    run_dir: Path, start_draft: Path, target: TargetSide, device: torch.device
) -> StartingDrafts:
    """Load the starting draft and the newest trusted version published in ``run_dir`` (``sidecar/resume.py``), in
    eval mode."""
    frozen, manifest = load_draft(start_draft, device=device)
    frozen.eval()
    check_compatible(manifest, target.config, target.tokenizer_fingerprint)
    state, resumed = resume_state(run_dir / SIDECAR_DIR)
    published, latest = start_published(run_dir, run_dir / SIDECAR_DIR, state, frozen, device)
    published.eval()
    return StartingDrafts(frozen, manifest, state, resumed, published, latest)


def build_gate(
    sidecar: SidecarConfig,
    start: StartingDrafts,
    target: TargetSide,
    start_draft: Path,
    device: torch.device,
    *,
    run_dir: Path,
    run_id: str,
) -> Gate:
    """The publish gate of the ``sidecar`` section, comparing candidates against the published draft; its PUB
    socket is set by :func:`open_wire`.  The starting draft's folder is never deleted by retention."""
    return Gate(
        sidecar,
        start.state,
        start.published,
        run_dir=run_dir,
        run_id=run_id,
        device=device,
        target_config=target.config,
        target_name=target.name,
        tokenizer_fingerprint=target.tokenizer_fingerprint,
        frozen_manifest=start.frozen_manifest,
        publisher=None,
        protect=(start_draft,),
    )


def trainable_draft(
    train: SidecarTrainConfig, published: DraftHead, device: torch.device, *, seed: int
) -> DraftHead:
    """The draft to train: a plain copy of the published one (``sidecar.train.adapt: lora``: with adapters over
    it, seeded by the run's ``seed``, which have their own optimizer settings)."""
    draft = plain_copy(published, device)
    if train.adapt == "lora":
        from draft_align.heads.lora import apply_lora, lora_settings

        apply_lora(draft, lora_settings(train.lora), seed=seed)
    return draft


def build_trainer(
    train: SidecarTrainConfig, draft: DraftHead, embed: nn.Module, rows: torch.Tensor
) -> DraftTrainer:
    """The trainer of ``draft`` with the ``sidecar.train`` section's objective and optimizer (``adapt: lora``: the
    LoRA section's learning rate, weight decay and warmup); the schedule never ends (online training)."""
    objective = train.objective
    adapters = train.lora if train.adapt == "lora" else None
    optim = OptimSettings.from_section(
        objective, total_steps=10**9, adapters=adapters, anchor_decay=train.anchor_decay
    )
    loss = LossSettings.from_section(
        objective, step_decay(objective.step_decay, draft.kind), train_lm_head=True
    )
    return DraftTrainer(draft, embed, rows, optim, loss, max_seq_tokens=train.max_seq_tokens)


def build_trigger(trigger: SidecarTriggerConfig) -> DriftTrigger:
    """When to train (``sidecar.trigger.when``: always, or drift with its tolerance, head threshold, window)."""
    return DriftTrigger(
        trigger.when.value,
        tolerance=trigger.drift_tolerance,
        head_threshold=trigger.drift_head_threshold,
        window=trigger.drift_window,
        min_gain=trigger.drift_min_gain,
    )


def build_ingest(
    sc: SidecarBufferConfig,
    tap: TapConfig,
    state: SidecarState,
    rates: Rates,
    frozen: DraftHead,
    target_config: Any,
    rank: int | None,
    is_lead: bool,
    *,
    seed: int,
) -> Ingest:
    """The replay buffer of ``sc`` (``sidecar.buffer``; only the lead rank, which gates, holds records
    out; each rank samples with its own seed from the run's ``seed``) and the ingest in front of it, checking
    records against the frozen draft and the target; ``tap``: what a step sends at most."""
    buffer = ReplayBuffer(
        sc.tokens,
        sc.recency_half_life,
        sc.holdout_records if is_lead else 0,
        seed + (rank if rank is not None else 0),
        holdout_every=sc.holdout_every,
        fresh_first=sc.fresh_first,
    )
    # records of steps whose report has not come are held at most this many tokens (docs/sizing.md)
    held = max(sc.tokens // 4, 2 * tap.tokens_per_step)
    return Ingest(
        buffer,
        state,
        rates,
        aux_ids=tuple(frozen.cfg.aux_layer_ids),
        hidden=int(target_config.hidden_size),
        vocab=int(target_config.vocab_size),
        draft_to_target=frozen.draft_to_target,
        max_held_tokens=held,
    )


def open_wire(
    wire: WireConfig, run_dir: Path, *, rank: int | None, is_lead: bool, guard_file: Path | None = None
) -> tuple[bytes, Any, Any | None]:
    """``(key, receiver, publisher)`` of the ``wire`` section: the HMAC key (created in the run folder ``run_dir``
    when none is configured), the PULL socket (rank r: its own endpoint) and, on the lead rank, the DraftPublished
    PUB socket (else None).  The receiver's sequence guard continues the one saved in ``guard_file`` (a file that
    does not verify is set aside, and the guard starts empty)."""
    from draft_align.wire import channel
    from draft_align.wire.sequence_guard import load_guard

    key = channel.resolve_key(wire.key_file, run_dir, create=True)
    guard = None
    if guard_file is not None:
        try:
            guard = load_guard(guard_file, key)
        except ValueError as e:
            set_aside(
                guard_file,
                e,
                "the sequence guard starts empty (messages captured before now are accepted once)",
            )
    tap_ep = channel.tap_endpoint(run_dir, wire.endpoint)
    if rank is not None:
        tap_ep = channel.rank_endpoint(tap_ep, rank)
    receiver = channel.Receiver(
        tap_ep,
        key,
        max_bytes=wire.max_message_mb << 20,
        max_tokens=wire.max_tokens,
        allow_remote=wire.allow_remote,
        guard=guard,
    )
    publisher = None
    if is_lead:
        note_ep = channel.notify_endpoint(run_dir, wire.notify_endpoint)
        try:
            publisher = channel.Publisher(note_ep, key, allow_remote=wire.allow_remote)
        except BaseException:
            receiver.close()
            raise
    return key, receiver, publisher


# bytes a checkpoint and a publish may need per draft parameter: fp32 weights and two AdamW moments written
# beside the previous checkpoint (2 · 12), a bf16 published copy and its temp folder (2 · 2), rounded up
RESERVE_BYTES_PER_PARAM = 32


def open_recorder(rc: SidecarRecordingConfig, path: Path, draft: nn.Module) -> WireRecorder:
    """``sidecar.recording``'s recorder at ``path``: capped at ``max_mb``, and stopping before the free space
    falls under max(``reserve_mb``, RESERVE_BYTES_PER_PARAM · the draft's parameters)."""
    params = sum(p.numel() for p in draft.parameters())
    reserve = max(rc.reserve_mb << 20, RESERVE_BYTES_PER_PARAM * params)
    return WireRecorder(path, max_file_bytes=rc.max_mb << 20, reserve_bytes=reserve)


def open_sidecar_sinks(recipe: CotrainRecipe, sidecar_dir: Path, *, rank: int | None, is_lead: bool) -> Sinks:
    """Lead rank: ``monitor.jsonl``, ``metrics.jsonl``, wandb, Prometheus (port in ``prometheus.port``); the
    other ranks: their training metrics in ``<run>/sidecar/rank<r>/metrics.jsonl`` only."""
    if not is_lead:
        return Sinks(JsonlSink(sidecar_dir / f"rank{rank}" / METRICS_FILE))
    prom = None
    if recipe.sidecar.monitor.prometheus_port is not None:
        prom = PromSink(port=recipe.sidecar.monitor.prometheus_port)
        prom.write_port_file(sidecar_dir / PORT_FILE)
    return open_sinks(
        sidecar_dir,
        recipe.logging,
        f"{recipe.run}-sidecar",
        recipe_to_dict(recipe),
        monitor=sidecar_dir / MONITOR_FILE,
        monitor_max_bytes=recipe.sidecar.monitor.max_log_mb << 20,
        prom=prom,
    )
