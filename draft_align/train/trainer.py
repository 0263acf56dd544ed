"""The draft trainer: TTT unroll, soft targets from the target's head rows, AdamW + warmup/cosine.

The trainer owns its optimizer, clipping and schedule; nothing here can reach the target's weights
(the embedding and head rows are frozen copies).
"""

from __future__ import annotations

import json
import logging
import math
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from draft_align.conventions import LossKind, VerifyMode, check_loss, objective_mode
from draft_align.heads.eagle3 import Eagle3Draft
from draft_align.train.losses import (
    MAX_SEQ_TOKENS,
    StepStats,
    acceptance_head,
    chain_objective,
    hard_ce_head,
    scored_positions,
    scored_steps,
    soft_ce_head,
    soft_targets,
    step_objective,
    step_weights,
    truncate_batch,
)
from draft_align.train.precision import resolve_autocast
from draft_align.train.records import Batch

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient norm was NaN/Inf: the step was skipped, nothing was applied."""


@dataclass(frozen=True)
class OptimSettings:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    total_steps: int = 1000
    grad_clip: float = 0.5


class LossSection(Protocol):
    """A recipe section that sets the objective (``config.TrainConfig``, ``config.SidecarConfig``)."""

    ttt_steps: int
    loss: str
    accept_mode: str | None
    soft_ce_weight: float
    surrogate_tau: float
    autocast_bf16: bool | None


@dataclass(frozen=True)
class LossSettings:
    """The TTT objective (train/losses.py): ``kind`` (conventions.LossKind); for the acceptance objectives the
    verify mode they score (``accept_mode``, None: the loss's default), the soft-CE mix weight λ and the greedy
    surrogates' τ."""

    ttt_steps: int = 7
    step_decay: float = 0.8
    kind: LossKind = "soft"
    train_lm_head: bool = True
    autocast_bf16: bool | None = None  # None: bf16 where the device computes it natively (precision.py)
    accept_mode: VerifyMode | None = None
    soft_ce_weight: float = 0.0
    surrogate_tau: float = 0.5

    def __post_init__(self) -> None:
        check_loss(self.kind, self.accept_mode, self.soft_ce_weight, self.surrogate_tau)

    @classmethod
    def from_section(cls, section: LossSection, step_decay: float, train_lm_head: bool) -> LossSettings:
        """The settings a warm-start's ``train`` or the sidecar's ``sidecar`` section asks for (one path for
        both); ``step_decay`` resolved for the head (``config.step_decay``)."""
        mode = section.accept_mode
        return cls(ttt_steps=int(section.ttt_steps), step_decay=float(step_decay), kind=str(section.loss),  # type: ignore[arg-type]
                   train_lm_head=bool(train_lm_head), autocast_bf16=section.autocast_bf16,
                   accept_mode=None if mode is None else str(mode),  # type: ignore[arg-type]
                   soft_ce_weight=float(section.soft_ce_weight), surrogate_tau=float(section.surrogate_tau))

    @property
    def verify_mode(self) -> VerifyMode | None:
        """The verify mode an acceptance objective scores; None for soft and hard CE."""
        return objective_mode(self.kind, self.accept_mode)  # type: ignore[return-value]


@dataclass
class Progress:
    """Everything about where training is, besides tensors; checkpointed as JSON."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0
    targets_seen: int = 0
    skipped_nonfinite: int = 0
    truncated_sequences: int = 0  # rows longer than the trainer's max_seq_tokens, cut to it
    truncated_targets: int = 0  # response tokens past the cap in those rows (not trained on)
    seconds: float = 0.0
    total_steps: int = 0  # the schedule's length (may adapt to a time budget)
    history: list[dict] = field(default_factory=list)


def lr_factor(s: OptimSettings, step: int, total: int) -> float:
    """Linear warmup to 1, then cosine to ``min_lr_ratio`` at ``total``."""
    if step < s.warmup_steps:
        return (step + 1) / max(1, s.warmup_steps)
    frac = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))



def ttt_loss(
    draft: Eagle3Draft,
    embed: nn.Module,
    rows: torch.Tensor,
    batch: Batch,
    loss: LossSettings,
) -> tuple[torch.Tensor, StepStats]:
    """Weighted TTT loss of one batch (objectives in train/losses.py).  rows [draft_vocab, H]: the target's
    lm_head rows.

    Step j of chain s is scored at target position p = s+1+j (the target's distribution of token
    s+2+j) and counts iff token s+2+j is a response token inside the row.  StepStats.loss sums soft CE
    (hard CE for ``hard``) whatever the objective.
    """
    k = loss.ttt_steps
    xs = draft.unroll_hidden(batch.aux, embed, batch.input_ids, batch.valid, batch.starts, batch.starts_valid, k)
    vd = rows.shape[0]
    mode = loss.verify_mode  # None: soft or hard CE
    scored = scored_steps(batch, k)
    if loss.kind == "soft":
        # CE(p, q) = logsumexp(z) − Σ_x p(x) z(x) with z = W x: the second term is x · (Wᵀp), so Wᵀp is
        # formed once per scored position ([B, T, H]; prompt and padding targets skipped) instead of gathering
        # p [B, M, Vd] at every step.
        at = scored_positions(scored, batch.input_ids.shape)
        ep, p_arg = soft_targets(batch.final, rows, draft.lm_head.weight, at=at)  # gradient reaches lm_head
    elif loss.kind == "hard":
        dev = batch.input_ids.device
        to_draft = torch.full((draft.cfg.vocab_size,), -1, dtype=torch.long, device=dev)
        to_draft[draft.draft_to_target] = torch.arange(vd, device=dev)
        tgt_ids = to_draft[batch.input_ids]  # [B, T] draft id of each token (−1 outside)
    weights = step_weights(k, loss.step_decay)
    ce_total = xs[0].new_zeros((), dtype=torch.promote_types(xs[0].dtype, torch.float32))  # float64 stays
    sums = torch.zeros(3, k, device=batch.input_ids.device)
    alphas, masks = [], []
    for j, st in enumerate(scored):
        pos, mask = st.pos, st.mask
        # the [B, M, Vd] logits z = lm_head(xs[j]) exist one row block at a time (losses.*_head)
        if mode is not None:
            # α needs p itself: the target's logits at this step's scored positions only, per row block
            f = torch.gather(batch.final, 1, pos.unsqueeze(-1).expand(*pos.shape, batch.final.shape[-1]))
            alpha, ce_rows, agree_rows = acceptance_head(draft.lm_head, rows, xs[j], f, mode, loss.surrogate_tau)
            m = mask.to(ce_rows.dtype)
            ce, agree, n = (ce_rows * m).sum(), (agree_rows * m).sum(), m.sum()
            alphas.append(alpha)
            masks.append(mask)
        elif loss.kind == "soft":
            e = torch.gather(ep, 1, pos.unsqueeze(-1).expand(*pos.shape, ep.shape[-1]))  # [B, M, H]
            ce, agree, n = soft_ce_head(draft.lm_head, xs[j], e, torch.gather(p_arg, 1, pos), mask)
        else:
            ce, agree, n = hard_ce_head(draft.lm_head, xs[j], torch.gather(tgt_ids, 1, st.nxt), mask)
        ce_total = ce_total + weights[j] * ce / n.clamp(min=1)
        sums[0, j], sums[1, j], sums[2, j] = ce.detach(), agree, n
    stats = StepStats(loss=sums[0], correct=sums[1], count=sums[2])
    if mode is None:
        return ce_total, stats
    a, m = torch.stack(alphas), torch.stack(masks)  # [K, B, M]
    objective = chain_objective(a, m)[0] if loss.kind == "expected_length" else step_objective(a, m, weights)
    total = objective + loss.soft_ce_weight * ce_total if loss.soft_ce_weight else objective
    return total, stats


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
        draft: Eagle3Draft,
        embed: nn.Module,
        rows: torch.Tensor,
        optim: OptimSettings,
        loss: LossSettings,
        max_seq_tokens: int = MAX_SEQ_TOKENS,
    ) -> None:
        if max_seq_tokens < 2:
            raise ValueError(f"max_seq_tokens must be ≥ 2, got {max_seq_tokens}")
        # rows longer than this are cut to it before the step (counted in progress): bounds one step's memory
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
        self._rows = self._rows_stored if self._compute_dtype is None else self._rows_stored.to(self._compute_dtype)

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
            self.optimizer, lambda step: lr_factor(s, step, self.progress.total_steps)
        )

    def loss(self, batch: Batch) -> tuple[torch.Tensor, StepStats]:
        """This trainer's loss of one batch (on the trainer's device)."""
        if self._compute_dtype is None:
            return ttt_loss(self.draft, self.embed, self.rows, batch, self.loss_settings)
        dtype = self._compute_dtype
        return ttt_loss(self.draft, lambda ids: self.embed(ids).to(dtype), self._rows, batch.cast(dtype),
                        self.loss_settings)

    def set_total_steps(self, total: int) -> None:
        """Change the schedule's length (e.g. to end the cosine when a time budget ends).

        The next step already runs at the new schedule's LR (the scheduler alone would apply it one step late).
        """
        self.progress.total_steps = max(1, int(total))
        factor = lr_factor(self.optim_settings, self.scheduler.last_epoch, self.progress.total_steps)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * factor

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
            raise NonFiniteLossError(f"non-finite loss {loss.item()} at step {self.progress.step}; step skipped")
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
        self.scheduler.step()
        self.progress.step += 1
        self.progress.tokens_seen += batch.num_tokens
        n = stats.count.clamp(min=1)
        self.progress.targets_seen += int(stats.count[0])
        stats = StepStats(stats.loss.cpu(), stats.correct.cpu(), stats.count.cpu())
        out = {"loss": float(loss.detach()), "grad_norm": float(gnorm), "lr": lr, "targets": float(stats.count[0])}
        for j in range(stats.count.numel()):
            out[f"ce_{j}"] = float(stats.loss[j] / n[j])
            out[f"acc_{j}"] = float(stats.correct[j] / n[j])
        return out

    def _cap(self, batch: Batch) -> Batch:
        """The batch cut to ``max_seq_tokens`` positions (losses.truncate_batch), counted in progress."""
        batch, rows_cut, targets = truncate_batch(batch, self.max_seq_tokens, self.loss_settings.ttt_steps)
        if rows_cut:
            if not self.progress.truncated_sequences:
                log.warning("sequences longer than max_seq_tokens=%d are cut to it for training (%d targets "
                            "dropped in this batch; counted in progress.truncated_*)", self.max_seq_tokens, targets)
            self.progress.truncated_sequences += rows_cut
            self.progress.truncated_targets += targets
        return batch

    # ------------------------------------------------------------------ checkpoint (no pickle)
    def save(self, path: Path, state: tuple[dict[str, torch.Tensor], dict] | None = None) -> None:
        """Write draft weights, optimizer moments and progress to ``path`` atomically (temp + rename).

        ``state``: the (draft, optimizer) state dicts to write, when they were gathered from shards
        (:meth:`StepParallel.state_dicts`); else this process's own.

        A directory cannot be renamed over a non-empty one, so the previous checkpoint is first renamed
        aside (``.old-<name>-<pid>``), then the new one into place.  If that second rename fails the old
        one is moved back; if the process dies between the two, :func:`checkpoint_exists` moves it back.
        """
        import shutil


        path = Path(path)
        _discard_leftovers(path, "tmp")
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
        tmp.mkdir(parents=True)
        try:
            self._write_checkpoint(tmp, state)
        except BaseException:  # e.g. a full disk (ENOSPC): no temp folder stays behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not checkpoint_exists(path):
            if path.exists():  # an unusable leftover (no progress file): replace it
                shutil.rmtree(path)
            os.replace(tmp, path)
            return
        old = path.with_name(f".old-{path.name}-{os.getpid()}")
        os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.replace(old, path)  # put the previous checkpoint back before giving up
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(old)

    def _write_checkpoint(self, tmp: Path, state: tuple[dict[str, torch.Tensor], dict] | None) -> None:
        """The checkpoint's files, fsynced, into the folder ``tmp``."""
        from safetensors.torch import save_file

        draft_sd, opt = state if state is not None else (self.draft.state_dict(), self.optimizer.state_dict())
        tensors = {f"draft.{k}": v.detach().contiguous() for k, v in draft_sd.items()}
        for idx, st in opt["state"].items():
            for name, val in st.items():
                tensors[f"opt.{idx}.{name}"] = torch.as_tensor(val).detach().contiguous()
        save_file(tensors, str(tmp / STATE_FILE))
        meta = {
            "progress": asdict(self.progress),
            "param_groups": opt["param_groups"],
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state().tolist(),
        }
        (tmp / PROGRESS_FILE).write_text(json.dumps(meta))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())

    def load(self, path: Path) -> None:
        """Restore a checkpoint written by :meth:`save` (weights, optimizer, schedule, progress, RNG).

        Raises RuntimeError naming the unreadable file, or the mismatch, when the checkpoint cannot be used.
        """
        from safetensors.torch import load_file

        path = Path(path)
        checkpoint_exists(path)  # restores one an interrupted save left aside
        pfile, sfile = path / PROGRESS_FILE, path / STATE_FILE
        try:
            meta = json.loads(pfile.read_text())
            progress = Progress(**meta["progress"])
        except Exception as e:  # noqa: BLE001 - any read failure means an unusable checkpoint
            raise RuntimeError(f"trainer checkpoint file {pfile} is unreadable ({e}); delete {path} to start over") from e
        try:
            tensors = load_file(str(sfile))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise RuntimeError(f"trainer checkpoint file {sfile} is unreadable ({e}); delete {path} to start over") from e
        draft_sd = {k[len("draft.") :]: v for k, v in tensors.items() if k.startswith("draft.")}
        state: dict[int, dict] = {}
        for k, v in tensors.items():
            if k.startswith("opt."):
                _, idx, name = k.split(".", 2)
                state.setdefault(int(idx), {})[name] = v
        try:
            # strict: a checkpoint missing a tensor must not leave that tensor at its fresh init
            opt_sd = {"state": state, "param_groups": meta["param_groups"]}
            if self.parallel is None:
                self.draft.load_state_dict(draft_sd, strict=True)
                self.optimizer.load_state_dict(opt_sd)
            else:  # FSDP2: every rank keeps its shard of the full state
                self.parallel.load_state_dicts(draft_sd, opt_sd)
            self.scheduler.load_state_dict(meta["scheduler"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise RuntimeError(
                f"trainer checkpoint {path} does not fit this draft/optimizer ({e}); it was written by another "
                f"configuration: delete it to start over"
            ) from e
        torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
        self.progress = progress


STATE_FILE = "state.safetensors"
PROGRESS_FILE = "progress.json"


def _discard_leftovers(path: Path, kind: str) -> None:
    """Remove ``.{kind}-<name>-*`` folders that an interrupted save of ``path`` left behind."""
    import shutil

    for p in path.parent.glob(f".{kind}-{path.name}-*"):
        shutil.rmtree(p, ignore_errors=True)


def checkpoint_exists(path: Path) -> bool:
    """Whether ``path`` holds a trainer checkpoint.

    A save killed between its two renames leaves no ``path`` and the previous checkpoint at
    ``.old-<name>-<pid>``: that one is moved back first.  Stale ``.old-*`` folders beside a complete
    checkpoint are removed.
    """
    path = Path(path)
    if (path / PROGRESS_FILE).exists():
        _discard_leftovers(path, "old")
        return True
    olds = [p for p in path.parent.glob(f".old-{path.name}-*") if (p / PROGRESS_FILE).exists()]
    if not olds or path.exists():
        return False
    newest = max(olds, key=lambda p: p.stat().st_mtime)
    log.warning("restoring trainer checkpoint %s left aside by an interrupted save", newest)
    os.replace(newest, path)
    _discard_leftovers(path, "old")
    return True
