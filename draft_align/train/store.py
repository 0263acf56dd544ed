"""On-disk caches for warm-start data: self-distilled responses and captured target states.

Both are resumable after a kill: responses are appended line by line (a torn last line is ignored),
captured states are written as complete shards (temp file + rename) with a ``.complete`` marker once
all shards exist.  Shards pack sequences ragged: ``cu_seqlens`` [S+1], ``input_ids`` [N],
``loss_mask`` [N], ``aux`` [N, n_aux·H], ``final`` [N, H].
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from draft_align.storage import save_tensors
from draft_align.train.records import Record

log = logging.getLogger(__name__)


def settings_key(settings: dict) -> str:
    """A short stable hash of a settings dict (cache directory names)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


class ResponseCache:
    """JSONL of ``{"i": conversation index, "prompt": [ids], "response": [ids]}``, appended per batch."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def load(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if not self.path.exists():
            return done
        with open(self.path, encoding="utf-8") as f:
            for n, line in enumerate(f):
                try:
                    row = json.loads(line)
                    done[int(row["i"])] = (torch.tensor(row["prompt"]), torch.tensor(row["response"]))
                except (ValueError, KeyError, TypeError):
                    log.warning("%s: ignoring unreadable line %d (torn write?)", self.path, n + 1)
        return done

    def append(self, rows: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as f:
            # after a torn write the file ends mid-line: start a new line, or the first row appended now
            # would be glued onto the torn one and lost with it
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
        with open(self.path, "a", encoding="utf-8") as f:
            for i, p, r in rows:
                f.write(json.dumps({"i": i, "prompt": p.tolist(), "response": r.tolist()}) + "\n")
            f.flush()
            os.fsync(f.fileno())


class StoreError(RuntimeError):
    """A capture store that is incomplete, corrupt, or made for another target / aux layers."""


class HiddenStore:
    """Captured target states in packed safetensors shards under ``root``."""

    def __init__(self, root: Path, meta: dict) -> None:
        self.root = Path(root)
        self.meta = meta

    @property
    def complete(self) -> bool:
        return (self.root / ".complete").exists()

    def shard_path(self, n: int) -> Path:
        return self.root / f"shard-{n:05d}.safetensors"

    def existing_shards(self) -> int:
        n = 0
        while self.shard_path(n).exists():
            n += 1
        return n

    def write_shard(self, n: int, records: list[Record]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        lens = torch.tensor([0] + [len(r) for r in records])
        tensors = {
            "cu_seqlens": lens.cumsum(0),
            "input_ids": torch.cat([r.input_ids for r in records]),
            "loss_mask": torch.cat([r.loss_mask for r in records]),
            "aux": torch.cat([r.aux for r in records]).contiguous(),
            "final": torch.cat([r.final for r in records]).contiguous(),
        }
        tmp = self.root / f".tmp-{self.shard_path(n).name}"
        save_tensors(tensors, tmp, metadata={"meta": json.dumps(self.meta, sort_keys=True)})
        os.replace(tmp, self.shard_path(n))

    def finish(self) -> None:
        (self.root / ".complete").write_text(json.dumps(self.meta, sort_keys=True))

    def records(self) -> Iterator[Record]:
        """All records (views into shard tensors loaded in memory)."""
        for n in range(self.existing_shards()):
            yield from self.shard_records(n)

    def shard_records(self, n: int) -> list[Record]:
        """The records of shard ``n``; StoreError when it is unreadable or was made with other settings."""
        from safetensors import safe_open

        path = self.shard_path(n)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("meta", "{}"))
                t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iteration
        except Exception as e:  # noqa: BLE001 - any read failure: the shard is unusable
            raise StoreError(
                f"capture shard {path} is unreadable ({e}); delete {self.root} to recapture"
            ) from e
        if meta != json.loads(json.dumps(self.meta, sort_keys=True)):
            raise StoreError(f"capture shard {path} was made with other settings; delete {self.root}")
        cu = t["cu_seqlens"].tolist()
        return [
            Record(t["input_ids"][a:b], t["loss_mask"][a:b], t["aux"][a:b], t["final"][a:b])
            for a, b in zip(cu[:-1], cu[1:], strict=True)
        ]
