import math

import pytest

from draft_align.rl.rewards import (
    REWARD_NAMES,
    RewardError,
    brevity,
    enthusiasm,
    reward_fn,
    safe_reward,
    task,
    uppercase,
)


@pytest.mark.parametrize(
    ("name", "text", "finished", "expected"),
    [
        ("enthusiasm", "", True, 0.0),
        ("enthusiasm", "wow!", True, 0.25),
        ("enthusiasm", "a!b!c!", True, 0.75),
        ("enthusiasm", "!!!!", True, 1.0),
        ("enthusiasm", "!!!!!!!!", True, 1.0),  # capped at 4
        ("enthusiasm", "!!", False, 0.0),  # 0.5 − 0.5
        ("enthusiasm", "no marks", False, -0.5),
        ("uppercase", "", True, 0.0),  # no letters
        ("uppercase", "123 !?", True, 0.0),
        ("uppercase", "ABcd", True, 0.5),
        ("uppercase", "HELLO, WORLD 42", True, 1.0),
        ("uppercase", "aBC d", True, 0.5),  # 2 of 4 letters; digits/spaces ignored
        ("uppercase", "ABcd", False, 0.0),
        ("uppercase", "abc", False, -0.5),
        ("uppercase", "ÉCOLE été", True, 5 / 8),  # unicode letters count
        ("brevity", "", True, 1.0),
        ("brevity", "x" * 100, True, 0.75),
        ("brevity", "x" * 400, True, 0.0),
        ("brevity", "x" * 1000, True, 0.0),  # clipped at 400 characters
        ("brevity", "short", False, 0.0),  # unfinished earns nothing
    ],
)
def test_reward_table(name, text, finished, expected):
    assert reward_fn(name)(text, finished) == pytest.approx(expected, abs=1e-12)


def test_dispatch_returns_the_named_functions():
    assert [reward_fn(n) for n in REWARD_NAMES] == [enthusiasm, uppercase, brevity, task]


@pytest.mark.parametrize("bad", ["", "Enthusiasm", "length", "brevity "])
def test_unknown_reward_lists_names(bad):
    with pytest.raises(ValueError, match=r"unknown reward .*enthusiasm.*uppercase.*brevity"):
        reward_fn(bad)


@pytest.mark.parametrize(
    ("text", "finished", "expected"),
    [
        ("7 + 8 = 15\nAnswer: 15", True, 1.0),  # correct (and so formatted)
        ("Answer: 16", True, 0.2),  # the format alone
        ("fifteen", True, 0.0),
        ("it is 15", True, 0.8),  # correct without the answer line
        ("Answer: 15", False, 0.0),  # cut: no credit
    ],
)
def test_task_reward(text, finished, expected):
    assert reward_fn("task")(text, finished, 15) == pytest.approx(expected)


def test_task_reward_needs_an_answer():
    with pytest.raises(RewardError, match="needs the problem's answer"):
        task("Answer: 3", True)


def test_safe_reward_counts_a_raising_or_non_finite_reward_as_an_error():
    def boom(text, finished, answer=None):
        raise KeyError("x")

    assert safe_reward(boom, "a", True, None) == (0.0, "KeyError: 'x'")
    value, why = safe_reward(lambda t, f, a=None: math.nan, "a", True, None)
    assert value == 0.0 and why == "non-finite reward nan"
    assert safe_reward(lambda t, f, a=None: -math.inf, "a", True, None)[1] == "non-finite reward -inf"
    assert safe_reward(task, "Answer: 2", True, 2) == (1.0, None)


def test_a_reward_past_its_budget_does_not_stall_the_step():
    """No reward call may block without a bound: one that runs past its budget gets 0 and a one-line reason,
    and the next call runs on a fresh worker at once."""
    import threading
    import time

    from draft_align.rl.rewards import safe_reward

    release = threading.Event()

    def stuck(text, finished, answer):
        release.wait(30)
        return 1.0

    t0 = time.perf_counter()
    value, error = safe_reward(stuck, "x", True, None, budget_s=0.2)
    assert value == 0.0 and error.startswith("TimeoutError") and "\n" not in error
    assert time.perf_counter() - t0 < 2.0
    assert safe_reward(lambda t, f, a: 0.5, "x", True, None, budget_s=0.2) == (0.5, None)
    release.set()
