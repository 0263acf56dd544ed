"""draft_align.monitor.rows: the monitoring row's keys, their order and values (what monitor.jsonl holds)."""

from __future__ import annotations

from draft_align.monitor.rows import SidecarStats, StepRow
from draft_align.wire.messages import StepReport

STATS = SidecarStats(
    draft_version=2,
    draft_policy_version=5,
    buffer_tokens=40,
    buffer_fill=0.25,
    train_steps=7,
    trained_tokens=70,
    train_tokens_per_s=None,
    ingest_tokens_per_s=60.0,
    ingested_tokens=90,
    wire_nonfinite=1,
    wire_mismatched=2,
    nonfinite_steps=3,
    nonfinite_heads=4,
    gate_rejections=5,
    restarts=6,
    rejected={"mac": 2, "frames": 1},
)
SIDECAR_KEYS = [
    "sidecar_draft_version",
    "sidecar_draft_policy_version",
    "buffer_tokens",
    "buffer_fill",
    "sidecar_train_steps",
    "sidecar_trained_tokens",
    "sidecar_train_tokens_per_s",
    "sidecar_ingest_tokens_per_s",
    "sidecar_ingested_tokens",
    "wire_rejected",
    "wire_nonfinite",
    "wire_mismatched",
    "nonfinite_steps",
    "nonfinite_heads",
    "published_versions",
    "gate_rejections",
    "sidecar_restarts",
    "nonfinite_alarms",
    "held_dropped",
    "rl_restarts",
    "old_version_batches",
    "untapped_heads",
    "reports_without_taps",
    "publish_failures",
    "untrainable_records",
    "version_overflows",
    "sidecar_training",
    "sidecar_train_state",
    "sidecar_waiting_for",
    "drift_triggers",
    "sidecar_trained_policy_version",
    "sidecar_busy_frac",
]


def _report(**metrics) -> StepReport:
    return StepReport(run_id="r", step=9, policy_version=8, metrics=metrics)


def test_row_keys_in_order_and_values():
    est = {
        "accept_est_adapted": 2.5,
        "accept_est_adapted_prob": 2.0,
        "accept_est_frozen": 1.5,
        "accept_est_frozen_prob": 1.25,
    }
    row = StepRow.from_report(
        _report(reward_mean=0.5, step=123.0, buffer_fill=0.9), STATS, time=1.7e9, estimates=est, est_records=4
    )
    d = row.to_dict()
    assert list(d) == [
        "time",
        "step",
        "policy_version",
        "reward_mean",
        "buffer_fill",
        *est,
        "est_records",
        *[k for k in SIDECAR_KEYS if k != "buffer_fill"],
        "staleness_sidecar",
    ]
    assert d["time"] == 1.7e9 and d["step"] == 9 and d["policy_version"] == 8  # the report's step wins
    assert d["reward_mean"] == 0.5 and d["buffer_fill"] == 0.25  # the sidecar's keys win over RL metrics
    assert (
        d["wire_rejected"] == 3 and d["published_versions"] == 2 and d["sidecar_train_tokens_per_s"] is None
    )
    assert d["staleness_sidecar"] == 8 - 5 == row.staleness_sidecar
    assert row.train_step == 7


def test_row_without_estimates_and_its_series():
    row = StepRow.from_report(_report(reward_mean=0.5, note=None, ok=True), STATS, time=1.0)
    d = row.to_dict()
    assert "est_records" not in d and not any(k.startswith("accept_est") for k in d)
    s = row.series()
    assert "rl/time" not in s and "rl/note" not in s and "rl/sidecar_train_tokens_per_s" not in s
    assert s["rl/reward_mean"] == 0.5 and s["rl/ok"] is True and s["rl/step"] == 9
    assert set(s) == {f"rl/{k}" for k, v in d.items() if isinstance(v, (int, float)) and k != "time"}
