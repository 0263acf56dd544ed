"""A trainer checkpoint on disk: one folder with the draft's weights and the optimizer's moments
(``state.safetensors``, no pickle) and where training is (``progress.json``: :class:`Progress`, the optimizer's
param groups, the schedule, the RNG), written atomically and recovered after an interrupted save."""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from draft_align.storage import save_tensors

log = logging.getLogger(__name__)

STATE_FILE = "state.safetensors"
PROGRESS_FILE = "progress.json"


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
    prompt_cut_sequences: int = 0  # of those, rows whose window starts after their prompt's start
    seconds: float = 0.0
    total_steps: int = 0  # the schedule's length (may adapt to a time budget)
    history: list[dict] = field(default_factory=list)


@dataclass
class StoredCheckpoint:
    """A checkpoint as read back: the tensors and ``progress.json`` (``param_groups``, ``scheduler``, ``rng``)."""

    draft: dict[str, torch.Tensor]  # the draft's state dict
    optimizer_state: dict[int, dict[str, torch.Tensor]]  # the optimizer's per-parameter state, by index
    meta: dict[str, Any]
    progress: Progress


def save_checkpoint(
    path: Path, draft: dict[str, torch.Tensor], optimizer: dict, scheduler: dict, progress: Progress
) -> None:
    """Write the draft's state dict, the optimizer's (torch's index form), the schedule's, ``progress`` and the
    RNG state to the folder ``path`` atomically (temp + rename).

    A directory cannot be renamed over a non-empty one, so the previous checkpoint is first renamed
    aside (``.old-<name>-<pid>``), then the new one into place.  If that second rename fails the old
    one is moved back; if the process dies between the two, :func:`checkpoint_exists` moves it back.
    """
    path = Path(path)
    _discard_leftovers(path, "tmp")
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        _write(tmp, draft, optimizer, scheduler, progress)
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


def _write(
    tmp: Path, draft: dict[str, torch.Tensor], optimizer: dict, scheduler: dict, progress: Progress
) -> None:
    """The checkpoint's files, fsynced, into the folder ``tmp``."""
    tensors = {f"draft.{k}": v.detach().contiguous() for k, v in draft.items()}
    for idx, st in optimizer["state"].items():
        for name, val in st.items():
            tensors[f"opt.{idx}.{name}"] = torch.as_tensor(val).detach().contiguous()
    save_tensors(tensors, tmp / STATE_FILE)
    meta = {
        "progress": asdict(progress),
        "param_groups": optimizer["param_groups"],
        "scheduler": scheduler,
        "rng": torch.get_rng_state().tolist(),
    }
    (tmp / PROGRESS_FILE).write_text(json.dumps(meta))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def read_checkpoint(path: Path) -> StoredCheckpoint:
    """The checkpoint :func:`save_checkpoint` wrote at ``path`` (one an interrupted save left aside is restored
    first).  Raises RuntimeError naming the unreadable file."""
    from safetensors.torch import load_file

    path = Path(path)
    checkpoint_exists(path)  # restores one an interrupted save left aside
    pfile, sfile = path / PROGRESS_FILE, path / STATE_FILE
    try:
        meta = json.loads(pfile.read_text())
        progress = Progress(**meta["progress"])
    except Exception as e:  # noqa: BLE001 - any read failure means an unusable checkpoint
        raise RuntimeError(
            f"trainer checkpoint file {pfile} is unreadable ({e}); delete {path} to start over"
        ) from e
    try:
        tensors = load_file(str(sfile))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise RuntimeError(
            f"trainer checkpoint file {sfile} is unreadable ({e}); delete {path} to start over"
        ) from e
    draft = {k[len("draft.") :]: v for k, v in tensors.items() if k.startswith("draft.")}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, idx, name = k.split(".", 2)
            state.setdefault(int(idx), {})[name] = v
    return StoredCheckpoint(draft, state, meta, progress)


def _discard_leftovers(path: Path, kind: str) -> None:
    """Remove ``.{kind}-<name>-*`` folders that an interrupted save of ``path`` left behind."""
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
