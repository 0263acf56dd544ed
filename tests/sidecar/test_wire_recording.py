"""sidecar.recording.enabled: the sidecar records every valid message it handles; a second sidecar fed that
recording (benchmarks/adapt_playback.py's way) ends with the same buffer and the same step estimates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draft_align.config import CotrainRecipe, load_recipe


# no free-space reserve beyond the draft's own: the tests record on whatever disk they run on
@pytest.mark.parametrize(
    "sidecar_world", [{"sidecar.recording.enabled": True, "sidecar.recording.reserve_mb": 0}], indirect=True
)
def test_a_recorded_run_plays_back_into_the_same_buffer_and_rows(sidecar_world, until, tiny_run, tmp_path):
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar
    from draft_align.wire.messages import HeadSync, StepReport, TapBatch
    from draft_align.wire.recording import Recording

    recipe, sc, feeder = sidecar_world
    feeder.step(0, 0)
    feeder.step(1, 1)
    assert until(lambda: sc.state.monitor_rows >= 2, 20, every=lambda: sc.drain(0.1, 100))
    sc.close()
    path = sc.dir / "wire.rec"
    got = list(Recording(path))
    kinds = [type(m) for _, m in got]
    assert kinds.count(HeadSync) == 2 and kinds.count(StepReport) == 2 and kinds.count(TapBatch) >= 2
    assert sc.recorder.messages == len(got)

    again = load_recipe(
        None, tiny_run.cotrain_overrides(tmp_path / "playback", run=recipe.run), CotrainRecipe
    )
    assert again.run_dir != recipe.run_dir
    other = Sidecar(again, starting_draft(again)).setup()
    try:
        assert other.recorder is None  # record_wire is off by default
        for _, msg in got:
            other.handle(msg)
        assert other.ingest.buffer.stats() == sc.ingest.buffer.stats()
        assert other.state.head_policy_version == sc.state.head_policy_version == 1
        rows = [json.loads(x) for x in (sc.dir / "monitor.jsonl").read_text().splitlines()]
        rows2 = [json.loads(x) for x in (other.dir / "monitor.jsonl").read_text().splitlines()]
        keys = [k for k in rows[1] if k.startswith("accept_est_")]
        assert keys and [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in rows2]
    finally:
        other.close()


# no free-space reserve beyond the draft's own: the tests record on whatever disk they run on
@pytest.mark.parametrize(
    "sidecar_world", [{"sidecar.recording.enabled": True, "sidecar.recording.reserve_mb": 0}], indirect=True
)
def test_adapt_playback_runs_arms_on_a_recording(sidecar_world, until, tmp_path):
    """benchmarks/adapt_playback.py on a 3-step recording: every arm scores every step; a tighter replay cap
    trains fewer tokens on the same messages and says that the cap stopped it."""
    import sys

    from draft_align.config.recipe_files import RESOLVED_RECIPE, save_recipe
    from draft_align.wire.recording import Recording

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import adapt_playback

    recipe, sc, feeder = sidecar_world
    save_recipe(recipe, recipe.run_dir / RESOLVED_RECIPE)
    for s in range(3):
        feeder.step(s, s)
    assert until(lambda: sc.state.monitor_rows >= 3, 30, every=lambda: sc.drain(0.1, 100))
    sc.close()
    msgs = [m for _, m in Recording(sc.dir / "wire.rec")]
    arms = [
        adapt_playback.playback_arm(
            recipe.run_dir, arm, adapt_playback.ARMS[arm][0], msgs, 1600, tmp_path / "arms"
        )
        for arm in ("base", "cap2")
    ]
    for a in arms:
        assert [r["step"] for r in a["rows"]] == [0, 1, 2] and len(a["per_step"]) == 3
    base, cap = arms
    assert base["trained_tokens"] > cap["trained_tokens"] > 0
    assert any(s["stopped_by"] == "replay cap" for s in cap["per_step"])
    assert base["published"] >= 1
    result = {
        "command": "x",
        "date": "d",
        "run": "r",
        "recording": "w",
        "messages": len(msgs),
        "steps": 3,
        "train_tokens_per_step": 1600,
        "threads": 1,
        "eval_k": 2,
        "temperature": 1.0,
        "name": None,
        "arms": arms,
    }
    adapt_playback.summarise(result)
    text = adapt_playback.render(result)
    assert text.startswith(adapt_playback.section_title(None)) and "| cap2 |" in text


def _used(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.mark.parametrize(
    "sidecar_world",
    [{"sidecar.recording.enabled": True, "sidecar.recording.reserve_mb": 1, "sidecar.recording.max_mb": 64}],
    indirect=True,
)
def test_recording_on_a_small_disk_stops_before_checkpoints_lose_their_room(
    sidecar_world, until, monkeypatch, caplog
):
    """The run folder on a disk with little room (its free space = a capacity minus what the run holds): the
    recording stops at the reserve with one line, and the sidecar keeps ingesting, checkpointing and writing
    rows in the room the reserve kept."""
    from draft_align.sidecar.build import RESERVE_BYTES_PER_PARAM
    from draft_align.sidecar.layout import STATE_FILE
    from draft_align.wire import recording

    recipe, sc, feeder = sidecar_world
    rec = sc.recorder
    params = sum(p.numel() for p in sc.frozen.parameters())
    assert rec.reserve_bytes == max(1 << 20, RESERVE_BYTES_PER_PARAM * params)
    assert rec.max_file_bytes == 64 << 20
    capacity = _used(recipe.run_dir) + rec.reserve_bytes + 64 * 1024  # room for a few entries only
    monkeypatch.setattr(recording, "_free_bytes", lambda folder: capacity - _used(recipe.run_dir))
    for s in range(3):
        feeder.step(s, s)
    assert until(lambda: sc.state.monitor_rows >= 3, 30, every=lambda: sc.drain(0.1, 100))
    assert rec.failed is not None and "kept in reserve for checkpoints and publishes" in rec.failed
    assert 0 < rec.messages and sum("wire recording" in r.message for r in caplog.records) == 1
    assert capacity - _used(recipe.run_dir) >= rec.reserve_bytes - 64 * 1024  # the recording left the reserve
    before = (sc.dir / STATE_FILE).stat().st_mtime_ns if (sc.dir / STATE_FILE).exists() else None
    sc.checkpoint()
    assert sc.backoff.ready() and (sc.dir / STATE_FILE).stat().st_mtime_ns != before
    assert len(list(recording.Recording(sc.dir / "wire.rec"))) == rec.messages
