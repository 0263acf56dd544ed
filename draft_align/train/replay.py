"""Replay buffer of tapped sequences for the sidecar: token-bounded, recency-weighted, with a held-out tail.

Records arrive from TapBatch messages (docs/wire.md).  Every ``holdout_every``-th record (by arrival) is a
held-out candidate and the newest ``holdout_records`` candidates are held out for evaluation; everything else is
trainable (``holdout_every = 1``: the newest ``holdout_records`` records).  A stride > 1 keeps each policy
version's records trainable the moment they arrive while the held-out set still holds fresh records of the
newest versions: with one RL step's rollouts ≤ ``holdout_records`` and a stride of 1 the newest step is held out
whole and nothing trains on it until the next step arrives (a policy version of staleness built in).

Training batches draw trainable records without replacement with probability ∝ 0.5 ** ((v_newest − v) /
half_life), v the record's policy version, so the draft follows the current policy while older data still
regularises it.  With ``fresh_first`` the trainable records of the newest policy version that no batch has drawn
yet come first (in arrival order), so the first batches after a step's taps arrive are that step's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from typing import Any

import torch

from draft_align.train.records import TappedRecord

log = logging.getLogger(__name__)


class ReplayError(ValueError):
    """A record that does not fit the buffer's others, or bad buffer settings."""


