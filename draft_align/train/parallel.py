"""Training one draft on several ranks (torchrun): a process group, DDP or FSDP2 optimizer steps.

:class:`RankGroup` is the process group plus the small CPU exchanges between steps; :func:`attach` makes a
:class:`~draft_align.train.trainer.DraftTrainer` step through :class:`DataParallelStep` (DDP: replicated draft,
gradients all-reduced) or :class:`ShardedStep` (FSDP2: parameters and AdamW moments sharded, gradients
reduce-scattered, full state gathered onto rank 0 on request).  Every collective raises :class:`RankError`
when another rank died or timed out.  The multi-rank sidecar loop that drives them is
:mod:`draft_align.sidecar.ranked` (docs/wire.md, "Multi-rank sidecar").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from draft_align.train.losses import StepStats
    from draft_align.train.records import Batch
    from draft_align.train.trainer import DraftTrainer

log = logging.getLogger(__name__)

PARALLEL_MODES = ("ddp", "fsdp2")


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
        # a launcher that formed the default group itself (Ray Train's TorchTrainer) keeps owning it
        self.adopted = dist.is_initialized()
        if self.adopted and (dist.get_rank(), dist.get_world_size()) != (info.rank, info.world_size):
            raise RankError(
                f"rank {info.rank}/{info.world_size}: the process group already formed here is rank "
                f"{dist.get_rank()}/{dist.get_world_size()} (RANK / WORLD_SIZE disagree with the launcher)"
            )
        try:
            if not self.adopted:
                dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timeout)
            default_gloo = dist.get_backend() == "gloo"
            self.cpu_group = None if default_gloo else dist.new_group(backend="gloo", timeout=timeout)
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

    def failed(self, what: str, e: BaseException) -> RankError:
        """The RankError that a failed collective ``what`` (cause ``e``) raises on this rank."""
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
            raise self.failed(what, e) from e
        return [bytes(b[: int(s)].numpy()) for b, s in zip(bufs, sizes, strict=True)]

    def check_same(self, config: dict[str, Any], what: str) -> None:
        """Raise RankError on every rank unless all ranks pass the same ``config`` (flat, JSON-able); the
        error names the hash of each rank's config and the first keys that differ."""
        text = json.dumps(config, sort_keys=True, default=str).encode()
        configs = [json.loads(b) for b in self.all_gather_bytes(text, f"comparing {what}")]
        digests = [config_digest(c) for c in configs]
        if len(set(digests)) == 1:
            return
        keys = sorted(
            {k for c in configs for k in c if len({json.dumps(x.get(k), default=str) for x in configs}) > 1}
        )
        shown = "; ".join(
            f"{k}: " + ", ".join(f"rank {r} {c.get(k, '<unset>')!r}" for r, c in enumerate(configs))
            for k in keys[:5]
        )
        raise RankError(
            f"the sidecar ranks disagree on {what} (sha256 "
            + ", ".join(f"rank {r} {d[:12]}" for r, d in enumerate(digests))
            + f"): {shown}{' …' if len(keys) > 5 else ''}. Start every rank with the same recipe file, overrides "
            f"and --draft"
        )

    def exchange(
        self, flags: list[int], messages: list[list[bytes]]
    ) -> tuple[torch.Tensor, list[list[list[bytes]]]]:
        """One step boundary: every rank's flags [world, len(flags)] (int64) and its multipart messages (rank
        order).  Every rank passes the same number of flags."""
        fmt = f"<{len(flags)}q"
        blobs = self.all_gather_bytes(
            struct.pack(fmt, *(int(f) for f in flags)) + _pack(messages), "the step exchange"
        )
        width = struct.calcsize(fmt)
        table = torch.tensor([struct.unpack_from(fmt, b) for b in blobs], dtype=torch.int64)
        return table, [_unpack(b[width:]) for b in blobs]

    def all_true(self, ok: bool, what: str) -> bool:
        """Whether ``ok`` holds on every rank."""
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        except RuntimeError as e:
            raise self.failed(what, e) from e
        return bool(t.item())

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and not self.adopted:
            dist.destroy_process_group()


