"""Shared by the tap tests: the reference rule the token-budget sample must follow."""

import pytest


def _prefix_keep(lengths: list[int], keys: list[float], budget: int, max_len: int | None = None) -> set[int]:
    """Reference rule: the sequences with the smallest keys whose token total fits the budget (sequences
    longer than ``max_len``, default the budget, are left out)."""
    kept, total = set(), 0
    for i in sorted(range(len(lengths)), key=lambda i: keys[i]):
        if lengths[i] > (budget if max_len is None else max_len):
            continue
        total += lengths[i]
        if total > budget:
            break
        kept.add(i)
    return kept


@pytest.fixture
def prefix_keep():
    return _prefix_keep
