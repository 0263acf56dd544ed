"""A multi-rank sidecar under torchrun: one process group, DDP gradients, ranks that agree on every step.

``torchrun --nproc-per-node N -m draft_align sidecar RECIPE`` (with ``sidecar.ranks: N``) starts N sidecars:

- **Wire.**  Rank r binds its own PULL endpoint (:func:`draft_align.wire.channel.rank_endpoint`: rank 0 keeps
  the single-process endpoint, rank r > 0 ``tap.<r>``); the policy's TapSender connects its one PUSH socket
  to all N, so ZeroMQ spreads TapBatches round-robin over the ranks that are up (docs/wire.md).  A
  ``HeadSync`` or ``StepReport`` reaches only one rank that way: each rank shares the ones it received with
  the others at the next step boundary (:meth:`RankGroup.exchange`, over a gloo group, re-encoded in the
  wire format, no pickle), and every rank applies them in the same order (rank, then arrival).
- **Steps.**  Every loop iteration the ranks exchange "I have a batch" / "stop" flags; an optimizer step is
  taken iff every rank has a batch, so all ranks take the same number of steps and none waits in a
  gradient all-reduce for a rank without data.  The loss goes through
  :class:`torch.nn.parallel.DistributedDataParallel`, which averages gradients over ranks: the step
  minimises the mean over ranks of each rank's per-batch TTT loss (equal to the one-process loss on the
  union of the batches when the ranks' batches hold equal numbers of target positions per TTT step).
  A non-finite loss on any rank skips the step on all of them (:meth:`DataParallelStep.all_finite`).
- **Roles.**  Rank 0 alone gates, publishes, writes monitoring rows and checkpoints; the others train.  A
  restarted job resumes every rank from rank 0's trainer checkpoint.
- **Failures.**  Collectives time out after ``sidecar.collective_timeout_s``; a rank that died (``kill -9``)
  makes the others' next collective fail at once (gloo sees the closed connection).  The survivors raise
  :class:`RankError` naming the cause and exit non-zero, and torchrun (``--max-restarts``) restarts the job.
- **Bad world.**  Ranks whose recipe (or starting draft) differs, or a world size other than
  ``sidecar.ranks``, stop with :class:`RankError` before anything is bound or trained.

``sidecar.parallel: fsdp2`` is refused by the recipe schema for now (see :data:`PARALLEL_MODES`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from draft_align.config import CotrainRecipe
    from draft_align.sidecar import Sidecar
    from draft_align.train.batch import Batch
    from draft_align.train.losses import StepStats
    from draft_align.train.trainer import DraftTrainer

log = logging.getLogger(__name__)

PARALLEL_MODES = ("ddp",)  # fully_shard (FSDP2) needs rank-0 gathers at gate/publish/checkpoint: not yet
# flags each rank sends at every step boundary (see RankGroup.exchange)
HAVE_BATCH, STOP, TIME_UP = 0, 1, 2
NUM_FLAGS = 3


class RankError(RuntimeError):
    """The sidecar's ranks cannot work together: another rank died or timed out, or the world is misconfigured."""


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the torchrun world (from RANK / WORLD_SIZE / LOCAL_RANK)."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_lead(self) -> bool:
        return self.rank == 0


def rank_info_from_env(env: dict[str, str] | None = None) -> RankInfo:
    """This process's rank; a plain process (no torchrun) is rank 0 of 1."""
    env = dict(os.environ) if env is None else env
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise RankError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers: {e}") from e
    if world < 1 or not 0 <= rank < world:
        raise RankError(f"RANK {rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE {world})")
    return RankInfo(rank, world, local)


def world_config(recipe: CotrainRecipe, start_draft: Path) -> dict[str, Any]:
    """What every rank must agree on, flattened to dotted keys: the resolved recipe and the starting draft."""
    from draft_align.config import recipe_to_dict

    flat: dict[str, Any] = {"start_draft": str(Path(start_draft).resolve())}

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = x

    walk("", recipe_to_dict(recipe))
    return flat


