"""Verifiable-reward tasks (draft_align.data.tasks): generation, sources, the answer check."""

import pytest

from draft_align import data
from draft_align.data import tasks
from draft_align.data.tasks import Score, make_problems, parse_answer, score


@pytest.mark.parametrize("name", tasks.TASK_NAMES)
def test_problems_are_distinct_deterministic_and_solved_by_their_solution(name):
    a = make_problems(name, 300, seed=1)
    assert a == make_problems(name, 300, seed=1)
    assert a != make_problems(name, 300, seed=2)
    assert len({p.question for p in a}) == 300
    for p in a:  # the reference solution earns the full reward: its answer line is the answer
        assert score(p.answer, p.solution, True) == Score(True, True)
        assert "Answer: <number>" in p.system and p.conversation().messages[0].role == "system"


def test_answers_are_computed_from_the_question():
    for p in make_problems("add", 100, seed=3):
        a, b = (int(t) for t in p.question.rstrip("?.").replace(" and ", " + ").split() if t.isdigit())
        assert p.answer == a + b and 1 <= a <= 19 and 1 <= b <= 9
    for q in make_problems("arith", 50):
        nums = [int(t) for t in q.question.rstrip("?").split() if t.isdigit()]
        assert q.answer == nums[0] + nums[1] - nums[2]
    for p in make_problems("total", 50):  # the long-response task: one worked line per addition
        nums = [int(t) for t in p.question.split(":")[1].rstrip(".").split(",")]
        lines = p.solution.splitlines()
        assert 6 <= len(nums) <= 10 and p.answer == sum(nums) and len(lines) == len(nums)
        assert lines[-2].endswith(f"= {sum(nums)}") and lines[0].startswith(
            f"Step 1: {nums[0]} + {nums[1]} ="
        )


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("Answer: 42", 42),
        ("12 + 30 = 42\nAnswer: 42", 42),
        ("Answer: 1\nno wait\nAnswer: -7", -7),  # the last answer line counts
        ("Answer: **1,200**", 1200),
        ("The answer is 42", None),
        ("Answer: forty", None),
        ("", None),
        ("Answer: 1,9", None),  # a comma between digits is a thousands separator or not a number
        ("Answer: 1,9000", None),
        ("Answer: 1,234,567", 1234567),
        ("Answer: \u0664\u0662", None),  # non-ASCII digits are no answer
        ("Answer:  *  5", 5),
    ],
)
def test_parse_answer(text, value):
    assert parse_answer(text) == value


def test_the_answer_patterns_take_linear_time_on_long_whitespace():
    """16,384 spaces after "Answer:" took 3 s with the former pattern (quadratic backtracking), 100,000 over
    60 s: a 512-token completion of 64-space tokens stalled the RL step.  Both patterns are now linear."""
    import time

    from draft_align.data.tasks import last_integer

    for text in (
        "Answer:" + " " * 100_000 + "x",
        "Answer: **" + " " * 100_000 + "x",
        "1" + ",000" * 30_000 + ",9",
    ):
        t0 = time.perf_counter()
        parse_answer(text), last_integer(text), score(1, text, True)
        assert time.perf_counter() - t0 < 0.5, text[:20]


@pytest.mark.parametrize(
    ("text", "finished", "expected"),
    [
        ("Answer: 81", True, Score(True, True)),
        ("Answer: 80", True, Score(True, False)),
        ("it is 81", True, Score(False, True)),  # right, in the wrong format
        ("it is 18", True, Score(False, False)),
        ("81 or 80\nAnswer: 80", True, Score(True, False)),  # the answer line wins over the last integer
        ("Answer: 81", False, Score(False, False)),  # cut at max_new_tokens: no format, no credit
        ("Answer: 8,1", True, Score(False, False)),  # "8,1" is no number: not 81
        ("Answer: \u0668\u0661", True, Score(False, False)),  # Arabic-Indic 81 is not ASCII 81
    ],
)
def test_score(text, finished, expected):
    assert score(81, text, finished) == expected


def test_task_source_loads_as_conversations_and_splits_disjoint():
    convs = data.load_conversations("task:add:5")
    assert len(convs) == tasks.POOL_SIZES["add"]
    assert [tasks.question_of(c) for c in convs[:10]] == [p.question for p in make_problems("add", 10, 5)]
    train, held = data.split_heldout(convs, 64, 0)
    tasks.check_disjoint([tasks.question_of(c) for c in train], [tasks.question_of(c) for c in held])
    assert len(data.load_conversations("task:arith", limit=7)) == 7


def test_overlapping_training_and_heldout_problems_are_refused():
    qs = [p.question for p in make_problems("add", 20)]
    with pytest.raises(data.DataError, match="3 training problems are also held out"):
        tasks.check_disjoint(qs[:10], qs[7:15])


@pytest.mark.parametrize("bad", ["task:", "task:nope", "task:add:x", "task:add:1:2"])
def test_bad_task_sources_are_one_line_errors(bad):
    with pytest.raises(data.DataError, match="task source|unknown task"):
        tasks.parse_source(bad)
    with pytest.raises(data.DataError):
        data.load_conversations(bad)
