"""The projection math against hand-computed cases: per-position rates and round costs → tokens per round,
speed-up, best k, and the step's speed-up by Amdahl."""

from __future__ import annotations

import pytest

from draft_align.monitor.projection import (
    MEASURED,
    PROJECTED,
    CostModel,
    ProjectionError,
    amdahl,
    best_k,
    conditional_rates,
    extend_rates,
    project,
    tokens_per_round,
)


def test_tokens_per_round_sums_the_cumulative_rates_and_extrapolates_the_last_conditional_rate():
    rates = [0.5, 0.25]  # α_1 = 0.5, α_2 = 0.5
    assert tokens_per_round(rates, 0) == 1.0
    assert tokens_per_round(rates, 1) == pytest.approx(1.5)
    assert tokens_per_round(rates, 2) == pytest.approx(1.75)
    assert tokens_per_round(rates, 3) == pytest.approx(1.875)  # P_3 = 0.25 · 0.5
    assert tokens_per_round(rates, 4) == pytest.approx(1.9375)
    ext = extend_rates(rates, 4)
    assert [x.label for x in ext] == [MEASURED, MEASURED, PROJECTED, PROJECTED]
    assert [x.value for x in ext] == pytest.approx([0.5, 0.25, 0.125, 0.0625])
    # one measured position: ρ = P_1
    assert tokens_per_round([0.8], 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)


def test_conditional_rates_and_a_zero_tail():
    assert conditional_rates([0.6, 0.3, 0.0]) == pytest.approx([0.6, 0.5, 0.0])
    assert conditional_rates([0.0, 0.0]) == [0.0, 0.0]  # nothing accepted: no division by zero
    assert tokens_per_round([0.6, 0.3, 0.0], 7) == pytest.approx(1.9)  # ρ = 0: nothing beyond


def test_cost_model_is_the_line_through_the_measured_points():
    c = CostModel.fit({1: 1.5, 3: 2.5}, batch_size=6)
    assert (c.a, c.b) == pytest.approx((1.0, 0.5))
    assert c.cost(1).value == 1.5 and c.cost(1).label == MEASURED
    assert c.cost(2).value == pytest.approx(2.0) and c.cost(2).label == PROJECTED
    assert c.cost(7).value == pytest.approx(4.5)
    ls = CostModel.fit({1: 1.0, 2: 2.0, 3: 2.0}, batch_size=1)  # least squares: slope 0.5, intercept 2/3
    assert (ls.a, ls.b) == pytest.approx((2 / 3, 0.5))
    one = CostModel.fit({3: 2.0}, batch_size=1)
    assert one.b is None and one.cost(3).value == 2.0 and one.cost(2) is None


def test_speedup_and_best_k_hand_computed():
    # rates 0.9, 0.8, 0.7; c(k) = 1 + 0.5 k:
    #   k=1: 1.9 / 1.5 = 1.267   k=2: 2.7 / 2.0 = 1.35   k=3: 3.4 / 2.5 = 1.36   k=4: (3.4 + 0.6125) / 3 = 1.3375
    rows = project([0.9, 0.8, 0.7], 3, CostModel.fit({1: 1.5, 3: 2.5}, 4))
    assert [r.k for r in rows] == list(range(1, 8))
    assert [r.speedup.value for r in rows[:4]] == pytest.approx([1.9 / 1.5, 1.35, 1.36, 4.0125 / 3.0])
    assert best_k(rows).k == 3
    # E(k) is measured only at the measured k; every speed-up is projected
    assert [r.tokens_per_round.label for r in rows[:4]] == [PROJECTED, PROJECTED, MEASURED, PROJECTED]
    assert {r.speedup.label for r in rows} == {PROJECTED}
    # the same rates at a cost that grows faster: k = 1 is best and still slower than plain decoding
    slow = project([0.5, 0.25], 2, CostModel.fit({1: 1.6, 2: 2.1}, 6))
    assert [r.speedup.value for r in slow[:3]] == pytest.approx([1.5 / 1.6, 1.75 / 2.1, 1.875 / 2.6])
    assert best_k(slow).k == 1 and best_k(slow).speedup.value < 1


def test_ties_go_to_the_smaller_k_and_unknown_costs_give_no_best():
    rows = project([1.0, 1.0], 2, CostModel.fit({1: 2.0, 2: 3.0}, 1))  # E = 2, 3, 4 … and c = 2, 3, 4 …
    assert best_k(rows).k == 1
    assert best_k(project([0.5], 1, None)) is None
    only3 = project([0.5, 0.25, 0.1], 3, CostModel.fit({3: 1.2}, 1))
    assert [r.k for r in only3 if r.speedup is not None] == [3] and best_k(only3).k == 3


def test_amdahl_over_the_step():
    assert amdahl(6.0, 4.0, 2.0) == pytest.approx(10 / 7)
    assert amdahl(6.0, 4.0, 0.5) == pytest.approx(10 / 16)
    assert amdahl(6.0, 0.0, 3.0) == pytest.approx(3.0)  # all generation: the rollout speed-up itself
    assert amdahl(0.0, 4.0, 3.0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "rates, match",
    [
        ([], "no per-position"),
        ([1.2], r"in \[0, 1\]"),
        ([0.2, 0.5], "cannot rise"),
        ([float("nan")], "finite"),
    ],
)
def test_bad_rates_are_refused(rates, match):
    with pytest.raises(ProjectionError, match=match):
        tokens_per_round(rates, 2)


def test_bad_costs_are_refused():
    with pytest.raises(ProjectionError, match="no measured round cost"):
        CostModel.fit({}, 6)
    with pytest.raises(ProjectionError, match="finite cost > 0"):
        CostModel.fit({1: 0.0}, 6)
    with pytest.raises(ProjectionError, match="speed-up > 0"):
        amdahl(1.0, 1.0, 0.0)
