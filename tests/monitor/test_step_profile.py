"""StepProfile: a step's seconds per stage, other = the untimed rest, read back from a monitor row."""

import pytest

from draft_align.monitor.rows import SidecarStats, StepRow
from draft_align.monitor.step_profile import OTHER, STAGES, StepProfile
from draft_align.wire.messages import StepReport


def test_other_is_the_untimed_rest_and_shares_sum_to_one():
    p = StepProfile(10.0, {"generation": 6.0, "train": 2.0, "data": 0.5})
    assert p.other_s == pytest.approx(1.5) and p.timed_s == pytest.approx(8.5)
    assert p.share("generation") == pytest.approx(0.6) and p.stage_s("tap") == 0.0
    assert sum(p.share(s) for s in (*STAGES, OTHER)) == pytest.approx(1.0)
    assert StepProfile(1.0, {"train": 1.5}).other_s == 0.0  # never negative (timer noise)
    assert StepProfile(0.0, {}).share("train") is None
    with pytest.raises(ValueError, match="unknown stages"):
        StepProfile(1.0, {"rollout": 1.0})


def test_metrics_round_trip_through_a_monitor_row():
    p = StepProfile(4.0, {"generation": 2.0, "logprob": 0.5, "draft_refresh": 0.25, "tap": 0.25})
    report = StepReport(run_id="r", step=3, policy_version=4, metrics=p.to_metrics())
    stats = SidecarStats(1, 0, 0, 0.0, 0, 0, None, None, 0, 0, 0, 0, 0, 0, 0)
    row = StepRow.from_report(report, stats, time=0.0).to_dict()
    assert row["stage_generation_share"] == 0.5 and row["stage_other_s"] == pytest.approx(1.0)
    back = StepProfile.from_metrics(row)
    assert back.step_s == 4.0 and {s: back.stage_s(s) for s in STAGES} == {s: p.stage_s(s) for s in STAGES}


def test_older_logs_are_derived_from_their_raw_timers():
    row = {
        "step_s": 10.0,
        "rollout_s": 6.5,
        "draft_swap_s": 0.5,
        "logprob_s": 1.5,
        "tap_s": 0.5,
        "kl_s": 0.3,
        "update_s": 1.0,
        "policy_sync_s": 0.4,
        "draft_poll_s": 0.05,
        "draft_offer_s": 0.05,
        "save_s": 0.2,
    }
    p = StepProfile.from_metrics(row)
    assert p.stage_s("generation") == pytest.approx(6.0)  # rollout_s without the swaps
    assert p.stage_s("logprob") == pytest.approx(1.3) and p.stage_s("draft_refresh") == pytest.approx(0.6)
    assert p.stage_s("data") == 0.0 and p.other_s == pytest.approx(0.0)
    assert StepProfile.from_metrics({"reward_mean": 1.0}) is None
    m = StepProfile.mean([p, StepProfile(2.0, {"train": 1.0})])
    assert m.step_s == pytest.approx(6.0) and m.stage_s("train") == pytest.approx(1.0)
