"""RoundCostTable: relative costs per batch size, the nearest calibrated batch, its JSON file and bad input."""

from __future__ import annotations

import pytest

from draft_align.monitor.round_cost import RoundCostError, RoundCostTable, StepTiming


def _table() -> RoundCostTable:
    return RoundCostTable(
        (
            StepTiming(8, 0, 0.04, 30),
            StepTiming(8, 1, 0.06, 30),
            StepTiming(8, 3, 0.1, 30),
            StepTiming(1, 0, 0.02, 30),
            StepTiming(1, 3, 0.025, 30),
            StepTiming(4, 1, 0.05, 30),
        ),  # batch 4 has no plain timing: not usable
        "unit test",
        {"engine": "none"},
    )


def test_relative_costs_and_batch_sizes():
    t = _table()
    assert t.batch_sizes() == [1, 8]
    assert t.relative(8) == pytest.approx({1: 1.5, 3: 2.5})
    assert t.relative(1) == pytest.approx({3: 1.25}) and t.relative(4) == {}
    assert t.nearest_batch(6) == 8 and t.nearest_batch(2) == 1 and t.nearest_batch(1) == 1
    assert t.step_s(8, 0) == 0.04 and t.step_s(2, 0) is None


def test_json_round_trip_and_bad_files(tmp_path):
    t = _table()
    assert RoundCostTable.load(t.save(tmp_path / "rc.json")) == t
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(RoundCostError, match="not JSON"):
        RoundCostTable.load(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(RoundCostError, match="expected a JSON object"):
        RoundCostTable.load(tmp_path / "list.json")
    (tmp_path / "short.json").write_text('{"source": "x", "timings": [{"batch_size": 1, "k": 0}]}')
    with pytest.raises(RoundCostError, match="missing"):
        RoundCostTable.load(tmp_path / "short.json")
    with pytest.raises(RoundCostError, match="step_s > 0"):
        StepTiming(1, 0, 0.0, 3)
    with pytest.raises(RoundCostError, match="batch_size ≥ 1"):
        StepTiming(0, 0, 0.1, 3)