@contextmanager
def join_ranks(
    *,
    ranks: int,
    device: str,
    timeout_s: float,
    config: dict[str, Any],
    lead_first: Callable[[], object] | None = None,
) -> Iterator[RankGroup | None]:
    """The sidecar's rank group under torchrun (None for a single process), checked for a consistent world:
    ``ranks`` (``sidecar.ranks``) equals WORLD_SIZE and every rank passes the same ``config`` (flat, JSON-able:
    the resolved recipe and the starting draft).  ``device``: the recipe's (``cuda`` → nccl, else gloo);
    ``timeout_s``: every collective's.  ``lead_first`` runs on rank 0 before the others go on (e.g.
    repairing a checkpoint they will all read)."""
    info = rank_info_from_env()
    want = ranks
    if info.world_size == 1:
        if want != 1:
            raise RankError(
                f"sidecar.ranks is {want} but this sidecar runs alone (WORLD_SIZE unset or 1): start it with "
                f"torchrun --nproc-per-node {want} -m draft_align sidecar …, or set sidecar.ranks=1"
            )
        yield None
        return
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    group = RankGroup(info, backend=backend, timeout_s=timeout_s)
    try:
        if info.is_lead and lead_first is not None:
            lead_first()  # the others wait for it in check_same below
        group.check_same(config, "the recipe")
        if want != info.world_size:
            raise RankError(
                f"sidecar.ranks is {want} but torchrun started {info.world_size} ranks: the policy's tap connects "
                f"to sidecar.ranks endpoints, so both must agree"
            )
        log.info("sidecar rank %d of %d joined (%s)", info.rank, info.world_size, backend)
        yield group
    finally:
        group.close()


