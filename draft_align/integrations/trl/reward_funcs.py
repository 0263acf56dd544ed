"""draft_align's rewards as TRL reward functions (``GRPOTrainer(reward_funcs=...)``).

TRL calls a reward function with the step's ``completions`` (conversational: a list of messages each) and every
other dataset column as a keyword argument; :func:`task_reward` reads the ``answer`` column that
:func:`task_dataset` writes. A completion whose reward cannot be computed gets ``None``, which TRL leaves out of
the group's reward (one bad completion never ends the step), and is logged once per call.
"""

from __future__ import annotations

import logging
from typing import Any

from draft_align.data import tasks
from draft_align.rl.rewards import safe_reward, task

log = logging.getLogger(__name__)


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def _checked(text: str, finished: bool, answer: Any = None) -> float:
    return task(text, finished, int(answer))  # a forged answer column raises here, inside safe_reward


def task_reward(completions: list[Any], answer: list[int], **_: Any) -> list[float | None]:
    """0.2·format + 0.8·correct per completion (``draft_align.rl.rewards.task``); TRL's completions have ended
    (eos or the length cap: a cut one simply lacks its answer line)."""
    out: list[float | None] = []
    errors = []
    for c, a in zip(completions, answer, strict=True):
        value, error = safe_reward(_checked, _text(c), True, a)
        out.append(None if error is not None else value)
        if error is not None:
            errors.append(error)
    if errors:
        log.warning(
            "task reward refused for %d of %d completions (first: %s)", len(errors), len(out), errors[0]
        )
    return out


def task_dataset(source: str, n: int, heldout: int = 64, split_seed: int = 0) -> list[dict[str, Any]]:
    """Rows ``{"prompt": [system, user messages], "answer": int}`` of ``n`` training problems of a task source
    (``task:NAME[:SEED]``), the held-out ones (``split_heldout``, as ``cotrain`` and ``eval``) left out."""
    from draft_align.data import split_heldout

    problems = tasks.task_problems(source)
    train, held = split_heldout(problems, heldout, split_seed)
    tasks.check_disjoint([p.question for p in train], [p.question for p in held])
    rows = []
    for p in train[:n]:
        prompt = [{"role": m.role, "content": m.content} for m in p.conversation().prompt]
        rows.append({"prompt": prompt, "answer": p.answer})
    return rows
