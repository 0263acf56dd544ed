"""draft_align.sidecar.loop on the tiny target: ingest → train → gate → publish → notify → monitor; a non-finite
loss; kill -9 (mid-run and mid-publish) and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from draft_align.config import CotrainRecipe, load_recipe
from draft_align.train.objective import LossSettings


def test_ingest_train_gate_publish_notify_and_monitor(sidecar_world, until):
    from draft_align.monitor.live import metrics_url, scrape
    from draft_align.publish.folder import read_manifest
    from draft_align.publish.versions import read_latest
    from draft_align.wire import channel

    recipe, sc, feeder = sidecar_world
    sub = channel.Subscriber(channel.default_endpoint(recipe.run_dir, "notify"), feeder.key)
    feeder.step(0, 0)
    feeder.step(1, 1)
    assert until(lambda: sc.state.monitor_rows >= 2, 20, every=lambda: sc.drain(0.1, 100))
    assert sc.has_head and sc.state.head_policy_version == 1
    assert sc.state.ingested_messages >= 2 and sc.rejected == {}
    stats = sc.ingest.buffer.stats()
    # every 4th record (sidecar.buffer.holdout_every) is held out, at most holdout_records = 6
    assert stats["records"] == 16 and stats["holdout_records"] == 4
    for _ in range(4):
        assert sc.train_one()
    assert sc.state.train_steps == 4
    time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher
    assert sc.maybe_publish(force=True)
    v1 = recipe.run_dir / "drafts" / "v0001"
    assert read_latest(recipe.run_dir) == v1
    man = read_manifest(v1, verify=True)
    assert man["draft_version"] == 1 and man["policy_version"] == 1
    note = sub.poll(5000)
    assert note is not None and note.draft_version == 1 and note.path == str(v1)
    assert note.sha256 == man["files"]["model.safetensors"]["sha256"]
    rows = [json.loads(x) for x in (sc.dir / "monitor.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["reward_mean"] == 0.25 and rows[1]["accept_measured_adapted"] == 1.5
    for key in (
        "accept_est_adapted",
        "accept_est_frozen",
        "accept_est_adapted_prob",
        "accept_est_frozen_prob",
    ):
        assert 1.0 <= rows[1][key] <= 1.0 + recipe.sidecar.gate.k
    # before any publish the "adapted" draft is the starting one: both estimates agree exactly
    assert rows[1]["accept_est_adapted"] == rows[1]["accept_est_frozen"]
    metrics = scrape(metrics_url(recipe.run_dir))
    assert metrics["draft_align_published_versions"] == 1.0
    assert metrics["draft_align_sidecar_train_steps"] == 4.0
    sub.close()


@pytest.mark.parametrize(
    "sidecar_world",
    [
        {},
        {"sidecar.train.objective.loss": "tv", "sidecar.train.objective.soft_ce_weight": 0.5},
        {"sidecar.train.objective.loss": "expected_length"},
    ],
    indirect=True,
    ids=["soft", "tv+ce", "expected_length"],
)
def test_nonfinite_loss_skips_the_step_and_publishes_nothing(sidecar_world, until):
    from draft_align.train.records import Record, TappedRecord
    from draft_align.train.replay import ReplayBuffer

    recipe, sc, feeder = sidecar_world
    assert sc.trainer.loss_settings == LossSettings.from_section(
        recipe.sidecar.train.objective, 0.8, True
    )  # the recipe's objective
    feeder.step(0, 0)
    assert until(lambda: sc.state.monitor_rows >= 1, 20, every=lambda: sc.drain(0.1, 100))
    before = {k: v.clone() for k, v in sc.trainer.draft.state_dict().items()}
    # finite but huge states overflow inside the draft: the loss is not finite
    sc.ingest.buffer = ReplayBuffer(4000, 2.0, 0, 0)
    h = sc.hidden
    rec = Record(
        input_ids=torch.randint(3, sc.vocab, (20,)),
        loss_mask=torch.arange(20) >= 5,
        aux=torch.full((20, 3 * h), 3e38).bfloat16(),
        final=torch.randn(20, h).bfloat16(),
    )
    assert sc.ingest.buffer_record(TappedRecord(record=rec, policy_version=0, step=0))
    assert sc.train_one()
    assert sc.state.nonfinite_steps == 1 and sc.state.train_steps == 0
    for k, v in sc.trainer.draft.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not sc.maybe_publish(force=True)
    assert not (recipe.run_dir / "drafts").exists()


def _spawn(resolved: Path, start: Path, log: Path) -> subprocess.Popen:
    from draft_align.cotrain import spawn_sidecar

    return spawn_sidecar(resolved, start, log)


def _published(run_dir: Path) -> int:
    p = run_dir / "sidecar" / "publish.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def _check_visible_versions(run_dir: Path) -> list[int]:
    from draft_align.publish.folder import CorruptCheckpointError, read_manifest
    from draft_align.publish.versions import read_latest

    versions = []
    for d in sorted((run_dir / "drafts").glob("v*")):
        try:
            versions.append(read_manifest(d, verify=True)["draft_version"])  # raises if half-written
        except (CorruptCheckpointError, FileNotFoundError):  # a file gone mid-hash: pruned while being read
            if d.exists():
                raise
            # deleted by retention while being read (never the one `latest` names)
    latest = read_latest(run_dir)
    if latest is not None:
        read_manifest(latest, verify=True)
    return versions


def test_kill9_mid_run_and_mid_publish_then_resume(tiny_run, tiny_env, tmp_path, until, feeder_cls):
    """The RL side keeps offering without blocking while the sidecar is dead; every visible draft is
    complete after each kill (kills land at random points, publishes happen on every train step); a
    restarted sidecar resumes from its checkpoint and keeps publishing higher versions."""
    import random

    from draft_align.cotrain import write_resolved
    from draft_align.sidecar.launch import starting_draft

    recipe = load_recipe(None, tiny_run.cotrain_overrides(tmp_path, run="kill"), CotrainRecipe)
    resolved = write_resolved(recipe)
    start = starting_draft(recipe)
    from draft_align.publish import load_draft

    frozen, _ = load_draft(start)
    feeder = feeder_cls(recipe, frozen.draft_to_target, tuple(frozen.cfg.aux_layer_ids))
    env_log = tmp_path / "sidecar.log"
    proc = _spawn(resolved, start, env_log)
    step = 0
    rng = random.Random(0)
    try:

        def feed() -> None:
            nonlocal step
            feeder.step(step, step // 2)
            step += 1

        assert until(lambda: _published(recipe.run_dir) >= 1, 90, every=feed), env_log.read_text()[-3000:]
        for _kill in range(3):
            time.sleep(rng.uniform(0.0, 0.6))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            # the RL side: offers never block with the sidecar gone
            worst = 0.0
            for _ in range(3):
                t = time.perf_counter()
                feed()
                worst = max(worst, time.perf_counter() - t)
            assert worst < 2.0
            versions = _check_visible_versions(recipe.run_dir)
            # consecutive, the newest sidecar.publish.keep_versions of them (retention runs before each publish)
            assert versions == list(range(versions[0], versions[0] + len(versions)))
            assert len(versions) <= recipe.sidecar.publish.keep_versions
            newest = versions[-1]
            proc = _spawn(resolved, start, env_log)
            assert until(lambda n=newest: max(_check_visible_versions(recipe.run_dir)) > n, 90, every=feed), (
                env_log.read_text()[-3000:]
            )
        state = json.loads((recipe.run_dir / "sidecar" / "state.json").read_text())
        assert state["restarts"] >= 1
        assert feeder.sender.stats()["sent"] > 0
        from draft_align.wire.messages import StepReport

        feeder.sender.offer(
            StepReport(run_id=recipe.run, step=step, policy_version=0, metrics={"final": 1.0})
        )
        assert proc.wait(timeout=60) == 0
        _check_visible_versions(recipe.run_dir)
        assert not list((recipe.run_dir / "drafts").glob(".tmp-*"))
    finally:
        if proc.poll() is None:
            proc.kill()
        feeder.close()
