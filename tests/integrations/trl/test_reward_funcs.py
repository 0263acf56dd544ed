"""draft_align's task reward in TRL's reward-function shape."""

import math

from draft_align.data import tasks
from draft_align.integrations.trl.reward_funcs import task_dataset, task_reward


def test_task_reward_scores_conversational_and_plain_completions():
    comps = [[{"role": "assistant", "content": "3 + 4 = 7\nAnswer: 7"}], "it is 7", "Answer: 8", "no idea"]
    assert task_reward(comps, answer=[7, 7, 7, 7]) == [1.0, 0.8, 0.2, 0.0]


def test_a_reward_that_cannot_be_computed_is_none_not_a_crash():
    # a forged answer column (not an integer) fails for that completion only
    out = task_reward(["Answer: 1", "Answer: 2"], answer=[1, math.nan])
    assert out == [1.0, None]


def test_task_dataset_holds_out_what_eval_holds_out():
    rows = task_dataset("task:add", 50)
    assert len(rows) == 50
    assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"]
    by_q = tasks.answers_by_question(tasks.task_problems("task:add"))
    assert all(by_q[r["prompt"][1]["content"]] == r["answer"] for r in rows)
    from draft_align.data import split_heldout

    _, held = split_heldout(tasks.task_problems("task:add"), 64, 0)
    assert not {r["prompt"][1]["content"] for r in rows} & {p.question for p in held}
