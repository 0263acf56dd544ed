"""The drift trigger's state machine (sidecar/trigger.py) on synthetic estimate sequences, and in the loop."""

from __future__ import annotations

import pytest
import torch

from draft_align.config import CotrainRecipe, RecipeError, load_recipe
from draft_align.sidecar.trigger import DriftTrigger, TriggerState, head_change, head_sketch


def _trigger(**kw) -> DriftTrigger:
    return DriftTrigger(
        "drift", **{"tolerance": 0.2, "head_threshold": 0.05, "window": 2, "min_gain": 0.03, **kw}
    )


def test_idle_train_publish_idle():
    t = _trigger()
    rows = torch.randn(40, 16)
    assert t.wants_training() and t.state is TriggerState.TRAINING  # nothing published yet
    t.on_publish(rows)
    assert t.state is TriggerState.SETTLING and not t.wants_training()
    t.on_estimate(1.50)
    assert t.state is TriggerState.SETTLING  # one of drift_window=2 estimates
    t.on_estimate(1.40)
    assert t.state is TriggerState.IDLE and t.baseline == pytest.approx(1.45)
    assert t.threshold() == pytest.approx(1 + 0.8 * 0.45)  # 1.36: 20% of the 0.45 gain may go
    t.on_estimate(1.38)  # mean(1.40, 1.38) = 1.39 ≥ 1.36: holds
    assert t.state is TriggerState.IDLE and "holds" in t.reason
    t.on_estimate(1.30)  # mean(1.38, 1.30) = 1.34 < 1.36
    assert t.wants_training() and "acceptance fell" in t.reason and t.triggers == 1
    t.on_estimate(1.0)  # while training, estimates change nothing
    assert t.wants_training() and t.triggers == 1
    t.on_publish(rows)
    assert t.state is TriggerState.SETTLING and t.baseline is None


def test_a_moved_head_triggers_and_a_still_one_does_not():
    t = _trigger()
    rows = torch.randn(40, 16)
    t.on_publish(rows)
    t.on_estimate(1.5)
    t.on_estimate(1.5)
    t.on_head(rows + 0.01 * rows.std() * torch.randn_like(rows))  # ~1% change
    assert t.state is TriggerState.IDLE
    t.on_head(rows * 1.2)  # 20% change
    assert t.wants_training() and "head moved" in t.reason


def test_head_change_is_relative_and_sketch_tracks_it():
    rows = torch.randn(300, 64)
    assert head_change(head_sketch(rows), head_sketch(rows)) == 0.0
    assert head_change(head_sketch(rows * 1.1), head_sketch(rows)) == pytest.approx(0.1, rel=1e-4)
    noise = 0.05 * torch.randn_like(rows)
    exact = float(noise.norm() / rows.norm())
    assert head_change(head_sketch(rows + noise), head_sketch(rows)) == pytest.approx(exact, rel=0.3)


def test_always_never_idles():
    t = DriftTrigger("always", tolerance=0.1, head_threshold=0.05, window=3, min_gain=0.03)
    t.on_publish(torch.randn(4, 4))
    for v in (2.0, 2.0, 2.0, 1.0):
        t.on_estimate(v)
    assert t.wants_training() and t.triggers == 0


def test_bad_settings():
    with pytest.raises(ValueError, match="always or drift"):
        DriftTrigger("sometimes", tolerance=0.1, head_threshold=0.1, window=1, min_gain=0.0)
    with pytest.raises(ValueError, match="drift_tolerance"):
        DriftTrigger("drift", tolerance=1.5, head_threshold=0.1, window=1, min_gain=0.0)
    for bad in (
        ["sidecar.trigger.drift_tolerance=0"],
        ["sidecar.trigger.drift_window=0"],
        ["sidecar.trigger.drift_head_threshold=-1"],
        ["sidecar.trigger.drift_min_gain=-0.1"],
        ["sidecar.trigger.when=drift", "sidecar.ranks=2"],
    ):
        with pytest.raises(RecipeError):
            load_recipe(None, bad, CotrainRecipe)
    with pytest.raises(RecipeError, match="sidecar.trigger.when"):
        load_recipe(None, ["sidecar.trigger.when=sometimes"], CotrainRecipe)


