"""Rule-based rewards on a decoded response.

Each reward is ``f(text, finished) -> float`` where ``text`` is the decoded response (special tokens
skipped) and ``finished`` says whether it ended with an eos token (not cut at ``max_new_tokens``):

- ``enthusiasm``  min(#'!', 4) / 4  − 0.5·[not finished]                          ∈ [−0.5, 1]
- ``uppercase``   #uppercase letters / #letters (0 with no letter) − 0.5·[not finished] ∈ [−0.5, 1]
- ``brevity``     1 − min(len(text), 400) / 400 if finished else 0   (length in characters) ∈ [0, 1]
"""

from __future__ import annotations

from collections.abc import Callable

RewardFn = Callable[[str, bool], float]

ENTHUSIASM_CAP = 4  # exclamation marks beyond this earn nothing more
BREVITY_CHARS = 400  # responses this long or longer earn no brevity reward
UNFINISHED_PENALTY = 0.5


def enthusiasm(text: str, finished: bool) -> float:
    """min(count('!'), 4) / 4, minus 0.5 when the response did not end with eos."""
    return min(text.count("!"), ENTHUSIASM_CAP) / ENTHUSIASM_CAP - (0.0 if finished else UNFINISHED_PENALTY)


def uppercase(text: str, finished: bool) -> float:
    """Fraction of letters that are uppercase (0 with no letter), minus 0.5 when unfinished."""
    letters = [c for c in text if c.isalpha()]
    frac = sum(c.isupper() for c in letters) / len(letters) if letters else 0.0
    return frac - (0.0 if finished else UNFINISHED_PENALTY)


def brevity(text: str, finished: bool) -> float:
    """1 − min(len(text), 400)/400 for a finished response (in characters); 0 when unfinished."""
    if not finished:
        return 0.0
    return 1.0 - min(len(text), BREVITY_CHARS) / BREVITY_CHARS


REWARD_NAMES: tuple[str, ...] = ("enthusiasm", "uppercase", "brevity")


def reward_fn(name: str) -> RewardFn:
    """The reward called ``name``; ValueError listing the known names otherwise."""
    if name == "enthusiasm":
        return enthusiasm
    if name == "uppercase":
        return uppercase
    if name == "brevity":
        return brevity
    raise ValueError(f"unknown reward {name!r}; expected one of {list(REWARD_NAMES)}")
