"""The token budget of a policy tap: which whole sequences of an RL step are kept.

Sampling (per RL step, streaming, no step total known in advance): every sequence gets a key
u ~ U(0, 1); the step keeps the longest run of sequences in ascending key order whose token total fits
``tokens_per_step`` — a bottom-k sketch with a token budget (:class:`TokenBudgetSketch`).  Every
ordering of the step's sequences is equally likely, so equal-length sequences are kept with equal
probability; a longer sequence is kept less often than a shorter one (it is more often the one that
overflows the budget).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence

import torch

from draft_align.conventions import MIN_TAP_SEQUENCE_TOKENS, check_tap_budgets
from draft_align.tap.protocol import PolicyTapError

#: The shortest sequence a tap ships: one position with a next token, the least a draft learns from
#: (shorter rows are counted ``too_short`` and skipped).  So a step budget or a message size below it
#: could never keep anything.
MIN_SEQUENCE_TOKENS = MIN_TAP_SEQUENCE_TOKENS


def check_budgets(tokens_per_step: int, max_tokens_per_message: int) -> None:
    """:func:`draft_align.conventions.check_tap_budgets`, raising PolicyTapError (the Tap's error type)."""
    try:
        check_tap_budgets(tokens_per_step, max_tokens_per_message)
    except ValueError as e:
        raise PolicyTapError(str(e)) from None


def generator_for(seed: int, rank: int) -> torch.Generator:
    """CPU generator seeded from (seed, rank): ranks of one job draw independent keys, reproducibly."""
    # the namespace string predates the module split: changing it would change every tap's sample
    digest = hashlib.sha256(f"draft_align.policy_tap:{int(seed)}:{int(rank)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class TokenBudgetSketch:
    """Streaming uniform sample of whole sequences under a token budget (one RL step).

    Keys u_i ~ U(0, 1).  After any prefix of the stream the kept set is
    ``{i : Σ_{j: u_j ≤ u_i} n_j ≤ budget}`` over the sequences seen so far (too-long ones excluded):
    the smallest keys whose token total fits.  Online: insert, evict largest keys while over budget, and
    remember the smallest evicted key τ — a later sequence with u ≥ τ can never be in the prefix.
    The result does not depend on how the stream is split into calls.
    """

    def __init__(self, budget: int, generator: torch.Generator, max_seq_tokens: int | None = None) -> None:
        if int(budget) < 1:
            raise PolicyTapError(f"token budget must be ≥ 1, got {budget}")
        self.budget = int(budget)
        self.max_seq_tokens = self.budget if max_seq_tokens is None else min(self.budget, int(max_seq_tokens))
        self.generator = generator
        self.too_long = 0  # sequences longer than max_seq_tokens, over the sketch's lifetime
        self._next_handle = 0
        self.reset()

    def reset(self) -> list[int]:
        """Start a new step; returns the handles kept in the step that ends, in admission order."""
        kept = sorted(h for _, h in getattr(self, "_heap", []))
        self._heap: list[tuple[float, int]] = []  # (−key, handle): max-heap on key
        self._tokens: dict[int, int] = {}
        self.tokens = 0
        self.threshold = 1.0  # τ: smallest evicted key of this step
        return kept

    def kept(self) -> list[int]:
        """Handles kept so far this step, in admission order."""
        return sorted(h for _, h in self._heap)

    def add(
        self, n_tokens: Sequence[int], keys: Sequence[float] | None = None
    ) -> tuple[list[int | None], list[int]]:
        """Offer sequences of ``n_tokens`` each (keys drawn from the generator unless given).

        Returns (one handle per sequence, None where it is not kept after this call; handles of earlier
        sequences evicted by this call).
        """
        n = len(n_tokens)
        if keys is None:
            keys = torch.rand(n, generator=self.generator, dtype=torch.float64).tolist()
        elif len(keys) != n:
            raise PolicyTapError(f"{len(keys)} keys for {n} sequences")
        handles: list[int | None] = [None] * n
        for i, (length, u) in enumerate(zip(n_tokens, keys, strict=True)):
            length = int(length)
            if length > self.max_seq_tokens:
                self.too_long += 1
                continue
            if u >= self.threshold:
                continue
            h = self._next_handle
            self._next_handle += 1
            heapq.heappush(self._heap, (-float(u), h))
            self._tokens[h] = length
            self.tokens += length
            handles[i] = h
        evicted: list[int] = []
        while self.tokens > self.budget:
            neg_u, h = heapq.heappop(self._heap)
            self.threshold = -neg_u
            self.tokens -= self._tokens.pop(h)
            evicted.append(h)
        gone = set(evicted)
        fresh = {h for h in handles if h is not None}
        return [None if h in gone else h for h in handles], [h for h in evicted if h not in fresh]
