"""draft_align.sidecar.gate: the paired gate's numbers, publish timing, and a collapsed candidate refused."""

from __future__ import annotations

import math

import pytest
import torch

from draft_align.monitor.tapped_estimate import RecordEstimateError
from draft_align.sidecar.gate import paired_gate


def result(per_sequence, ids=None):
    return {
        "per_sequence": per_sequence,
        "sequence_ids": ids if ids is not None else list(range(len(per_sequence))),
    }


def test_paired_gate_constructed():
    base = result([(2.0, 10.0), (1.5, 20.0), (3.0, 5.0), (1.0, 8.0)])
    ok, diff, se = paired_gate(base, base, 0.0)
    assert ok and diff == 0.0 and se == 0.0
    # d = (−0.1, +0.2) with mean rounds (10, 30): w̃ = (0.25, 0.75)
    a = result([(1.9, 10.0), (2.2, 20.0)])
    b = result([(2.0, 10.0), (2.0, 40.0)])
    ok, diff, se = paired_gate(a, b, 0.01)
    assert diff == pytest.approx(0.125)
    # stderr² = 2/1 · (0.25² · 0.225² + 0.75² · 0.075²)
    assert se == pytest.approx(math.sqrt(2 * (0.0625 * 0.225**2 + 0.5625 * 0.075**2)))
    assert ok
    ok, diff2, se2 = paired_gate(b, a, 0.01)
    assert diff2 == pytest.approx(-0.125) and se2 == pytest.approx(se)
    assert ok == (-0.125 >= -max(0.01, 2 * se))  # noise wide enough to pass
    # a much worse candidate on many sequences fails; within tolerance passes
    many = [(2.0 + 0.1 * (i % 3), 10.0) for i in range(30)]
    worse = [(length - 0.5, r) for length, r in many]
    assert not paired_gate(result(worse), result(many), 0.1)[0]
    slightly = [(length - 0.05, r) for length, r in many]
    ok, diff, se = paired_gate(result(slightly), result(many), 0.1)
    assert ok and diff == pytest.approx(-0.05) and se == pytest.approx(0.0, abs=1e-12)
    # sequences with no round in either are skipped; one pair: the tolerance alone decides
    ok, diff, se = paired_gate(result([(2.0, 3.0), (math.nan, 0.0)]), result([(2.5, 3.0), (1.0, 2.0)]), 0.6)
    assert ok and diff == pytest.approx(-0.5) and math.isnan(se)
    assert not paired_gate(result([(2.0, 3.0)]), result([(2.5, 3.0)]), 0.4)[0]


def test_paired_gate_refuses_unpaired():
    with pytest.raises(RecordEstimateError, match="lengths differ"):
        paired_gate(result([(1.0, 1.0)]), result([(1.0, 1.0), (1.0, 1.0)]), 0.0)
    with pytest.raises(RecordEstimateError, match="sequence_ids"):
        paired_gate(result([(1.0, 1.0)], [3]), result([(1.0, 1.0)], [4]), 0.0)
    with pytest.raises(RecordEstimateError, match="no sequence"):
        paired_gate(result([(math.nan, 0.0)]), result([(1.0, 1.0)]), 0.0)
    with pytest.raises(RecordEstimateError, match="tolerance"):
        paired_gate(result([(1.0, 1.0)]), result([(1.0, 1.0)]), -0.1)


def test_publish_is_due_after_steps_and_interval(sidecar_world):
    recipe, sc, _ = sidecar_world
    assert not sc.publish_due(force=True)  # no HeadSync yet: nothing to score with
    sc.gate.steps_since_publish = 0
    assert not sc.gate.due(force=True)  # min_train_steps_per_publish = 1
    sc.gate.steps_since_publish = 1
    assert sc.gate.due(force=True) and sc.gate.due()  # publish_every_s = 0
    recipe.sidecar.publish.every_s = 3600.0
    assert sc.gate.due(force=True) and not sc.gate.due()


def test_gate_refuses_a_worse_candidate(sidecar_world, until):
    recipe, sc, feeder = sidecar_world
    feeder.step(0, 0)
    assert until(lambda: sc.state.monitor_rows >= 1, 20, every=lambda: sc.drain(0.1, 100))
    sc.recipe.sidecar.gate.tolerance = 0.0
    assert sc.train_one()
    with torch.no_grad():  # wreck the candidate: it proposes the same token everywhere
        sc.trainer.draft.lm_head.weight.zero_()
        sc.trainer.draft.lm_head.weight[0] = 10.0
    published = sc.maybe_publish(force=True)
    if published:  # only possible if the starting draft were just as bad on these records
        pytest.fail("a collapsed candidate passed the gate")
    assert sc.state.gate_rejections == 1
    assert not (recipe.run_dir / "drafts" / "v0001").exists()
