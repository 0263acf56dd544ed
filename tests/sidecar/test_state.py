"""draft_align.sidecar.state: the checkpointed progress round-trips atomically; throughput and the monitor's view."""

from __future__ import annotations

import json

import pytest

from draft_align.sidecar.state import Rates, SidecarState, sidecar_stats


def test_state_round_trips_atomically(tmp_path):
    s = SidecarState(published_version=3, train_steps=12, rejected={"mac": 2}, lora_base_dir="/b", done=True)
    path = tmp_path / "state.json"
    s.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left behind
    assert SidecarState.load(path) == s
    assert json.loads(path.read_text())["published_version"] == 3
    s.train_steps = 13
    s.save(path)  # replaces
    assert SidecarState.load(path).train_steps == 13


def test_rates_and_stats():
    r = Rates()
    assert r.train_tokens_per_s is None and r.ingest_tokens_per_s is None
    r.train_tokens, r.train_s, r.ingest_tokens, r.ingest_s = 100.0, 4.0, 30.0, 0.5
    assert r.train_tokens_per_s == 25.0 and r.ingest_tokens_per_s == 60.0
    s = SidecarState(
        published_version=2,
        published_policy_version=5,
        train_steps=7,
        trained_tokens=70,
        ingested_tokens=90,
        nonfinite_sequences=1,
        mismatched_messages=2,
        nonfinite_steps=3,
        nonfinite_heads=4,
        gate_rejections=5,
        restarts=6,
    )
    stats = sidecar_stats(s, {"tokens": 40, "fill": 0.25}, r, {"mac": 2, "frames": 1})
    assert stats.to_dict() == {
        "sidecar_draft_version": 2,
        "sidecar_draft_policy_version": 5,
        "buffer_tokens": 40,
        "buffer_fill": 0.25,
        "sidecar_train_steps": 7,
        "sidecar_trained_tokens": 70,
        "sidecar_train_tokens_per_s": 25.0,
        "sidecar_ingest_tokens_per_s": 60.0,
        "sidecar_ingested_tokens": 90,
        "wire_rejected": 3,
        "wire_nonfinite": 1,
        "wire_mismatched": 2,
        "nonfinite_steps": 3,
        "nonfinite_heads": 4,
        "published_versions": 2,
        "gate_rejections": 5,
        "sidecar_restarts": 6,
        "nonfinite_alarms": 0,
        "held_dropped": 0,
        "rl_restarts": 0,
        "old_version_batches": 0,
        "untapped_heads": 0,
        "reports_without_taps": 0,
        "publish_failures": 0,
        "untrainable_records": 0,
        "version_overflows": 0,
        "sidecar_training": 1,
        "sidecar_train_state": "training",
        "sidecar_waiting_for": None,
        "drift_triggers": 0,
        "sidecar_trained_policy_version": -1,
        "sidecar_busy_frac": None,
    }
    assert stats.rejected == {"mac": 2, "frames": 1}


def test_unknown_fields_are_ignored_and_bad_files_are_state_errors(tmp_path, caplog):
    import pytest

    from draft_align.sidecar.state import StateError

    path = tmp_path / "state.json"
    path.write_text(json.dumps({"train_steps": 4, "from_the_future": 1, "lora_base_dir": "/b"}))
    with caplog.at_level("WARNING"):
        s = SidecarState.load(path)
    assert s.train_steps == 4 and s.lora_base_dir == "/b" and s.published_version == 0
    assert "from_the_future" in caplog.text
    for text, match in [
        ("{not json", "unreadable"),
        ("[1, 2]", "expected a JSON object"),
        ('{"train_steps": "4"}', "train_steps"),
        ('{"train_steps": true}', "train_steps"),
        (b"\xff\xfe", "unreadable"),
    ]:
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        with pytest.raises(StateError, match=match):
            SidecarState.load(path)


def test_rates_window_splits_loop_time_into_training_and_waiting_by_reason():
    r = Rates()
    assert r.window() == (None, {})
    r.loop_s, r.train_s = 10.0, 4.0
    r.waited("replay cap", 5.0)
    r.waited("min buffer", 1.0)
    busy, shares = r.window()
    assert busy == pytest.approx(0.4) and shares == pytest.approx({"replay cap": 0.5, "min buffer": 0.1})
    r.loop_s, r.train_s = 12.0, 6.0  # the next window: 2 s, all training
    assert r.window() == (pytest.approx(1.0), {})
    stats = sidecar_stats(SidecarState(), {"tokens": 0, "fill": 0.0}, r, {}, window=True)
    assert stats.busy_frac is None and stats.to_dict()["sidecar_busy_frac"] is None  # no loop time since
    r.loop_s = 13.0
    r.waited("replay cap", 1.0)
    row = sidecar_stats(SidecarState(), {"tokens": 0, "fill": 0.0}, r, {}, window=True).to_dict()
    assert row["sidecar_busy_frac"] == 0.0 and row["sidecar_wait_frac_replay_cap"] == pytest.approx(1.0)