def config_digest(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- the group
def _pack(messages: list[list[bytes]]) -> bytes:
    """Multipart messages → one blob: per message ``u32 n_frames``, then per frame ``u64 len`` and its bytes."""
    out = bytearray()
    for frames in messages:
        out += struct.pack("<I", len(frames))
        for f in frames:
            b = bytes(f)
            out += struct.pack("<Q", len(b)) + b
    return bytes(out)


def _unpack(blob: bytes) -> list[list[bytes]]:
    out, i = [], 0
    while i < len(blob):
        (n,) = struct.unpack_from("<I", blob, i)
        i += 4
        frames = []
        for _ in range(n):
            (size,) = struct.unpack_from("<Q", blob, i)
            i += 8
            frames.append(blob[i : i + size])
            i += size
        out.append(frames)
    return out


class RankGroup:
    """This sidecar's process group: the default group (gloo on CPU, nccl with CUDA) for DDP, plus a gloo
    group for the small CPU exchanges between steps.  Every collective here raises :class:`RankError`
    (naming this rank) when another rank died or did not answer within ``timeout_s``."""

    def __init__(self, info: RankInfo, *, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.info = info
        self.timeout_s = float(timeout_s)
        timeout = timedelta(seconds=self.timeout_s)
        try:
            dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timeout)
            self.cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        except Exception as e:
            raise RankError(f"rank {info.rank}/{info.world_size}: cannot join the process group ({e})") from e

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_lead(self) -> bool:
        return self.info.is_lead

    def _failed(self, what: str, e: BaseException) -> RankError:
        return RankError(
            f"rank {self.rank}/{self.world_size}: {what} failed: another sidecar rank died or did not answer "
            f"within {self.timeout_s:.0f} s (sidecar.collective_timeout_s); stopping so that torchrun can "
            f"restart the job from rank 0's last checkpoint. Cause: {str(e).splitlines()[0] if str(e) else e!r}"
        )

    def all_gather_bytes(self, data: bytes, what: str) -> list[bytes]:
        """Every rank's ``data`` (rank order), over the CPU group."""
        import torch.distributed as dist

        try:
            n = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes, n, group=self.cpu_group)
            longest = max(int(s) for s in sizes)
            if longest == 0:
                return [b""] * self.world_size
            buf = torch.zeros(longest, dtype=torch.uint8)
            if data:
                buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(bufs, buf, group=self.cpu_group)
        except RuntimeError as e:
            raise self._failed(what, e) from e
        return [bytes(b[: int(s)].numpy()) for b, s in zip(bufs, sizes, strict=True)]

    def check_same(self, config: dict[str, Any], what: str) -> None:
        """Raise RankError on every rank unless all ranks pass the same ``config`` (flat, JSON-able); the
        error names the hash of each rank's config and the first keys that differ."""
        text = json.dumps(config, sort_keys=True, default=str).encode()
        configs = [json.loads(b) for b in self.all_gather_bytes(text, f"comparing {what}")]
        digests = [config_digest(c) for c in configs]
        if len(set(digests)) == 1:
            return
        keys = sorted({k for c in configs for k in c if len({json.dumps(x.get(k), default=str) for x in configs}) > 1})
        shown = "; ".join(f"{k}: " + ", ".join(f"rank {r} {c.get(k, '<unset>')!r}" for r, c in enumerate(configs))
                          for k in keys[:5])
        raise RankError(
            f"the sidecar ranks disagree on {what} (sha256 " + ", ".join(f"rank {r} {d[:12]}" for r, d in
                                                                     enumerate(digests))
            + f"): {shown}{' …' if len(keys) > 5 else ''}. Start every rank with the same recipe file, overrides "
            f"and --draft"
        )

    def exchange(self, flags: list[int], messages: list[list[bytes]]) -> tuple[torch.Tensor, list[list[list[bytes]]]]:
        """One step boundary: every rank's flags [world, NUM_FLAGS] (int64) and its messages (rank order)."""
        head = struct.pack(f"<{NUM_FLAGS}q", *(int(f) for f in flags))
        blobs = self.all_gather_bytes(head + _pack(messages), "the step exchange")
        width = struct.calcsize(f"<{NUM_FLAGS}q")
        table = torch.tensor([struct.unpack_from(f"<{NUM_FLAGS}q", b) for b in blobs], dtype=torch.int64)
        return table, [_unpack(b[width:]) for b in blobs]

    def all_true(self, ok: bool, what: str) -> bool:
        """Whether ``ok`` holds on every rank."""
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        except RuntimeError as e:
            raise self._failed(what, e) from e
        return bool(t.item())

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def join_ranks(recipe: CotrainRecipe, start_draft: Path,
               lead_first: Callable[[], object] | None = None) -> Iterator[RankGroup | None]:
    """The sidecar's rank group under torchrun (None for a single process), checked for a consistent world:
    ``sidecar.ranks`` equals WORLD_SIZE and every rank runs the same recipe and starting draft.
    ``lead_first`` runs on rank 0 before the others go on (e.g. repairing a checkpoint they will all read)."""
    info = rank_info_from_env()
    want = recipe.sidecar.ranks
    if info.world_size == 1:
        if want != 1:
            raise RankError(
                f"sidecar.ranks is {want} but this sidecar runs alone (WORLD_SIZE unset or 1): start it with "
                f"torchrun --nproc-per-node {want} -m draft_align sidecar …, or set sidecar.ranks=1"
            )
        yield None
        return
    backend = "nccl" if torch.device(recipe.device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    group = RankGroup(info, backend=backend, timeout_s=recipe.sidecar.collective_timeout_s)
    try:
        if info.is_lead and lead_first is not None:
            lead_first()  # the others wait for it in check_same below
        group.check_same(world_config(recipe, start_draft), "the recipe")
        if want != info.world_size:
            raise RankError(
                f"sidecar.ranks is {want} but torchrun started {info.world_size} ranks: the policy's tap connects "
                f"to sidecar.ranks endpoints, so both must agree"
            )
        log.info("sidecar rank %d of %d joined (%s)", info.rank, info.world_size, backend)
        yield group
    finally:
        group.close()


def rank_device(recipe: CotrainRecipe, info: RankInfo) -> torch.device:
    """``cuda`` means this rank's local GPU; anything else is used as given."""
    dev = torch.device(recipe.device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", info.local_rank)
    return dev


# ---------------------------------------------------------------------------------------------- DDP step
class _LossForward(nn.Module):
    """The trainer's loss as a module forward: DDP arms its gradient all-reduce in ``forward``, so the loss
    must be computed through it.  Only the draft is registered (its parameters are what DDP averages); the
    trainer, its frozen embedding and head rows are not parameters of this module."""

    def __init__(self, trainer: DraftTrainer) -> None:
        super().__init__()
        self.draft = trainer.draft
        self._trainer = trainer

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        loss, stats = self._trainer.loss(batch)
        return loss, stats.loss, stats.correct, stats.count


class DataParallelStep:
    """What :class:`~draft_align.train.trainer.DraftTrainer` calls under torchrun (its ``parallel``): the loss
    through DDP (gradients averaged over ranks in backward) and a rank-wide finiteness vote."""

    def __init__(self, trainer: DraftTrainer, group: RankGroup) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.group = group
        # rank 0's parameters and buffers are broadcast once here, so every rank starts from the same
        # weights; no buffer sync per forward: the draft's buffers (vocab maps) never change
        self.module = DistributedDataParallel(_LossForward(trainer), forward_sync_buffers=False)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, StepStats]:
        from draft_align.train.losses import StepStats

        loss, ce, correct, count = self.module(batch)
        return loss, StepStats(loss=ce, correct=correct, count=count)

    def all_finite(self, loss: torch.Tensor) -> bool:
        """Whether the loss is finite on every rank (a rank that skipped backward would leave the others
        waiting in DDP's all-reduce)."""
        return self.group.all_true(bool(torch.isfinite(loss.detach()).all()), "the finite-loss vote")


def attach(trainer: DraftTrainer, group: RankGroup, parallel: str) -> None:
    """Make ``trainer`` step together with the other ranks (call after any checkpoint is loaded)."""
    if parallel not in PARALLEL_MODES:
        raise RankError(f"sidecar.parallel {parallel!r}: expected one of {PARALLEL_MODES}")
    trainer.parallel = DataParallelStep(trainer, group)


# ---------------------------------------------------------------------------------------------- the loop
def ranked_step(sc: Sidecar, max_seconds: float | None = None) -> bool:
    """One iteration of the multi-rank loop; False when the ranks agreed to stop.

    Every rank: sample a batch (if it can) → exchange flags and control messages → apply every rank's
    HeadSync/StepReport in rank order → train iff all ranks have a batch → drain its socket.  Rank 0 then
    gates/publishes and checkpoints when due.
    """
    from draft_align.wire.messages import decode, encode

    group = sc.ranks
    assert group is not None
    batch = sc._next_batch()
    time_up = max_seconds is not None and time.monotonic() - sc._t0 >= max_seconds
    outgoing = [encode(m, sc.wire_key) for m in sc.shared_control]
    sc.shared_control.clear()
    flags, incoming = group.exchange([batch is not None, sc._stop, time_up], outgoing)
    for messages in incoming:
        for frames in messages:
            sc._on_control(decode(frames, sc.wire_key))
    if bool(flags[:, STOP].any()) or bool(flags[:, TIME_UP].any()):
        return False
    trained = False
    if bool(flags[:, HAVE_BATCH].all()):
        assert batch is not None
        try:
            trained = sc._train_on(batch)
        except RuntimeError as e:
            if isinstance(e, RankError) or not _is_comm_error(e):
                raise
            raise group._failed("the gradient all-reduce", e) from e
    sc._drain(budget_s=0.05, timeout_ms=0 if trained else 200)
    if group.is_lead:
        sc.maybe_publish()
        if time.monotonic() - sc._last_ckpt >= sc.recipe.sidecar.checkpoint_every_s:
            sc.checkpoint()
    if sc.state.done and sc.exit_when_done:  # the final StepReport reached every rank in the same exchange
        if group.is_lead:
            sc.maybe_publish(force=True)
        return False
    return True


def _is_comm_error(e: RuntimeError) -> bool:
    """Whether ``e`` came from a collective (DDP raises the backend's error as a plain RuntimeError)."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or any(
        s in text for s in ("gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out"))


def ranked_loop(sc: Sidecar, max_seconds: float | None = None) -> None:
    """Run :func:`ranked_step` until the ranks agree to stop (stop signal, time up, or done)."""
    group = sc.ranks
    assert group is not None
    log.info("sidecar rank %d/%d pulling from %s", group.rank, group.world_size, sc.receiver.endpoint)
    while ranked_step(sc, max_seconds):
        pass

