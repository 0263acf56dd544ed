import pytest

from draft_align.rl.rewards import REWARD_NAMES, brevity, enthusiasm, reward_fn, uppercase


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
    assert [reward_fn(n) for n in REWARD_NAMES] == [enthusiasm, uppercase, brevity]


@pytest.mark.parametrize("bad", ["", "Enthusiasm", "length", "brevity "])
def test_unknown_reward_lists_names(bad):
    with pytest.raises(ValueError, match=r"unknown reward .*enthusiasm.*uppercase.*brevity"):
        reward_fn(bad)
