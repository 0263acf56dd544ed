"""The sidecar trains on arrival: a step's taps train before its report, the newest version first; publishes
follow a newly trained version; the published draft names the version it trained on; the step's estimate uses
the draft published when its taps came; the lr ramps with the buffer; bad version / report sequences are
counted, never mis-attributed."""

from __future__ import annotations

import json

import pytest

from draft_align.wire.messages import StepReport


def _drop_reports(feeder, steps: set[int]) -> None:
    """Make the feeder's sender drop the StepReports of ``steps`` (the taps still go)."""
    offer = feeder.sender.offer

    def offer_but(msg):
        if isinstance(msg, StepReport) and msg.step in steps:
            return True
        return offer(msg)

    feeder.sender.offer = offer_but
    feeder._offer = offer


@pytest.mark.parametrize("sidecar_world", [{"sidecar.publish.every_s": 604800}], indirect=True)
def test_taps_train_before_their_report_and_publish_names_the_trained_version(sidecar_world, until):
    from draft_align.publish.folder import read_manifest
    from draft_align.publish.versions import read_latest

    recipe, sc, feeder = sidecar_world
    feeder.step(0, 0)
    assert until(lambda: sc.state.monitor_rows >= 1, 20, every=lambda: sc.drain(0.1, 100))
    assert sc.gate.due() is False  # nothing trained yet; the interval is a week
    assert sc.train_one() and sc.state.trained_policy_version == 0
    assert sc.gate.due()  # a newly trained version: one attempt, though the interval has not passed
    assert sc.maybe_publish() and read_manifest(read_latest(recipe.run_dir))["policy_version"] == 0
    published_v1 = sc.gate.published
    assert sc.train_one() and not sc.gate.due()  # same version again: the interval rules

    _drop_reports(feeder, {1})
    feeder.step(1, 1)  # step 1's taps, its report held back
    assert until(lambda: sc.state.ingested_messages >= 2, 20, every=lambda: sc.drain(0.1, 100))
    assert sc.state.last_step_report == 0 and 1 in sc.ingest.fresh
    # step 1's records train now (the newest version's undrawn records first), before step 1's report
    assert sc.train_one() and sc.state.trained_policy_version == 1
    assert sc.maybe_publish()
    v2 = read_latest(recipe.run_dir)
    assert read_manifest(v2)["policy_version"] == 1 and sc.gate.published is not published_v1

    # the report comes: the adapted estimate is the draft published when the taps came (v1), not v2, which
    # trained on them
    feeder._offer(StepReport(run_id=recipe.run, step=1, policy_version=1, metrics={}))
    assert until(lambda: sc.state.monitor_rows >= 2, 20, every=lambda: sc.drain(0.1, 100))
    row = [json.loads(x) for x in (sc.dir / "monitor.jsonl").read_text().splitlines()][-1]
    records, temp = [], 1.0
    for tr in sc.ingest.buffer.trainable() + sc.ingest.buffer.holdout():
        if tr.step == 1:
            records.append(tr)
    want = sc.estimate(published_v1, records, "greedy_draft", temp)["acceptance_length_est"]
    later = sc.estimate(sc.gate.published, records, "greedy_draft", temp)["acceptance_length_est"]
    assert row["accept_est_adapted"] == pytest.approx(want, abs=1e-9)
    assert want != later  # the test can tell the two drafts apart
    assert row["sidecar_trained_policy_version"] == 1 and not sc._step_drafts


@pytest.mark.parametrize("sidecar_world", [{"sidecar.train.lr_ramp_tokens": 1_000_000}], indirect=True)
def test_the_lr_ramps_with_the_trainable_tokens(sidecar_world, until):
    recipe, sc, feeder = sidecar_world
    feeder.step(0, 0)
    assert until(lambda: sc.state.monitor_rows >= 1, 20, every=lambda: sc.drain(0.1, 100))
    batch = sc.next_batch()
    assert batch is not None
    scale = sc.ingest.buffer.trainable_tokens / 1_000_000
    assert 0 < scale < 0.01 and sc.trainer.lr_scale == pytest.approx(scale)
    lr_before = sc.trainer.optimizer.param_groups[0]["lr"]
    stats = sc.trainer.train_step(batch)
    assert stats["lr"] == pytest.approx(lr_before)
    # warmup_steps=1: the schedule's factor is 1 from here on; the lr is the recipe's × the ramp
    assert sc.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        recipe.sidecar.train.objective.lr * scale
    )


def test_a_report_without_taps_is_a_row_without_estimates_and_counted(sidecar_world, until):
    recipe, sc, feeder = sidecar_world
    feeder.step(0, 0)
    assert until(lambda: sc.state.monitor_rows >= 1, 20, every=lambda: sc.drain(0.1, 100))
    feeder.sender.offer(StepReport(run_id=recipe.run, step=7, policy_version=3, metrics={"reward_mean": 0.5}))
    assert until(lambda: sc.state.monitor_rows >= 2, 20, every=lambda: sc.drain(0.1, 100))
    row = [json.loads(x) for x in (sc.dir / "monitor.jsonl").read_text().splitlines()][-1]
    assert row["step"] == 7 and row["reward_mean"] == 0.5 and row["reports_without_taps"] == 1
    assert not any(k.startswith("accept_est_") for k in row) and row.get("est_records") is None
    assert sc.state.reports_without_taps == 1


@pytest.mark.parametrize("sidecar_world", [{"sidecar.buffer.holdout_records": 1}], indirect=True)
def test_a_one_record_gate_set_publishes_and_notifies_without_a_stderr(sidecar_world, until):
    import math
    import time

    from draft_align.wire import channel

    recipe, sc, feeder = sidecar_world
    sub = channel.Subscriber(channel.default_endpoint(recipe.run_dir, "notify"), feeder.key)
    feeder.step(0, 0)
    assert until(lambda: sc.state.monitor_rows >= 1, 20, every=lambda: sc.drain(0.1, 100))
    assert len(sc.ingest.buffer.holdout()) == 1 and sc.train_one()
    time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher
    assert sc.maybe_publish(force=True)
    pub = [json.loads(x) for x in (sc.dir / "publish.jsonl").read_text().splitlines()][-1]
    assert math.isnan(pub["gate_stderr"])  # one paired sequence: no stderr, the tolerance decided
    note = sub.poll(5000)
    assert note is not None and note.draft_version == 1 and "gate_stderr" not in note.metrics
    assert note.metrics["gate_diff"] == pytest.approx(pub["gate_diff"])
    sub.close()
