"""Verifiable-reward tasks generated in-process: problems whose answer a program checks.

A task source is named ``task:NAME`` or ``task:NAME:SEED`` wherever a chat source is taken (``data.source``,
``eval --data``). It yields distinct problems drawn from ``random.Random(f"task:{NAME}:{SEED}")``
(``POOL_SIZES``) as one-turn conversations (the user's question; the assistant's turn is the reference solution), so
``split_heldout`` holds problems out as it holds out chat data, and no problem occurs twice in a pool.

Every task asks for a final line ``Answer: <value>``; :func:`score` reads the last such line:

- ``format``: the response finished (not cut) and has an ``Answer:`` line whose value parses;
- ``correct``: that value equals the problem's answer.

Tasks (``TASK_NAMES``):

- ``add``       two 2-digit numbers added, the answer alone;
- ``arith``     ``a + b - c`` (2-digit), worked step by step, then the answer;
- ``convert``   a unit conversion (km→m, m→cm, h→min, kg→g, min→s), worked, then the answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from draft_align.data.conversations import Conversation, DataError, Message

TASK_PREFIX = "task:"
DEFAULT_SEED = 0
ANSWER_RE = re.compile(r"Answer:\s*\**\s*(-?\d[\d,]*)")


@dataclass(frozen=True)
class Problem:
    """One problem: the question asked, the checked answer, and a reference solution (for SFT)."""

    question: str
    answer: int
    solution: str

    def conversation(self) -> Conversation:
        return Conversation((Message("user", self.question), Message("assistant", self.solution)))


@dataclass(frozen=True)
class Score:
    """What :func:`score` found: the answer line's format and its correctness (correct implies format)."""

    format: bool
    correct: bool


def _add(rng: random.Random) -> Problem:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    q = f"What is {a} + {b}? Reply with one line: Answer: <number>"
    return Problem(q, a + b, f"Answer: {a + b}")


def _arith(rng: random.Random) -> Problem:
    a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
    q = f"Compute {a} + {b} - {c}. Work it out step by step, then finish with one line: Answer: <number>"
    s = f"{a} + {b} = {a + b}\n{a + b} - {c} = {a + b - c}\nAnswer: {a + b - c}"
    return Problem(q, a + b - c, s)


_UNITS = (("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("hours", "minutes", 60))
_UNITS += (("kilograms", "grams", 1000), ("minutes", "seconds", 60), ("liters", "milliliters", 1000))
_UNITS += (("days", "hours", 24), ("weeks", "days", 7), ("feet", "inches", 12))


def _convert(rng: random.Random) -> Problem:
    big, small, factor = rng.choice(_UNITS)
    x = rng.randint(2, 99)
    q = (
        f"How many {small} are in {x} {big}? Explain in one sentence, then finish with one line: "
        "Answer: <number>"
    )
    s = f"One of the {big} is {factor} {small}, so {x} {big} is {x} × {factor} = {x * factor} {small}.\n"
    return Problem(q, x * factor, s + f"Answer: {x * factor}")


_TASKS: dict[str, Callable[[random.Random], Problem]] = {"add": _add, "arith": _arith, "convert": _convert}
# problems in one task source: distinct, and well inside each task's space (add 8,100; convert 882)
POOL_SIZES = {"add": 4096, "arith": 4096, "convert": 640}
TASK_NAMES: tuple[str, ...] = tuple(_TASKS)


def is_task_source(source: str) -> bool:
    return source.startswith(TASK_PREFIX)


def parse_source(source: str) -> tuple[str, int]:
    """``task:NAME[:SEED]`` → (NAME, SEED); DataError naming the known tasks otherwise."""
    parts = source[len(TASK_PREFIX) :].split(":") if is_task_source(source) else []
    if not parts or parts[0] not in _TASKS or len(parts) > 2:
        raise DataError(f"task source {source!r}: expected task:NAME or task:NAME:SEED, NAME in {TASK_NAMES}")
    try:
        seed = int(parts[1]) if len(parts) == 2 else DEFAULT_SEED
    except ValueError:
        raise DataError(f"task source {source!r}: the seed must be an integer") from None
    return parts[0], seed


def make_problems(name: str, n: int, seed: int = DEFAULT_SEED) -> list[Problem]:
    """``n`` distinct problems of task ``name`` (distinct questions), the same for the same (name, seed)."""
    if name not in _TASKS:
        raise DataError(f"unknown task {name!r}; expected one of {TASK_NAMES}")
    if n < 1:
        raise DataError(f"a task pool needs at least one problem, got n={n}")
    rng = random.Random(f"task:{name}:{seed}")
    seen: set[str] = set()
    out: list[Problem] = []
    for _ in range(50 * n):
        p = _TASKS[name](rng)
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
            if len(out) == n:
                return out
    raise DataError(f"task {name!r} has fewer than {n} distinct problems")


def task_problems(source: str) -> list[Problem]:
    """The problem pool of ``task:NAME[:SEED]``."""
    name, seed = parse_source(source)
    return make_problems(name, POOL_SIZES[name], seed)


def answers_by_question(problems: list[Problem]) -> dict[str, int]:
    return {p.question: p.answer for p in problems}


def check_disjoint(train: list[str], heldout: list[str]) -> None:
    """DataError when a training question is also held out (an evaluation on seen problems)."""
    overlap = set(train) & set(heldout)
    if overlap:
        example = next(iter(overlap))
        raise DataError(
            f"{len(overlap)} training problems are also held out (e.g. {example!r}); "
            "use one task source for both, or seeds whose pools do not overlap"
        )


def parse_answer(text: str) -> int | None:
    """The value of the last ``Answer: <int>`` line in ``text`` (None when there is none)."""
    found = ANSWER_RE.findall(text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None


def score(answer: int, text: str, finished: bool) -> Score:
    """The format and correctness of response ``text`` to a problem whose answer is ``answer``."""
    value = parse_answer(text) if finished else None
    return Score(value is not None, value is not None and value == answer)
