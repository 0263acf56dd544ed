"""The sidecar's progress: :class:`SidecarState` (JSON beside the trainer checkpoint) and its throughput."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from draft_align.conventions import MAX_VERSION
from draft_align.monitor.rows import SidecarStats
from draft_align.sidecar.trigger import DriftTrigger

log = logging.getLogger(__name__)


class StateError(ValueError):
    """A ``state.json`` that cannot be read (not JSON, not an object, a field of the wrong type)."""


class StateRangeError(ValueError):
    """A readable ``state.json`` that cannot be continued: a version outside the wire's range (the next
    publish or policy version could not be announced).  Refused at start, nothing written."""


# field → (lowest, highest) value a state that can be continued holds
_VERSION_RANGES: dict[str, tuple[int, int]] = {
    "published_version": (0, MAX_VERSION - 1),  # the next publish is published_version + 1
    "published_policy_version": (-1, MAX_VERSION),
    "newest_policy_version": (-1, MAX_VERSION),
    "trained_policy_version": (-1, MAX_VERSION),
    "head_policy_version": (-1, MAX_VERSION),
    "policy_offset": (0, MAX_VERSION),
}


@dataclass
class SidecarState:
    """Everything about the sidecar's progress besides tensors (JSON, beside the trainer checkpoint)."""

    published_version: int = 0  # newest version this sidecar published (0 = the starting draft)
    published_policy_version: int = -1
    newest_policy_version: int = -1
    trained_policy_version: int = -1  # the newest policy version a training batch came from
    head_policy_version: int = -1
    train_steps: int = 0
    trained_tokens: int = 0
    ingested_tokens: int = 0
    buffered_tokens: int = 0  # tokens that entered the replay buffer (the replay ratio's denominator)
    ingested_messages: int = 0
    nonfinite_sequences: int = 0
    nonfinite_steps: int = 0
    nonfinite_heads: int = 0  # HeadSyncs rejected: non-finite or out-of-range rows / norm
    nonfinite_alarms: int = 0  # heads dropped after max_consecutive_nonfinite non-finite steps in a row
    held_dropped_records: int = (
        0  # tapped records left out of their step's estimate (bound; they still train)
    )
    held_dropped_tokens: int = 0
    rl_restarts: int = 0  # HeadSync version regressions (the RL job restarted)
    old_version_batches: int = (
        0  # TapBatches older than the head in use (trained under the version they name)
    )
    untapped_heads: int = 0  # HeadSyncs replaced before any TapBatch of their version came
    reports_without_taps: int = 0  # StepReports of steps no record arrived for (a row without estimates)
    untrainable_records: int = 0  # records whose responses start before position 2: dropped at ingest
    version_overflows: int = 0  # HeadSyncs/TapBatches refused: their policy version would pass MAX_VERSION
    policy_offset: int = 0  # added to every policy version the RL job sends (raised at each RL restart)
    publish_failures: int = 0  # publishes or checkpoints that failed (disk full, export error)
    gate_rejections: int = 0
    foreign_messages: int = 0
    mismatched_messages: int = 0
    monitor_rows: int = 0
    restarts: int = 0
    last_step_report: int = -1
    done: bool = False
    lora_base_dir: str | None = None  # adapt=lora: the published draft the adapters are trained over
    rejected: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> SidecarState:
        """The state saved at ``path``; fields this version does not know are logged and ignored (a newer
        sidecar wrote them), missing ones take their defaults; StateError when it cannot be read."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StateError(f"{path}: unreadable sidecar state ({e})") from e
        if not isinstance(raw, dict):
            raise StateError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            log.warning("%s: unknown fields %s ignored (written by another version?)", path, unknown)
        out = cls()
        for name, value in raw.items():
            if name not in known:
                continue
            want = (str, type(None)) if name == "lora_base_dir" else type(getattr(out, name))
            if not isinstance(value, want) or (isinstance(value, bool) and want is int):
                raise StateError(f"{path}: field {name!r} is {value!r} ({type(value).__name__}): wrong type")
            setattr(out, name, value)
        for name, (lo, hi) in _VERSION_RANGES.items():
            value = getattr(out, name)
            if not lo <= value <= hi:
                shown = (
                    str(value) if len(str(value)) <= 24 else f"{str(value)[:12]}…({len(str(value))} digits)"
                )
                raise StateRangeError(
                    f"{path}: {name} {shown} is outside [{lo}, {hi}] (versions must fit the wire's int64): this "
                    f"sidecar state cannot be continued; move {Path(path).parent} aside to restart the sidecar "
                    f"from the run's newest published draft, or start a new run"
                )
        return out

    def save(self, path: Path) -> None:
        """Atomically (a temp file in the same folder, then rename)."""
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        try:
            tmp.write_text(json.dumps(asdict(self)))
            os.replace(tmp, path)
        except BaseException:  # a full disk: no temp file stays behind
            tmp.unlink(missing_ok=True)
            raise


@dataclass
class Backoff:
    """Retry spacing after a failed publish or checkpoint (a full disk): ``first_s``, doubling per failure in
    a row, at most ``max_s``; one success resets it."""

    first_s: float = 5.0
    max_s: float = 300.0
    failures: int = 0
    retry_at: float = 0.0  # time.monotonic() before which nothing is retried

    def ready(self) -> bool:
        return time.monotonic() >= self.retry_at

    def fail(self) -> float:
        """Record a failure; returns the delay until the next attempt (s)."""
        self.failures += 1
        delay = min(self.max_s, self.first_s * 2 ** (self.failures - 1))
        self.retry_at = time.monotonic() + delay
        return delay

    def ok(self) -> None:
        self.failures, self.retry_at = 0, 0.0


@dataclass
class Rates:
    """This process's throughput and where its loop's time went (not checkpointed: it restarts with the
    process).  ``loop_s``: wall time of the loop's iterations; ``wait_s``: the part of it without an optimizer
    step, by the reason training waited."""

    train_tokens: float = 0.0
    train_s: float = 0.0
    ingest_tokens: float = 0.0
    ingest_s: float = 0.0
    loop_s: float = 0.0
    wait_s: dict[str, float] = field(default_factory=dict)
    # (loop_s, train_s, wait_s) at the last window
    _mark: tuple[float, float, dict[str, float]] = field(default_factory=lambda: (0.0, 0.0, {}))

    def waited(self, reason: str, seconds: float) -> None:
        self.wait_s[reason] = self.wait_s.get(reason, 0.0) + seconds

    def window(self) -> tuple[float | None, dict[str, float]]:
        """(share of loop time in optimizer steps, share waiting by reason) since the previous call (None,
        {} when no loop time passed); starts the next window."""
        loop0, train0, wait0 = self._mark
        dt = self.loop_s - loop0
        self._mark = (self.loop_s, self.train_s, dict(self.wait_s))
        if dt <= 0:
            return None, {}
        shares = {k: (v - wait0.get(k, 0.0)) / dt for k, v in self.wait_s.items() if v > wait0.get(k, 0.0)}
        return min(1.0, (self.train_s - train0) / dt), shares

    @property
    def train_tokens_per_s(self) -> float | None:
        return self.train_tokens / self.train_s if self.train_s else None

    @property
    def ingest_tokens_per_s(self) -> float | None:
        return self.ingest_tokens / self.ingest_s if self.ingest_s else None


def sidecar_stats(
    state: SidecarState,
    buffer: Mapping[str, Any],
    rates: Rates,
    rejected: Mapping[str, int],
    *,
    trigger: DriftTrigger | None = None,
    waiting: str | None = None,
    window: bool = False,
) -> SidecarStats:
    """The monitor's view of the sidecar (``buffer``: ``ReplayBuffer.stats()``; ``rejected``: by reason;
    ``waiting``: why it is not training, None while it is; ``window``: with the busy / waiting shares since the
    previous windowed call, which starts the next window — the per-step rows)."""
    busy, shares = rates.window() if window else (None, {})
    return SidecarStats(
        trained_policy_version=state.trained_policy_version,
        busy_frac=busy,
        wait_shares=shares,
        train_state=trigger.state.value if trigger is not None else "training",
        waiting_for=waiting,
        drift_triggers=trigger.triggers if trigger is not None else 0,
        draft_version=state.published_version,
        draft_policy_version=state.published_policy_version,
        buffer_tokens=buffer["tokens"],
        buffer_fill=buffer["fill"],
        train_steps=state.train_steps,
        trained_tokens=state.trained_tokens,
        train_tokens_per_s=rates.train_tokens_per_s,
        ingest_tokens_per_s=rates.ingest_tokens_per_s,
        ingested_tokens=state.ingested_tokens,
        wire_nonfinite=state.nonfinite_sequences,
        wire_mismatched=state.mismatched_messages,
        nonfinite_steps=state.nonfinite_steps,
        nonfinite_heads=state.nonfinite_heads,
        gate_rejections=state.gate_rejections,
        restarts=state.restarts,
        nonfinite_alarms=state.nonfinite_alarms,
        held_dropped=state.held_dropped_records,
        rl_restarts=state.rl_restarts,
        old_version_batches=state.old_version_batches,
        untapped_heads=state.untapped_heads,
        reports_without_taps=state.reports_without_taps,
        untrainable_records=state.untrainable_records,
        version_overflows=state.version_overflows,
        publish_failures=state.publish_failures,
        rejected=dict(rejected),
    )
