"""The draft trainer: one optimizer step on one batch, AdamW + warmup/cosine.

The trainer owns its optimizer, clipping and schedule; the loss is the TTT objective (train/objective.py), the
checkpoint its folder format (train/checkpoint.py).  Nothing here can reach the target's weights (the
embedding and head rows are frozen copies).
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from draft_align.heads.draft_head import DraftHead
from draft_align.train.checkpoint import Progress, read_checkpoint, save_checkpoint
from draft_align.train.losses import MAX_SEQ_TOKENS, StepStats, truncate_batch
from draft_align.train.objective import LossSettings, ttt_loss
from draft_align.train.precision import resolve_autocast
from draft_align.train.records import Batch

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient norm was NaN/Inf: the step was skipped, nothing was applied."""


class OptimSection(Protocol):
    """A recipe section that sets the optimizer and its schedule (``config.ObjectiveConfig``: a warm-start's
    ``train.objective``, the sidecar's ``sidecar.train.objective``)."""

    lr: float
    min_lr_ratio: float
    weight_decay: float
    warmup_steps: int
    grad_clip: float


class AdapterOptimSection(Protocol):
    """LoRA adapters' own optimizer settings (``config.LoraAdaptConfig``)."""

    lr: float
    weight_decay: float
    warmup_steps: int


@dataclass(frozen=True)
class OptimSettings:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    total_steps: int = 1000
    grad_clip: float = 0.5
    # decoupled pull toward the weights the optimizer was built on (L2-SP, applied like AdamW's weight decay
    # but toward those weights instead of 0): after each step θ ← θ − lr · anchor_decay · (θ − θ_start)
    anchor_decay: float = 0.0

    @classmethod
    def from_section(
        cls,
        section: OptimSection,
        *,
        total_steps: int,
        adapters: AdapterOptimSection | None = None,
        anchor_decay: float = 0.0,
    ) -> OptimSettings:
        """The optimizer an objective section asks for over ``total_steps`` (one path for the warm-start and the
        sidecar); ``adapters``: LoRA adapters' learning rate, weight decay and warm-up in place of the
        section's."""
        own = adapters if adapters is not None else section
        return cls(
            lr=own.lr,
            min_lr_ratio=section.min_lr_ratio,
            weight_decay=own.weight_decay,
            warmup_steps=own.warmup_steps,
            total_steps=total_steps,
            grad_clip=section.grad_clip,
            anchor_decay=anchor_decay,
        )


def lr_factor(s: OptimSettings, step: int, total: int) -> float:
    """Linear warmup to 1, then cosine to ``min_lr_ratio`` at ``total``."""
    if step < s.warmup_steps:
        return (step + 1) / max(1, s.warmup_steps)
    frac = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


