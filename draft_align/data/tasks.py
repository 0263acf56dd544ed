"""Verifiable-reward tasks generated in-process: problems whose answer a program checks.

A task source is named ``task:NAME`` or ``task:NAME:SEED`` wherever a chat source is taken (``data.source``,
``eval --data``). It yields distinct problems drawn from ``random.Random(f"task:{NAME}:{SEED}")``
(``POOL_SIZES``) as one-turn conversations (the user's question; the assistant's turn is the reference solution), so
``split_heldout`` holds problems out as it holds out chat data, and no problem occurs twice in a pool.

Every task's system prompt asks for the working, then a final line ``Answer: <value>``, and shows one example
reply. :func:`score` reads the response (both need it finished, not cut at ``max_new_tokens``):

- ``format``: it has an ``Answer: <int>`` line;
- ``correct``: its answer equals the problem's: the last ``Answer:`` line's value, or without one the last
  integer in the text (a right answer in the wrong format still counts as right).

Tasks (``TASK_NAMES``; ``benchmarks/task_probe.py`` measures how SmolLM2-135M-Instruct does on each):

- ``add``       ``a + b`` with a in 1..19, b in 1..9, in four phrasings, worked in one line;
- ``arith``     ``a + b - c`` (2-digit), worked step by step;
- ``convert``   a unit conversion (km→m, h→min, kg→g, ...), worked in one sentence;
- ``total``     a running total of 6–10 two-digit numbers, worked one addition per line (``Step i: t + x = t'``):
                reference solutions of 95–163 SmolLM2 tokens, the long-response workload (docs/tasks.md).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from draft_align.data.conversations import Conversation, DataError, Message

TASK_PREFIX = "task:"
DEFAULT_SEED = 0
# An integer: ASCII digits, commas only as thousands separators ("1,900"; "1,9" is not one number).  The
# patterns cannot backtrack more than linearly: one optional run of stars between runs of blanks, no nested
# repetition (16,384 spaces after "Answer:" took 3 s with the earlier pattern; the reward must not stall a step).
_INT = r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?![0-9])"
ANSWER_RE = re.compile(r"Answer:[ \t]*(?:\*+[ \t]*)?(" + _INT + r")(?!,[0-9])", re.ASCII)
INT_RE = re.compile(_INT, re.ASCII)
SYSTEM = "You are a calculator. Reply in exactly this format:\n<working>\nAnswer: <number>\nExample reply to '{q}':\n{s}"


@dataclass(frozen=True)
class Problem:
    """One problem: the question asked, the checked answer, and a reference solution (for SFT)."""

    question: str
    answer: int
    solution: str
    system: str

    def conversation(self) -> Conversation:
        """system (format and example) → user (the question) → assistant (the reference solution)."""
        turns = (Message("system", self.system), Message("user", self.question))
        return Conversation((*turns, Message("assistant", self.solution)))


@dataclass(frozen=True)
class Score:
    """What :func:`score` found: the answer line's format and its correctness (correct implies format)."""

    format: bool
    correct: bool


def _system(example_question: str, example_solution: str) -> str:
    return SYSTEM.format(q=example_question, s=example_solution)


_ADD_PHRASES = (
    "What is {a} + {b}?",
    "Add {a} and {b}.",
    "Compute {a} + {b}.",
    "What is the sum of {a} and {b}?",
)
_ADD_SYSTEM = _system("What is 12 + 7?", "12 + 7 = 19\nAnswer: 19")


def _add(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 19), rng.randint(1, 9)
    q = rng.choice(_ADD_PHRASES).format(a=a, b=b)
    return Problem(q, a + b, f"{a} + {b} = {a + b}\nAnswer: {a + b}", _ADD_SYSTEM)


_ARITH_SYSTEM = _system("What is 12 + 7 - 5?", "12 + 7 = 19\n19 - 5 = 14\nAnswer: 14")


def _arith(rng: random.Random) -> Problem:
    a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
    q = f"What is {a} + {b} - {c}?"
    s = f"{a} + {b} = {a + b}\n{a + b} - {c} = {a + b - c}\nAnswer: {a + b - c}"
    return Problem(q, a + b - c, s, _ARITH_SYSTEM)


_UNITS = (("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("hours", "minutes", 60))
_UNITS += (("kilograms", "grams", 1000), ("minutes", "seconds", 60), ("liters", "milliliters", 1000))
_UNITS += (("days", "hours", 24), ("weeks", "days", 7), ("feet", "inches", 12))
_CONVERT_SYSTEM = _system(
    "How many grams are in 3 kilograms?", "3 kilograms is 3 × 1000 = 3000 grams.\nAnswer: 3000"
)


def _convert(rng: random.Random) -> Problem:
    big, small, factor = rng.choice(_UNITS)
    x = rng.randint(2, 99)
    q = f"How many {small} are in {x} {big}?"
    s = f"{x} {big} is {x} × {factor} = {x * factor} {small}.\nAnswer: {x * factor}"
    return Problem(q, x * factor, s, _CONVERT_SYSTEM)


_TOTAL_SYSTEM = _system(
    "Add these numbers in order, keeping a running total: 12, 7, 25.",
    "Step 1: 12 + 7 = 19\nStep 2: 19 + 25 = 44\nAnswer: 44",
)
TOTAL_COUNT = (6, 10)  # numbers per ``total`` problem: 5–9 worked lines


def _total(rng: random.Random) -> Problem:
    xs = [rng.randint(10, 99) for _ in range(rng.randint(*TOTAL_COUNT))]
    q = f"Add these numbers in order, keeping a running total: {', '.join(map(str, xs))}."
    lines, t = [], xs[0]
    for i, x in enumerate(xs[1:], 1):
        lines.append(f"Step {i}: {t} + {x} = {t + x}")
        t += x
    return Problem(q, t, "\n".join([*lines, f"Answer: {t}"]), _TOTAL_SYSTEM)


_TASKS: dict[str, Callable[[random.Random], Problem]] = {
    "add": _add,
    "arith": _arith,
    "convert": _convert,
    "total": _total,
}
# problems in one task source: distinct, and inside each task's space (add 684, convert 882 questions)
POOL_SIZES = {"add": 640, "arith": 4096, "convert": 640, "total": 4096}
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


def question_of(conv: Conversation) -> str:
    """A task conversation's question: its first user turn."""
    return next(m.content for m in conv.messages if m.role == "user")


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


def last_integer(text: str) -> int | None:
    found = INT_RE.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def score(answer: int, text: str, finished: bool) -> Score:
    """The format and correctness of response ``text`` to a problem whose answer is ``answer``."""
    if not finished:
        return Score(False, False)
    value = parse_answer(text)
    formatted = value is not None
    if value is None:
        value = last_integer(text)
    return Score(formatted, value is not None and value == answer)
