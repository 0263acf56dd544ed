"""The sidecar's multi-rank loop (torchrun, ``sidecar.ranks: N``; docs/wire.md).

Every step boundary the ranks exchange flags and the HeadSync/StepReports each received (re-encoded in the
wire format) and apply them in rank order; a step is taken iff every rank has a batch (DDP or FSDP2,
``train/parallel.py``); rank 0 alone gates, publishes, writes monitoring rows and checkpoints, and under FSDP2
every rank first gathers the full state onto it (:meth:`~draft_align.sidecar.loop.Sidecar.sync_full`) when
rank 0 announced a publish attempt or checkpoint.
"""

from __future__ import annotations

import copy
import logging
from typing import Protocol

import torch
from torch import nn

from draft_align.sidecar.state import SidecarState
from draft_align.train.parallel import RankError, RankGroup, is_comm_error
from draft_align.train.records import Batch
from draft_align.train.trainer import DraftTrainer
from draft_align.wire.channel import Receiver
from draft_align.wire.messages import HeadSync, StepReport, decode, encode

log = logging.getLogger(__name__)

# flags each rank sends at every step boundary (RankGroup.exchange); the *_DUE ones are rank 0's decisions
HAVE_BATCH, STOP, TIME_UP, PUBLISH_DUE, CKPT_DUE = 0, 1, 2, 3, 4


class GatheredDraft:
    """FSDP2: the sharded draft's full state gathered onto rank 0, and rank 0's plain copy of the draft that it
    gates, exports and checkpoints (other ranks hold no copy)."""

    def __init__(self, draft: nn.Module, is_lead: bool) -> None:
        self.plain: nn.Module | None = copy.deepcopy(draft) if is_lead else None
        self.full: tuple[dict[str, torch.Tensor], dict] | None = None  # (draft, optimizer) of the last sync

    def sync(self, trainer: DraftTrainer) -> None:
        """Gather the trainer's full draft and optimizer state onto rank 0 (a collective: every rank calls it at
        the same step) and refresh the plain copy."""
        assert trainer.parallel is not None
        self.full = trainer.parallel.state_dicts()
        if self.plain is not None and self.full is not None:
            self.plain.load_state_dict(self.full[0], strict=True)

    def candidate(self) -> nn.Module:
        """The plain copy as of the last :meth:`sync` (rank 0)."""
        assert self.plain is not None and self.full is not None, "sync_full() before gating or exporting"
        return self.plain


class RankedSidecar(Protocol):
    """What the multi-rank loop drives (:class:`~draft_align.sidecar.loop.Sidecar`)."""

    ranks: RankGroup | None
    state: SidecarState
    exit_when_done: bool
    wire_key: bytes
    receiver: Receiver

    @property
    def stop_requested(self) -> bool: ...
    def next_batch(self) -> Batch | None: ...
    def time_up(self, max_seconds: float | None) -> bool: ...

    _shared_control: list[HeadSync | StepReport]

    def publish_due(self, force: bool = False) -> bool: ...
    def checkpoint_due(self) -> bool: ...
    def on_head(self, msg: HeadSync) -> None: ...
    def on_report(self, msg: StepReport) -> None: ...
    def train_on(self, batch: Batch) -> bool: ...
    def drain(self, budget_s: float, timeout_ms: int) -> int: ...
    def sync_full(self) -> None: ...
    def maybe_publish(self, force: bool = False) -> bool: ...
    def checkpoint(self) -> None: ...


def take_shared_control(sc: RankedSidecar) -> list[HeadSync | StepReport]:
    """The HeadSync/StepReports this rank received (``Sidecar.drain`` queues them) since the last call."""
    out, sc._shared_control = sc._shared_control, []
    return out


def on_control(sc: RankedSidecar, msg: HeadSync | StepReport) -> None:
    """A HeadSync or StepReport that one of the ranks received: every rank applies it."""
    if isinstance(msg, HeadSync):
        sc.on_head(msg)
    else:
        sc.on_report(msg)


def ranked_step(sc: RankedSidecar, max_seconds: float | None = None) -> bool:
    """One iteration of the multi-rank loop; False when the ranks agreed to stop.

    Every rank: sample a batch (if it can) → exchange flags and control messages → apply every rank's
    HeadSync/StepReport in rank order → train iff all ranks have a batch → drain its socket.  When rank 0
    announced a publish attempt or checkpoint in the exchange, every rank then syncs the full state
    (:meth:`Sidecar.sync_full`, a gather under FSDP2) and rank 0 gates/publishes and checkpoints.
    """
    group = sc.ranks
    assert group is not None
    batch = sc.next_batch()
    time_up = sc.time_up(max_seconds)
    outgoing = [encode(m, sc.wire_key) for m in take_shared_control(sc)]
    publish_due = group.is_lead and sc.publish_due()
    ckpt_due = group.is_lead and sc.checkpoint_due()
    flags, incoming = group.exchange(
        [batch is not None, sc.stop_requested, time_up, publish_due, ckpt_due], outgoing
    )
    for messages in incoming:
        for frames in messages:
            on_control(sc, decode(frames, sc.wire_key))
    if bool(flags[:, STOP].any()) or bool(flags[:, TIME_UP].any()):
        return False
    trained = False
    if bool(flags[:, HAVE_BATCH].all()):
        assert batch is not None
        try:
            trained = sc.train_on(batch)
        except RuntimeError as e:
            if isinstance(e, RankError) or not is_comm_error(e):
                raise
            raise group.failed("the gradient all-reduce", e) from e
    sc.drain(budget_s=0.05, timeout_ms=0 if trained else 200)
    publish_due, ckpt_due = bool(flags[0, PUBLISH_DUE]), bool(flags[0, CKPT_DUE])  # rank 0's decisions
    if publish_due or ckpt_due:
        sc.sync_full()
        if group.is_lead:
            published = publish_due and sc.maybe_publish(force=True)  # a publish checkpoints too
            if ckpt_due and not published:
                sc.checkpoint()
    if sc.state.done and sc.exit_when_done:  # the final StepReport reached every rank in the same exchange
        sc.sync_full()
        if group.is_lead:
            sc.maybe_publish(force=True)
        return False
    return True


def ranked_loop(sc: RankedSidecar, max_seconds: float | None = None) -> None:
    """Run :func:`ranked_step` until the ranks agree to stop (stop requested, time up, or done)."""
    group = sc.ranks
    assert group is not None
    log.info("sidecar rank %d/%d pulling from %s", group.rank, group.world_size, sc.receiver.endpoint)
    while ranked_step(sc, max_seconds):
        pass