class StepParallel(Protocol):
    """How a trainer steps together with other ranks (implemented in train/parallel.py)."""

    def loss(self, batch: Batch) -> tuple[torch.Tensor, StepStats]: ...

    def all_finite(self, loss: torch.Tensor) -> bool: ...

    def state_dicts(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The full (draft, optimizer) state dicts, the optimizer's in torch's index form; where the state is
        sharded a collective that every rank calls together, returning None on the ranks that get no copy."""
        ...

    def load_state_dicts(self, draft: dict[str, torch.Tensor], optimizer: dict) -> None:
        """Load full state dicts (as :meth:`state_dicts` returns them) on every rank (into its shards)."""
        ...


class DraftTrainer:
    """Owns the draft's optimizer and schedule; ``train_step`` is one optimizer step on one batch."""

    def __init__(
        self,
        draft: DraftHead,
        embed: nn.Module,
        rows: torch.Tensor,
        optim: OptimSettings,
        loss: LossSettings,
        max_seq_tokens: int = MAX_SEQ_TOKENS,
    ) -> None:
        if max_seq_tokens < 3:
            raise ValueError(f"max_seq_tokens must be ≥ 3 (a target needs 3 positions), got {max_seq_tokens}")
        # rows longer than this are cut to a window of it before the step (counted in progress): bounds one
        # step's memory
        self.max_seq_tokens = int(max_seq_tokens)
        self.draft = draft
        self.embed = embed.requires_grad_(False)
        self._compute_dtype: torch.dtype | None = None
        self.rows = rows
        self.optim_settings = optim
        self.loss_settings = loss
        self.autocast_bf16 = resolve_autocast(loss.autocast_bf16, self.rows.device)
        # without autocast every input meets the draft in its own dtype (taps and head rows are stored bf16)
        self._compute_dtype = None if self.autocast_bf16 else next(draft.parameters()).dtype
        self.rows = self._rows_stored  # in the compute dtype
        # an MTP head's lm_head is the target's (shared, frozen); under LoRA only the adapters train
        from draft_align.heads.lora import is_lora

        frozen_head = draft.shares_target_head or is_lora(draft)
        draft.lm_head.weight.requires_grad_(loss.train_lm_head and not frozen_head)
        self.progress = Progress(total_steps=optim.total_steps)
        self.lr_scale = 1.0  # a factor on the schedule's LR (set_lr_scale)
        self.build_optimizer()
        # under torchrun: the loss through DDP or FSDP2 and a rank-wide finiteness vote (train/parallel.py)
        self.parallel: StepParallel | None = None

    @property
    def rows(self) -> torch.Tensor:
        """The target's lm_head rows [Vd, H] the soft targets come from (replaced at each HeadSync)."""
        return self._rows_stored

    @rows.setter
    def rows(self, value: torch.Tensor) -> None:
        self._rows_stored = value.detach()
        self._rows = (
            self._rows_stored if self._compute_dtype is None else self._rows_stored.to(self._compute_dtype)
        )

    def build_optimizer(self) -> None:
        """A fresh AdamW and schedule over the draft's trainable parameters as they are now (FSDP2 replaces
        them by sharded ones, so it calls this again)."""
        s = self.optim_settings
        params = [p for p in self.draft.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=s.lr,
            betas=s.betas,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(s, step, self.progress.total_steps) * self.lr_scale
        )
        # anchor_decay: the weights as they are now (the sidecar's starting draft; after a restart the newest
        # published draft, which the sidecar builds its trainer on), one copy per parameter in param-group order
        self._anchor = (
            [p.detach().clone() for g in self.optimizer.param_groups for p in g["params"]]
            if s.anchor_decay > 0
            else []
        )

    def loss(self, batch: Batch) -> tuple[torch.Tensor, StepStats]:
        """This trainer's loss of one batch (on the trainer's device)."""
        if self._compute_dtype is None:
            return ttt_loss(self.draft, self.embed, self.rows, batch, self.loss_settings)
        dtype = self._compute_dtype
        return ttt_loss(
            self.draft,
            lambda ids: self.embed(ids).to(dtype),
            self._rows,
            batch.cast(dtype),
            self.loss_settings,
        )

    def set_total_steps(self, total: int) -> None:
        """Change the schedule's length (e.g. to end the cosine when a time budget ends).

        The next step already runs at the new schedule's LR (the scheduler alone would apply it one step late).
        """
        self.progress.total_steps = max(1, int(total))
        self._apply_lr()

    def set_lr_scale(self, scale: float) -> None:
        """Multiply the schedule's LR by ``scale`` in (0, 1] from the next step on (the sidecar's ramp by
        buffer size)."""
        if not 0 < scale <= 1:
            raise ValueError(f"lr scale must be in (0, 1], got {scale}")
        if scale != self.lr_scale:
            self.lr_scale = float(scale)
            self._apply_lr()

    def _apply_lr(self) -> None:
        factor = lr_factor(self.optim_settings, self.scheduler.last_epoch, self.progress.total_steps)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * factor * self.lr_scale

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One step.  Raises NonFiniteLossError (after zeroing grads, applying nothing) on NaN/Inf."""
        self.draft.train()
        dev = self.rows.device
        batch = self._cap(batch.to(dev))
        ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if self.autocast_bf16 else nullcontext()
        with ctx:
            loss, stats = self.loss(batch) if self.parallel is None else self.parallel.loss(batch)
        if not (torch.isfinite(loss) if self.parallel is None else self.parallel.all_finite(loss)):
            self.optimizer.zero_grad(set_to_none=True)
            self.progress.skipped_nonfinite += 1
            raise NonFiniteLossError(
                f"non-finite loss {loss.item()} at step {self.progress.step}; step skipped"
            )
        loss.backward()
        params = [p for p in self.draft.parameters() if p.requires_grad]
        # over FSDP2 shards the norm is a DTensor whose full value sums every rank's share of ‖g‖²
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.optim_settings.grad_clip)
        if hasattr(gnorm, "full_tensor"):
            gnorm = gnorm.full_tensor()
        if not torch.isfinite(gnorm):
            self.optimizer.zero_grad(set_to_none=True)
            self.progress.skipped_nonfinite += 1
            raise NonFiniteLossError(f"non-finite gradient norm at step {self.progress.step}; step skipped")
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self._anchor:
            self._pull_to_anchor()
        self.scheduler.step()
        self.progress.step += 1
        self.progress.tokens_seen += batch.num_tokens
        n = stats.count.clamp(min=1)
        self.progress.targets_seen += int(stats.count[0])
        stats = StepStats(stats.loss.cpu(), stats.correct.cpu(), stats.count.cpu())
        out = {
            "loss": float(loss.detach()),
            "grad_norm": float(gnorm),
            "lr": lr,
            "targets": float(stats.count[0]),
        }
        for j in range(stats.count.numel()):
            out[f"ce_{j}"] = float(stats.loss[j] / n[j])
            out[f"acc_{j}"] = float(stats.correct[j] / n[j])
        return out

    @torch.no_grad()
    def _pull_to_anchor(self) -> None:
        """θ ← θ − lr · anchor_decay · (θ − θ_start), each parameter at its group's learning rate."""
        anchors = iter(self._anchor)
        for group in self.optimizer.param_groups:
            step = group["lr"] * self.optim_settings.anchor_decay
            for p in group["params"]:
                p.lerp_(next(anchors), step)

    def _cap(self, batch: Batch) -> Batch:
        """The batch cut to windows of ``max_seq_tokens`` positions (losses.truncate_batch: a row whose
        first positions hold no target loses its prompt side instead), counted in progress."""
        cut = truncate_batch(batch, self.max_seq_tokens, self.loss_settings.ttt_steps)
        if cut.rows_cut:
            if not self.progress.truncated_sequences:
                log.warning(
                    "sequences longer than max_seq_tokens=%d are cut to it for training (%d targets "
                    "dropped in this batch; counted in progress.truncated_*)",
                    self.max_seq_tokens,
                    cut.targets_dropped,
                )
            self.progress.truncated_sequences += cut.rows_cut
            self.progress.truncated_targets += cut.targets_dropped
            self.progress.prompt_cut_sequences += cut.rows_shifted
        return cut.batch

    # ------------------------------------------------------------------ checkpoint (train/checkpoint.py)
    def save(self, path: Path, state: tuple[dict[str, torch.Tensor], dict] | None = None) -> None:
        """Write draft weights, optimizer moments, schedule and progress to ``path`` atomically
        (:func:`~draft_align.train.checkpoint.save_checkpoint`).

        ``state``: the (draft, optimizer) state dicts to write, when they were gathered from shards
        (:meth:`StepParallel.state_dicts`); else this process's own.
        """
        draft_sd, opt = state if state is not None else (self.draft.state_dict(), self.optimizer.state_dict())
        save_checkpoint(path, draft_sd, opt, self.scheduler.state_dict(), self.progress)

    def load(self, path: Path) -> None:
        """Restore a checkpoint written by :meth:`save` (weights, optimizer, schedule, progress, RNG).

        Raises RuntimeError naming the unreadable file, or the mismatch, when the checkpoint cannot be used.
        """
        stored = read_checkpoint(path)
        try:
            # strict: a checkpoint missing a tensor must not leave that tensor at its fresh init
            opt_sd = {"state": stored.optimizer_state, "param_groups": stored.meta["param_groups"]}
            if self.parallel is None:
                self.draft.load_state_dict(stored.draft, strict=True)
                self.optimizer.load_state_dict(opt_sd)
            else:  # FSDP2: every rank keeps its shard of the full state
                self.parallel.load_state_dicts(stored.draft, opt_sd)
            self.scheduler.load_state_dict(stored.meta["scheduler"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise RuntimeError(
                f"trainer checkpoint {path} does not fit this draft/optimizer ({e}); it was written by another "
                f"configuration: delete it to start over"
            ) from e
        torch.set_rng_state(torch.tensor(stored.meta["rng"], dtype=torch.uint8))
        self.progress = stored.progress