def rank_device(device: str, info: RankInfo) -> torch.device:
    """This rank's device: ``cuda`` means its local GPU; anything else is used as given."""
    dev = torch.device(device)
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
        self.trainer = trainer
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

    def state_dicts(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's (draft, optimizer) state dicts: every rank holds the full, identical state."""
        return self.trainer.draft.state_dict(), self.trainer.optimizer.state_dict()

    def load_state_dicts(self, draft: dict[str, torch.Tensor], optimizer: dict) -> None:
        self.trainer.draft.load_state_dict(draft, strict=True)
        self.trainer.optimizer.load_state_dict(optimizer)


# ---------------------------------------------------------------------------------------------- FSDP2 step
def decoder_layers(draft: nn.Module) -> list[nn.Module]:
    """The draft's decoder layer(s), each one FSDP2 unit: EAGLE-3's ``midlayer``, MTP's ``layers``."""
    if isinstance(getattr(draft, "layers", None), nn.ModuleList):
        return list(draft.layers)
    return [draft.midlayer]


class _ShardedLoss(nn.Module):
    """The trainer's loss as the FSDP2 root's forward (the root all-gathers its own parameters in its
    pre-forward hook and reduce-scatters their gradients after backward).

    The decoder layers are separate FSDP2 units, but the TTT unroll calls their sub-modules and helper methods
    (``attn_input``, ``self_attn.q`` …), never their ``forward``, so no hook would all-gather them: they are
    unsharded explicitly here.  Their gradients are reduce-scattered (and they are resharded) by the root's
    end-of-backward callback, which runs every unit's post-backward."""

    def __init__(self, trainer: DraftTrainer, layers: list[nn.Module]) -> None:
        super().__init__()
        self.draft = trainer.draft
        self._trainer = trainer
        self._layers = layers  # a plain list: the layers are registered once, under ``draft``

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        for layer in self._layers:
            layer.unshard()
        loss, stats = self._trainer.loss(batch)
        return loss, stats.loss, stats.correct, stats.count


class ShardedStep:
    """The trainer's ``parallel`` under ``sidecar.parallel: fsdp2``: the draft's parameters (and so AdamW's
    moments) sharded over the ranks with FSDP2 ``fully_shard``; gradients averaged over ranks by
    reduce-scatter; full state gathered onto rank 0 when the ranks agree to (gate, publish, checkpoint).

    Every rank must start from the same weights (they do: the same starting draft and seed); each keeps its
    own shard of them.  Frozen parameters stay sharded (LoRA base weights) except a shared ``lm_head``
    (MTP), which HeadSync overwrites in place on every rank and so stays a plain replicated tensor."""

    def __init__(self, trainer: DraftTrainer, group: RankGroup) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.group = group
        self.trainer = trainer
        draft = trainer.draft
        device = next(draft.parameters()).device
        mesh = init_device_mesh(device.type, (group.world_size,))
        ignored = {draft.lm_head.weight} if draft.shares_target_head else None
        self.layers = decoder_layers(draft)
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)
        self.module = _ShardedLoss(trainer, self.layers)
        fully_shard(self.module, mesh=mesh, ignored_params=ignored)
        trainer.build_optimizer()  # over the sharded parameters fully_shard put in place of the plain ones
        names = {id(p): n for n, p in self.module.named_parameters()}
        # optimizer index (torch's state_dict numbering) → fully qualified name (distributed state dicts)
        self._fqns = [names[id(p)] for g in trainer.optimizer.param_groups for p in g["params"]]

    def loss(self, batch: Batch) -> tuple[torch.Tensor, StepStats]:
        from draft_align.train.losses import StepStats

        loss, ce, correct, count = self.module(batch)
        return loss, StepStats(loss=ce, correct=correct, count=count)

    def all_finite(self, loss: torch.Tensor) -> bool:
        """The rank-wide finiteness vote; a skipped step reshards what its forward all-gathered."""
        ok = self.group.all_true(bool(torch.isfinite(loss.detach()).all()), "the finite-loss vote")
        if not ok:
            for m in (*self.layers, self.module):
                m.reshard()
        return ok

    def state_dicts(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """Gather the full draft and optimizer state onto rank 0, on CPU (a collective: every rank calls it at
        the same step); None on the other ranks."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        try:
            model = get_model_state_dict(self.module, options=opts)
            optim = get_optimizer_state_dict(self.module, self.trainer.optimizer, options=opts)
        except RuntimeError as e:
            if not is_comm_error(e):
                raise
            raise self.group.failed("gathering the full state", e) from e
        if not self.group.is_lead:
            return None
        index = {n: i for i, n in enumerate(self._fqns)}
        draft = {k.removeprefix("draft."): v for k, v in model.items()}
        state = {index[n]: st for n, st in optim["state"].items()}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in optim["param_groups"]]
        return draft, {"state": state, "param_groups": groups}

    def load_state_dicts(self, draft: dict[str, torch.Tensor], optimizer: dict) -> None:
        """Every rank passes the same full state; each keeps its shard."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, strict=True)
        # set_*_state_dict replace the values of the dicts they are given by shards: pass fresh ones
        set_model_state_dict(self.module, {f"draft.{k}": v for k, v in draft.items()}, options=opts)
        if len(optimizer["state"]) and max(optimizer["state"]) >= len(self._fqns):
            raise ValueError(
                f"optimizer state for {max(optimizer['state']) + 1} parameters, this draft trains "
                f"{len(self._fqns)}"
            )
        optim = {
            "state": {self._fqns[int(i)]: dict(st) for i, st in optimizer["state"].items()},
            "param_groups": [
                {**g, "params": [self._fqns[int(i)] for i in g["params"]]} for g in optimizer["param_groups"]
            ],
        }
        set_optimizer_state_dict(self.module, self.trainer.optimizer, optim, options=opts)


def attach(trainer: DraftTrainer, group: RankGroup, parallel: str) -> None:
    """Make ``trainer`` step together with the other ranks (call before a checkpoint is loaded: under FSDP2
    the checkpoint goes into the shards, under DDP every rank loads the same one)."""
    if parallel not in PARALLEL_MODES:
        raise RankError(f"sidecar.parallel {parallel!r}: expected one of {PARALLEL_MODES}")
    trainer.parallel = DataParallelStep(trainer, group) if parallel == "ddp" else ShardedStep(trainer, group)


def is_comm_error(e: RuntimeError) -> bool:
    """Whether ``e`` came from a collective (DDP raises the backend's error as a plain RuntimeError)."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or any(
        s in text for s in ("gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out")
    )
