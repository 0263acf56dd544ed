"""tap.budget: the token-budget sample of an RL step (the bottom-k sketch), its seeding, and the budget rule
the Tap and the recipe share."""

import itertools
import random

import pytest
import torch

from draft_align.tap.budget import MIN_SEQUENCE_TOKENS, TokenBudgetSketch, check_budgets, generator_for
from draft_align.tap.protocol import PolicyTapError

GENERATOR_7_1 = 0.43837368237436936  # the first key generator_for(7, 1) draws (float64)


def test_sketch_equals_prefix_rule_for_any_split(prefix_keep):
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 12)
        lengths = [rng.randint(1, 9) for _ in range(n)]
        keys = [rng.random() for _ in range(n)]
        budget = rng.randint(1, 30)
        sketch = TokenBudgetSketch(budget, torch.Generator().manual_seed(trial))
        handle_of: dict[int, int] = {}
        i = 0
        while i < n:  # random micro-batch split
            j = min(n, i + rng.randint(1, 4))
            handles, evicted = sketch.add(lengths[i:j], keys[i:j])
            for k, h in zip(range(i, j), handles, strict=True):
                if h is not None:
                    handle_of[k] = h
            earlier = set(handle_of.values()) - set(handles)
            assert set(evicted) <= earlier  # only earlier sequences are reported evicted
            i = j
        kept = {k for k, h in handle_of.items() if h in set(sketch.kept())}
        assert kept == prefix_keep(lengths, keys, budget), (lengths, keys, budget)
        assert sketch.tokens == sum(lengths[k] for k in kept) <= budget
        assert sketch.too_long == sum(length > budget for length in lengths)
        assert sorted(sketch.reset()) == sorted(handle_of[k] for k in kept)
        assert sketch.kept() == [] and sketch.tokens == 0 and sketch.threshold == 1.0


def exact_inclusion(lengths: list[int], budget: int) -> list[float]:
    """P(sequence i kept) under the prefix rule, by enumerating all orderings (keys are exchangeable)."""
    hits = [0] * len(lengths)
    perms = list(itertools.permutations(range(len(lengths))))
    for order in perms:
        total = 0
        for i in order:
            total += lengths[i]
            if total > budget:
                break
            hits[i] += 1
    return [h / len(perms) for h in hits]


def test_sketch_sampling_is_uniform_over_orderings():
    """Equal-length sequences are kept equally often; a long sequence less often than a short one (it is
    more often the one that overflows the budget): frequencies match the exact enumeration over orderings."""
    lengths, budget, steps = [2, 2, 2, 2, 5, 5], 8, 4000
    exact = exact_inclusion(lengths, budget)
    # long i kept iff nothing precedes it (1/6) or one short does and is first (1/6·4/5): 0.3; shorts 0.4
    assert exact == pytest.approx([0.4] * 4 + [0.3] * 2)
    sketch = TokenBudgetSketch(budget, generator_for(0, 0))
    rng = random.Random(1)
    counts = [0] * len(lengths)
    for _ in range(steps):
        order = list(range(len(lengths)))
        rng.shuffle(order)  # arrival order and micro-batching must not matter
        owner = {}
        for part in (order[:2], order[2:3], order[3:]):
            handles, _ = sketch.add([lengths[i] for i in part])
            owner.update({h: i for i, h in zip(part, handles, strict=True) if h is not None})
        kept = sketch.reset()
        assert sum(lengths[owner[h]] for h in kept) <= budget
        for h in kept:
            counts[owner[h]] += 1
    freq = [c / steps for c in counts]
    for f, p in zip(freq, exact, strict=True):
        assert abs(f - p) < 0.035, (freq, exact)  # ≥ 4 standard errors at 4000 steps


def test_sketch_rejects_an_empty_budget_and_mismatched_keys():
    with pytest.raises(PolicyTapError, match="budget"):
        TokenBudgetSketch(0, torch.Generator())
    with pytest.raises(PolicyTapError, match="2 keys for 3 sequences"):
        TokenBudgetSketch(5, torch.Generator()).add([1, 1, 1], [0.1, 0.2])


def test_generator_is_seeded_by_seed_and_rank():
    draw = [
        torch.rand(3, generator=generator_for(s, r)).tolist() for s, r in ((0, 0), (0, 0), (0, 1), (1, 0))
    ]
    assert draw[0] == draw[1] and draw[0] != draw[2] and draw[0] != draw[3]
    # pinned: the keys (so which sequences a run taps) must not change with refactors
    assert torch.rand(1, generator=generator_for(7, 1), dtype=torch.float64).item() == GENERATOR_7_1


@pytest.mark.parametrize(
    ("tokens", "message", "match"),
    [
        (1, 16384, "tokens_per_step must be ≥ 2, got 1"),
        (8192, 1, "max_tokens_per_message must be ≥ 2, got 1"),
        (0, 0, "max_tokens_per_message"),
    ],
)
def test_budget_rule_needs_room_for_one_sequence(tokens, message, match):
    """A row of fewer than MIN_SEQUENCE_TOKENS tokens is never shipped (no next token to learn), so smaller
    budgets could never keep anything."""
    assert MIN_SEQUENCE_TOKENS == 2
    with pytest.raises(PolicyTapError, match=match):
        check_budgets(tokens, message)


def test_budget_rule_accepts_the_minimum():
    check_budgets(MIN_SEQUENCE_TOKENS, MIN_SEQUENCE_TOKENS)