def test_the_loop_idles_after_a_publish_and_says_why(tiny_run, tiny_env, tmp_path, until, feeder_cls):
    """A real sidecar with train_trigger=drift: trains until it publishes, then waits (the monitor says why),
    and trains again when a HeadSync moves the head."""
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar

    recipe = load_recipe(
        None,
        tiny_run.cotrain_overrides(
            tmp_path,
            **{
                "sidecar.trigger.when": "drift",
                "sidecar.trigger.drift_window": 1,
                "sidecar.trigger.drift_head_threshold": 0.01,
                "sidecar.trigger.drift_min_gain": 100.0,  # idle right after each publish: what this test watches
            },
        ),
        CotrainRecipe,
    )
    sc = Sidecar(recipe, starting_draft(recipe)).setup()
    feeder = feeder_cls(recipe, sc.frozen.draft_to_target, sc.aux_ids)
    try:
        step = 0

        def feed(version: int = 0) -> None:
            """One RL step, drained until its StepReport was handled."""
            nonlocal step
            feeder.step(step, version)
            until(lambda: sc.drain(0.2, 200) >= 0 and sc.state.last_step_report >= step, 30)
            step += 1

        assert until(lambda: sc.train_one() and sc.maybe_publish(force=True), 120, every=feed)
        assert sc.trigger.state is TriggerState.SETTLING
        steps = sc.state.train_steps
        assert not sc.train_one() and sc.waiting is not None and "settling" in sc.waiting
        feed()  # a StepReport with fresh records: the baseline
        assert sc.trigger.state is TriggerState.IDLE and not sc.train_one() and "idle" in sc.waiting
        stats = sc.stats().to_dict()
        assert stats["sidecar_train_state"] == "idle" and stats["sidecar_training"] == 0
        assert sc.state.train_steps == steps
        # the policy's head moves (a HeadSync of new rows): training resumes
        with torch.no_grad():
            feeder.model.lm_head.weight.mul_(1.5)
        feed(1)
        assert sc.trigger.wants_training() and "head moved" in sc.trigger.reason
        assert until(lambda: sc.train_one(), 30, every=lambda: sc.drain(0.2, 100))
        assert sc.state.train_steps > steps and sc.stats().to_dict()["drift_triggers"] == 1
    finally:
        feeder.close()
        sc.close()


def test_publishes_that_still_pay_keep_it_training_and_idle_once_they_stop():
    """Issue 37: on the long workload the drift trigger idled after its first, barely trained publish (+0.00)
    and never trained again while every-step training gained +0.11; a burst now runs while its publishes pay."""
    t = _trigger(window=3, min_gain=0.05)
    rows = torch.randn(40, 16)
    t.on_publish(rows, gain=0.001)  # an early candidate barely moved: too soon to judge (1 of 3)
    assert t.wants_training() and "still improving" in t.reason
    t.on_publish(rows, gain=0.40)
    t.on_publish(rows, gain=0.20)  # mean 0.20 ≥ 0.05
    assert t.wants_training()
    t.on_publish(rows, gain=0.02)  # last three: 0.40, 0.20, 0.02 → 0.207
    t.on_publish(rows, gain=0.01)  # 0.20, 0.02, 0.01 → 0.077
    assert t.wants_training()
    t.on_publish(rows, gain=-0.01)  # 0.02, 0.01, −0.01 → 0.007 < 0.05: training stopped paying
    assert t.state is TriggerState.SETTLING and not t.wants_training()
    for x in (1.5, 1.5, 1.5):
        t.on_estimate(x)
    assert t.state is TriggerState.IDLE
    t.on_estimate(1.2)
    t.on_estimate(1.2)
    t.on_estimate(1.2)
    assert t.wants_training() and "acceptance fell" in t.reason
    t.on_publish(rows, gain=0.0)  # a new burst: judged on its own publishes, not the last burst's
    assert t.wants_training()
    t.on_publish(rows, gain=0.0)
    t.on_publish(rows, gain=0.0)
    assert t.state is TriggerState.SETTLING


def test_without_a_gain_a_publish_settles_as_before():
    t = _trigger(min_gain=0.05)
    t.on_publish(torch.randn(8, 4))
    assert t.state is TriggerState.SETTLING
    with pytest.raises(ValueError, match="drift_min_gain"):
        _trigger(min_gain=-1)
