"""The update cadence advise recommends from a run's measured cadence table (monitor/cadence.py)."""

import pytest

from draft_align.monitor.cadence import (
    CADENCE_FILE,
    CadenceArm,
    CadenceError,
    load_table,
    recommend,
    save_table,
)


def arm(name, gain, cpu, se=0.02):
    return CadenceArm(name, f"{name} settings", gain, se, cpu, cpu + 10.0, 3)


def test_the_cheapest_arm_keeping_ninety_percent_wins():
    table = [
        arm("every1", 0.50, 400.0),
        arm("every5", 0.40, 80.0),
        arm("drift", 0.46, 110.0),
        arm("never", 0.0, 0.0),
    ]
    rec = recommend(table)
    assert rec.arm.name == "drift"  # every5 keeps 80% only; drift 92% for 28% of the CPU
    assert "92%" in rec.reason and "28%" in rec.reason


def test_every_step_when_nothing_cheaper_keeps_the_gain():
    rec = recommend([arm("every1", 0.50, 400.0), arm("every5", 0.30, 80.0), arm("never", 0.0, 0.0)])
    assert rec.arm.name == "every1"


def test_never_when_training_does_not_beat_the_frozen_draft():
    rec = recommend([arm("every1", 0.03, 400.0, se=0.05), arm("every5", 0.02, 80.0), arm("never", 0.0, 0.0)])
    assert rec.arm.name == "never" and "frozen draft holds" in rec.reason


def test_table_round_trip_and_bad_tables(tmp_path):
    assert load_table(tmp_path) is None
    table = [arm("every1", 0.5, 400.0), arm("never", 0.0, 0.0)]
    save_table(tmp_path, table)
    assert load_table(tmp_path) == table
    (tmp_path / CADENCE_FILE).write_text('[{"name": "every5"}]')
    with pytest.raises(CadenceError, match="not a cadence table"):
        load_table(tmp_path)
    save_table(tmp_path, [arm("every5", 0.4, 80.0)])
    with pytest.raises(CadenceError, match="no 'every1' arm"):
        load_table(tmp_path)
    (tmp_path / CADENCE_FILE).write_text("{half")
    with pytest.raises(CadenceError, match="not a cadence table"):
        load_table(tmp_path)
