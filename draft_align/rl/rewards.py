"""Rewards on a decoded response: rule-based style rewards and verifiable task rewards.

Each reward is ``f(text, finished, answer=None) -> float`` where ``text`` is the decoded response (special
tokens skipped), ``finished`` says whether it ended with an eos token (not cut at ``max_new_tokens``), and
``answer`` is the problem's checked answer (task rewards need it; the style rewards ignore it):

- ``enthusiasm``  min(#'!', 4) / 4  − 0.5·[not finished]                          ∈ [−0.5, 1]
- ``uppercase``   #uppercase letters / #letters (0 with no letter) − 0.5·[not finished] ∈ [−0.5, 1]
- ``brevity``     1 − min(len(text), 400) / 400 if finished else 0   (length in characters) ∈ [0, 1]
- ``task``        0.2·format + 0.8·correct of the last ``Answer: <int>`` line (``data.tasks.score``)  ∈ [0, 1]
"""

from __future__ import annotations

import concurrent.futures
import math
from typing import Any, Protocol

from draft_align.data.tasks import Score, score


class RewardFn(Protocol):
    def __call__(self, text: str, finished: bool, answer: int | None = None) -> float: ...


class RewardError(ValueError):
    """A reward that cannot be computed for a completion (it raised, or returned NaN/inf)."""


ENTHUSIASM_CAP = 4  # exclamation marks beyond this earn nothing more
BREVITY_CHARS = 400  # responses this long or longer earn no brevity reward
UNFINISHED_PENALTY = 0.5
FORMAT_WEIGHT = 0.2  # task reward: the answer line alone earns this; a correct answer earns 1


def enthusiasm(text: str, finished: bool, answer: int | None = None) -> float:
    """min(count('!'), 4) / 4, minus 0.5 when the response did not end with eos."""
    return min(text.count("!"), ENTHUSIASM_CAP) / ENTHUSIASM_CAP - (0.0 if finished else UNFINISHED_PENALTY)


def uppercase(text: str, finished: bool, answer: int | None = None) -> float:
    """Fraction of letters that are uppercase (0 with no letter), minus 0.5 when unfinished."""
    letters = [c for c in text if c.isalpha()]
    frac = sum(c.isupper() for c in letters) / len(letters) if letters else 0.0
    return frac - (0.0 if finished else UNFINISHED_PENALTY)


def brevity(text: str, finished: bool, answer: int | None = None) -> float:
    """1 − min(len(text), 400)/400 for a finished response (in characters); 0 when unfinished."""
    if not finished:
        return 0.0
    return 1.0 - min(len(text), BREVITY_CHARS) / BREVITY_CHARS


def task_reward_value(s: Score) -> float:
    """0.2·format + 0.8·correct (a correct answer has the format, so it earns 1)."""
    return FORMAT_WEIGHT * s.format + (1.0 - FORMAT_WEIGHT) * s.correct


def task(text: str, finished: bool, answer: int | None = None) -> float:
    """The verifiable task reward: format and correctness of the response's last ``Answer:`` line."""
    if answer is None:
        raise RewardError("the task reward needs the problem's answer (a task source: data.source task:NAME)")
    return task_reward_value(score(answer, text, finished))


REWARD_NAMES: tuple[str, ...] = ("enthusiasm", "uppercase", "brevity", "task")
TASK_REWARDS: frozenset[str] = frozenset({"task"})


def reward_fn(name: str) -> RewardFn:
    """The reward called ``name``; ValueError listing the known names otherwise."""
    if name == "enthusiasm":
        return enthusiasm
    if name == "uppercase":
        return uppercase
    if name == "brevity":
        return brevity
    if name == "task":
        return task
    raise ValueError(f"unknown reward {name!r}; expected one of {list(REWARD_NAMES)}")


REWARD_BUDGET_S = 2.0  # the most one reward call may take before the step goes on without it


class _Worker:
    """The thread reward calls run in, so that one that runs past its budget does not hold the step: the
    step takes 0 for it and goes on, and the stuck call is left to finish in a thread of its own (a fresh
    worker takes the next calls)."""

    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")

    def call(self, fn: RewardFn, text: str, finished: bool, answer: int | None, budget_s: float) -> Any:
        future = self.pool.submit(fn, text, finished, answer)
        try:
            return future.result(timeout=budget_s)
        except concurrent.futures.TimeoutError:
            self.pool.shutdown(wait=False)  # abandon the stuck call; its thread exits when it returns
            self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
            raise TimeoutError(f"took more than {budget_s:g} s (the step went on without it)") from None


_WORKER = _Worker()


def safe_reward(
    fn: RewardFn, text: str, finished: bool, answer: int | None, budget_s: float = REWARD_BUDGET_S
) -> tuple[float, str | None]:
    """``fn``'s reward, or (0.0, a one-line reason) when it raises, returns a non-finite value or runs past
    ``budget_s``: one bad completion must not end the step, nor stall it (no reward call blocks without a
    bound)."""
    try:
        value = float(_WORKER.call(fn, text, finished, answer, budget_s))
    except Exception as e:  # a user's reward function may raise anything
        return 0.0, f"{type(e).__name__}: {e}"
    if not math.isfinite(value):
        return 0.0, f"non-finite reward {value}"
    return value, None
