"""How often the sidecar should train and publish: a cadence chosen from a run's measured cadence table.

The table (``<run>/cadence.json``) comes from replaying the run's recorded wire into one fresh sidecar per
cadence (``benchmarks/adapt_playback.py --run RUN --arms every1,every5,never,drift``): the same taps in the same
order, each arm training on its own schedule.  Per arm it holds the gain of the served draft over the frozen one
(the sidecar's estimate on each step's fresh taps, paired by step over the last half: mean and standard error)
and the CPU seconds the arm spent training.

:func:`recommend` applies one rule: when training after every step does not beat the frozen draft (the lower
end of its 95% interval ≤ 0), never train; otherwise the arm with the least training CPU that keeps at least
:data:`KEEP` of the every-step gain.  The choice is *measured* on the run's own taps, not projected.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

CADENCE_FILE = "cadence.json"
KEEP = 0.9  # share of the every-step gain a cheaper cadence must keep
EVERY_STEP = "every1"
NEVER = "never"


class CadenceError(ValueError):
    """A cadence table that cannot be read or lacks the every-step arm."""


@dataclass(frozen=True)
class CadenceArm:
    """One cadence measured on a run's recorded taps."""

    name: str
    settings: str  # what the arm does, in words
    gain: float  # served − frozen acceptance length, mean over the last half (paired by step)
    gain_se: float | None  # its standard error
    train_cpu_s: float  # CPU seconds spent training (and publishing)
    cpu_s: float  # CPU seconds in all (ingest and estimates included)
    published: int


@dataclass(frozen=True)
class Recommendation:
    arm: CadenceArm
    reason: str


def save_table(run: Path, arms: Sequence[CadenceArm]) -> Path:
    """Write ``<run>/cadence.json`` whole (a temporary file renamed over it)."""
    path = run / CADENCE_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps([asdict(a) for a in arms], indent=1))
    tmp.replace(path)
    return path


def load_table(run: Path) -> list[CadenceArm] | None:
    """The run's cadence table, None when it has none; CadenceError (one line) for a malformed one."""
    path = run / CADENCE_FILE
    if not path.is_file():
        return None
    try:
        arms = [CadenceArm(**a) for a in json.loads(path.read_text())]
    except (ValueError, TypeError) as e:
        raise CadenceError(f"{path}: not a cadence table ({e})") from None
    if not any(a.name == EVERY_STEP for a in arms):
        raise CadenceError(f"{path}: no {EVERY_STEP!r} arm to compare the others with")
    return arms


def recommend(arms: Sequence[CadenceArm], keep: float = KEEP) -> Recommendation:
    """The module docstring's rule."""
    ref = next((a for a in arms if a.name == EVERY_STEP), None)
    if ref is None:
        raise CadenceError(f"a cadence table needs the {EVERY_STEP!r} arm")
    low = ref.gain - 1.96 * (ref.gain_se if ref.gain_se is not None and math.isfinite(ref.gain_se) else 0.0)
    if ref.gain <= 0 or low <= 0:
        never = next((a for a in arms if a.name == NEVER), ref)
        return Recommendation(
            never,
            f"training after every step gains {ref.gain:+.3f} tokens per verify over the frozen draft, not above "
            "0 at 95%: the frozen draft holds on this workload; train only if acceptance falls",
        )
    keepers = [a for a in arms if a.name != NEVER and a.gain >= keep * ref.gain]
    best = min(keepers, key=lambda a: (a.train_cpu_s, a.name != EVERY_STEP))
    share = best.train_cpu_s / ref.train_cpu_s if ref.train_cpu_s > 0 else math.nan
    return Recommendation(
        best,
        f"{best.name} ({best.settings}) keeps {best.gain / ref.gain:.0%} of the every-step gain "
        f"({best.gain:+.3f} vs {ref.gain:+.3f} tokens per verify) for {share:.0%} of its training CPU "
        f"({best.train_cpu_s:.0f} s vs {ref.train_cpu_s:.0f} s); the cheapest arm keeping ≥ {keep:.0%}",
    )
