"""benchmarks/objectives.py: arm specs parse into recipe fields; a bad one fails with one line naming it."""

from __future__ import annotations

import pytest

from benchmarks.objectives import DEFAULT_ARMS, arm_overrides, parse_arm, parse_arms


def test_specs_parse_into_recipe_fields() -> None:
    assert parse_arm("soft") == {"name": "soft", "loss": "soft", "accept_mode": None, "soft_ce_weight": 0.0}
    assert parse_arm("tv+ce0.1") == {
        "name": "tv+ce0.1",
        "loss": "tv",
        "accept_mode": None,
        "soft_ce_weight": 0.1,
    }
    a = parse_arm("expected_length@greedy_draft+ce1e-2")
    assert (a["loss"], a["accept_mode"], a["soft_ce_weight"]) == ("expected_length", "greedy_draft", 0.01)
    assert [x["loss"] for x in parse_arms(DEFAULT_ARMS)] == ["soft", "tv", "expected_length", "tv"]
    assert arm_overrides(a, "bench") == [
        "run=bench-obj-expected_length-greedy_draft-ce1e-2",
        "train.objective.loss=expected_length",
        "train.objective.soft_ce_weight=0.01",
        "logging.log_every=1",
        "train.objective.accept_mode=greedy_draft",
    ]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("tv+0.1", "expected LOSS[@ACCEPT_MODE][+ceWEIGHT]"),
        ("kl", "loss 'kl' unknown"),
        ("soft+ce0.5", "soft_ce_weight=0.5 mixes soft CE"),
        ("tv@greedy", "accept_mode=greedy"),
        ("soft@probabilistic", "accept_mode=probabilistic is for the acceptance objectives"),
    ],
)
def test_bad_spec_is_one_line_naming_the_arm(spec: str, says: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_arm(spec)
    msg = str(e.value)
    assert msg.startswith(f"arm {spec!r}: ") and says in msg and "\n" not in msg


def test_arm_list_needs_distinct_names() -> None:
    with pytest.raises(ValueError, match="distinct"):
        parse_arms("tv,tv")
    with pytest.raises(ValueError, match="distinct"):
        parse_arms(" , ")
