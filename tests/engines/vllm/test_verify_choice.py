"""rl.engine.verify_mode=auto: the standard error of a measured acceptance length, the choice rule, the recipe's checks
(no vLLM needed; the engine side is in test_vllm_rollouts.py)."""

from __future__ import annotations

import math

import pytest

from draft_align.acceptance import AcceptanceTally
from draft_align.config import CotrainRecipe, RecipeError
from draft_align.config.sections import RLConfig, RLEngineConfig, RLGuardConfig
from draft_align.engines.vllm.verify_choice import choose_verify_mode, length_se


def test_length_se_by_hand():
    # r = (.6, .3, .1): P(A = 0..3) = (.4, .3, .2, .1), E[A] = 1.0, E[A²] = 2.0, Var = 1.0; SE = sqrt(1 / 10)
    assert length_se(AcceptanceTally(10.0, [6.0, 3.0, 1.0])) == pytest.approx(math.sqrt(0.1))
    assert length_se(AcceptanceTally(5.0, [5.0, 5.0])) == 0.0  # every round accepts both drafts
    assert math.isnan(length_se(AcceptanceTally.empty(3)))


def measured(tallies):
    seen = []

    def measure(mode):
        seen.append(mode)
        return tallies[mode]

    return measure, seen


def test_choice_takes_the_other_mode_only_past_the_margin():
    greedy = AcceptanceTally(400.0, [120.0, 40.0, 10.0])  # L = 1.425
    better = AcceptanceTally(400.0, [200.0, 90.0, 30.0])  # L = 1.80, far past 1 SE of the difference
    measure, seen = measured({"greedy_draft": greedy, "probabilistic": better})
    c = choose_verify_mode(measure, current="greedy_draft", draft="d", temperature=1.0)
    assert seen == ["greedy_draft", "probabilistic"]
    assert c.mode == "probabilistic"
    assert c.length == pytest.approx({"greedy_draft": 1.425, "probabilistic": 1.8})
    assert c.metrics() == {
        "verify_measured_L_greedy_draft": pytest.approx(1.425),
        "verify_measured_L_probabilistic": pytest.approx(1.8),
    }
    # within noise of each other: the current mode stays, whichever it is
    close = AcceptanceTally(400.0, [124.0, 40.0, 10.0])  # L = 1.435, < 1 SE (≈ 0.05) above greedy
    for current in ("greedy_draft", "probabilistic"):
        measure, _ = measured({"greedy_draft": greedy, "probabilistic": close})
        assert choose_verify_mode(measure, current=current, draft="d", temperature=1.0).mode == current


def test_choice_with_no_rounds_and_bad_current():
    empty = AcceptanceTally.empty(3)
    some = AcceptanceTally(10.0, [3.0, 1.0, 0.0])
    measure, _ = measured({"greedy_draft": empty, "probabilistic": some})
    assert (
        choose_verify_mode(measure, current="greedy_draft", draft="d", temperature=1.0).mode
        == "probabilistic"
    )
    measure, _ = measured({"greedy_draft": some, "probabilistic": empty})
    assert (
        choose_verify_mode(measure, current="greedy_draft", draft="d", temperature=1.0).mode == "greedy_draft"
    )
    with pytest.raises(ValueError, match="not a candidate"):
        choose_verify_mode(measure, current="greedy", draft="d", temperature=1.0)


def test_recipe_auto_needs_vllm_and_probe_prompts():
    CotrainRecipe(rl=RLConfig(engine=RLEngineConfig(kind="vllm", verify_mode="auto"))).validate()
    for rl in (
        RLConfig(engine=RLEngineConfig(kind="reference", verify_mode="auto")),
        RLConfig(engine=RLEngineConfig(kind="auto", verify_mode="auto")),
        RLConfig(
            engine=RLEngineConfig(kind="vllm", verify_mode="auto"), guard=RLGuardConfig(probe_prompts=0)
        ),
    ):
        with pytest.raises(RecipeError, match="verify_mode=auto"):
            CotrainRecipe(rl=rl).validate()