class ReplayBuffer:
    """Token-bounded FIFO of :class:`TappedRecord` with a held-out tail and recency-weighted sampling.

    - ``add``: refuses (and counts by reason) records with no response token (``no_response``) and records
      longer than ``max_tokens`` (``too_long``); then evicts the oldest records (by arrival) until the
      total is ≤ ``max_tokens``.
    - Every ``holdout_every``-th record added is a held-out candidate; the newest ``holdout_records``
      candidates are held out (evaluation only); when a newer one arrives the oldest held-out one becomes
      trainable.
    - ``sample_records``: trainable records drawn without replacement, P ∝ 0.5 ** ((v_max − v) / half_life) with
      v_max the newest policy version in the buffer (``half_life = inf``: uniform), until the padded
      token count max_len × rows would exceed ``batch_tokens`` (at least one record); with ``fresh_first``
      the never-drawn records of version v_max first, oldest first.

    Records are kept as given (views of the received message, no copy): a message's memory is freed once
    all its records are evicted, so resident memory may exceed ``max_tokens`` by about one message.
    There is no to_state()/from_state(): after a restart the buffer is rebuilt from new data.
    Deterministic given the same seed and the same sequence of adds and samples.
    """

    def __init__(
        self,
        max_tokens: int,
        half_life: float,
        holdout_records: int,
        seed: int,
        *,
        holdout_every: int = 1,
        fresh_first: bool = False,
    ) -> None:
        if holdout_every < 1:
            raise ReplayError(f"holdout_every must be ≥ 1, got {holdout_every}")
        if max_tokens < 2:
            raise ReplayError(f"max_tokens must be ≥ 2, got {max_tokens}")
        if not half_life > 0:  # NaN-safe
            raise ReplayError(f"half_life must be > 0 (inf for uniform sampling), got {half_life}")
        if holdout_records < 0:
            raise ReplayError(f"holdout_records must be ≥ 0, got {holdout_records}")
        self.max_tokens = int(max_tokens)
        self.half_life = float(half_life)
        self.holdout_records = int(holdout_records)
        self.holdout_every = int(holdout_every)
        self.fresh_first = bool(fresh_first)
        self._added = 0  # records accepted so far (the hold-out stride counts these)
        self._held: deque[int] = deque()  # arrivals of the held-out records, oldest first
        self._drawn: set[int] = set()  # arrivals of records some batch has drawn
        self._gen = torch.Generator().manual_seed(int(seed))
        self._records: deque[TappedRecord] = deque()  # arrival order
        self._tokens = 0
        self._last_arrival = -1
        self._widths: tuple[int, int] | None = None  # (aux width, final width) every record must share
        self.evicted_records = 0
        self.evicted_tokens = 0
        self.refused: dict[str, int] = {"no_response": 0, "too_long": 0}

    # ------------------------------------------------------------------ adding
    def add(self, rec: TappedRecord) -> TappedRecord | None:
        """Store ``rec`` (with its arrival assigned if it was −1); None if refused (counted in ``refused``).

        Raises ReplayError if its arrival does not exceed the previous one or its aux/final widths differ
        from the records already seen.
        """
        if not rec.has_response:
            self.refused["no_response"] += 1
            return None
        if rec.num_tokens > self.max_tokens:
            self.refused["too_long"] += 1
            log.warning("replay: refused a %d-token record (max_tokens %d)", rec.num_tokens, self.max_tokens)
            return None
        widths = (rec.record.aux.shape[1], rec.record.final.shape[1])
        if self._widths is not None and widths != self._widths:
            raise ReplayError(f"record aux/final widths {widths} differ from the buffer's {self._widths}")
        if rec.arrival < 0:
            rec = dataclasses.replace(rec, arrival=self._last_arrival + 1)
        elif rec.arrival <= self._last_arrival:
            raise ReplayError(f"arrival {rec.arrival} is not after the previous one ({self._last_arrival})")
        self._widths = widths
        self._last_arrival = rec.arrival
        self._records.append(rec)
        self._tokens += rec.num_tokens
        if self.holdout_records and self._added % self.holdout_every == 0:
            self._held.append(rec.arrival)
            if len(self._held) > self.holdout_records:
                self._held.popleft()  # the oldest held-out record becomes trainable
        self._added += 1
        while self._tokens > self.max_tokens:
            old = self._records.popleft()
            self._tokens -= old.num_tokens
            self.evicted_records += 1
            self.evicted_tokens += old.num_tokens
            self._drawn.discard(old.arrival)
            if self._held and self._held[0] == old.arrival:
                self._held.popleft()
        return rec

    # ------------------------------------------------------------------ views
    def trainable(self) -> list[TappedRecord]:
        """Trainable records, oldest first."""
        held = set(self._held)
        return [r for r in self._records if r.arrival not in held]

    def holdout(self) -> list[TappedRecord]:
        """Held-out records in arrival order (oldest first)."""
        held = set(self._held)
        if not held:
            return []
        out = []
        for r in reversed(self._records):  # the held-out records are among the newest
            if r.arrival in held:
                out.append(r)
                if len(out) == len(held):
                    break
        return out[::-1]

    def __len__(self) -> int:
        return len(self._records)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def weights(self) -> torch.Tensor:
        """Sampling weights [n_trainable] float64 (unnormalised, 1 at the newest version in the buffer)."""
        return torch.exp(self._log_weights(self.trainable()))

    def _log_weights(self, recs: list[TappedRecord]) -> torch.Tensor:
        if not recs:
            return torch.zeros(0, dtype=torch.float64)
        newest = max(r.policy_version for r in self._records)
        age = torch.tensor([newest - r.policy_version for r in recs], dtype=torch.float64)  # ≥ 0
        if math.isinf(self.half_life):
            return torch.zeros_like(age)
        return -age * (math.log(2.0) / self.half_life)

    # ------------------------------------------------------------------ sampling
    def sample_records(self, batch_tokens: int) -> list[TappedRecord]:
        """The records of one batch (see :meth:`sample`); [] if nothing is trainable."""
        if batch_tokens < 1:
            raise ReplayError(f"batch_tokens must be ≥ 1, got {batch_tokens}")
        recs = self.trainable()
        if not recs:
            return []
        # Gumbel-top-k: sorting log w + Gumbel noise gives the order of successive draws without replacement
        # ∝ w, and stays exact in log space where 0.5 ** (age / half_life) would underflow.
        u = torch.rand(len(recs), generator=self._gen, dtype=torch.float64).clamp_min(1e-300)
        keys = self._log_weights(recs) - torch.log(-torch.log(u))
        order = torch.argsort(keys, descending=True).tolist()
        if self.fresh_first:
            newest = max(r.policy_version for r in recs)
            fresh = [
                i for i, r in enumerate(recs) if r.policy_version == newest and r.arrival not in self._drawn
            ]
            taken = set(fresh)
            order = fresh + [i for i in order if i not in taken]
        chosen: list[TappedRecord] = []
        longest = 0
        for i in order:
            n = max(longest, recs[i].num_tokens)
            if chosen and n * (len(chosen) + 1) > batch_tokens:
                break
            chosen.append(recs[i])
            longest = n
        self._drawn.update(r.arrival for r in chosen)
        return chosen

    # ------------------------------------------------------------------ monitoring
    @property
    def trainable_tokens(self) -> int:
        """Tokens of the records training may sample: all but the held-out ones."""
        return self._tokens - sum(r.num_tokens for r in self.holdout())

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring; ``version_min``/``version_max`` are None while the buffer is empty."""
        recs = list(self._records)
        held = self.holdout()
        trainable_tokens = self._tokens - sum(r.num_tokens for r in held)
        versions = [r.policy_version for r in recs]
        return {
            "tokens": self._tokens,
            "records": len(recs),
            "trainable_tokens": trainable_tokens,
            "trainable_records": len(recs) - len(held),
            "holdout_tokens": self._tokens - trainable_tokens,
            "holdout_records": len(held),
            "evicted_records": self.evicted_records,
            "evicted_tokens": self.evicted_tokens,
            **{f"refused_{k}": v for k, v in self.refused.items()},
            "version_min": min(versions) if versions else None,
            "version_max": max(versions) if versions else None,
            "fill": self._tokens / self.max_tokens,
        }
