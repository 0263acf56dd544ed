"""The monitoring row of one RL step, kept apart from its sinks (``monitor/sinks.py``).

A :class:`StepRow` is built from the RL job's ``StepReport`` (its metrics as sent), the sidecar's estimated
acceptance of the published ("adapted") and frozen drafts on that step's freshly tapped records, and the
sidecar's counters (:class:`SidecarStats`).  :meth:`StepRow.to_dict` is the ``monitor.jsonl`` line;
:meth:`StepRow.series` the scalars logged to wandb; the Prometheus sink sets one gauge per numeric field.
Every key is optional to readers (``monitor/live.py``, ``monitor/report.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from draft_align.wire.messages import StepReport

# the verify modes a row's estimates are made under, and the suffix of their keys
ROW_MODES: tuple[tuple[str, str], ...] = (("greedy_draft", ""), ("probabilistic", "_prob"))


def estimate_key(name: str, mode: str) -> str:
    """The row key of draft ``name``'s estimated mean acceptance length under verify mode ``mode``."""
    return f"accept_est_{name}{dict(ROW_MODES)[mode]}"


def row_estimates(
    drafts: Mapping[str, Any], estimate: Callable[[Any, str], Mapping[str, Any]]
) -> dict[str, float]:
    """The :attr:`StepRow.estimates` of the named drafts: ``estimate(draft, mode)``
    (:func:`~draft_align.monitor.tapped_estimate.estimate_records` on the step's records) under each of ``ROW_MODES``."""
    out: dict[str, float] = {}
    for name, draft in drafts.items():
        for mode, suffix in ROW_MODES:
            est = estimate(draft, mode)
            out[estimate_key(name, mode)] = est["acceptance_length_est"]
            out.update({f"accept_est_r{i}_{name}{suffix}": r for i, r in enumerate(est["per_position_est"])})
            for b in est.get("by_response_position") or ():  # all-starts length by position in the response
                if b["length"] is not None:
                    out[position_key(name, mode, b["from"])] = b["length"]
    return out


def position_key(name: str, mode: str, start: int) -> str:
    """The row key of draft ``name``'s estimated acceptance length on chains whose first draft lies in the
    response-position bucket starting at ``start`` (``draft_align.acceptance.RESPONSE_POSITION_EDGES``)."""
    return f"accept_est_pos{start}_{name}{dict(ROW_MODES)[mode]}"


@dataclass(frozen=True)
class SidecarStats:
    """The sidecar's progress and counters at one moment (cumulative since its first start unless noted)."""

    draft_version: int  # newest published version (0 = the starting draft)
    draft_policy_version: int  # the policy version that version was trained up to (−1: none)
    buffer_tokens: int
    buffer_fill: float  # replay buffer tokens / capacity, 0..1
    train_steps: int
    trained_tokens: int
    train_tokens_per_s: float | None  # this process's training throughput (None before the first step)
    ingest_tokens_per_s: float | None  # this process's ingest throughput (None before the first batch)
    ingested_tokens: int
    wire_nonfinite: int  # sequences dropped for NaN/Inf states
    wire_mismatched: int  # messages for another draft/target shape, or out of order
    nonfinite_steps: int  # optimizer steps skipped for a non-finite loss
    nonfinite_heads: int  # HeadSyncs ignored for non-finite or out-of-range rows
    gate_rejections: int
    restarts: int
    # heads dropped after sidecar.train.max_consecutive_nonfinite non-finite steps in a row
    nonfinite_alarms: int = 0
    held_dropped: int = (
        0  # tapped records left out of their step's estimate (bound reached; they still train)
    )
    rl_restarts: int = 0  # HeadSync policy-version regressions, handled as RL restarts
    old_version_batches: int = 0  # TapBatches older than the head in use (kept under the version they name)
    untapped_heads: int = 0  # HeadSyncs replaced before any TapBatch of their version came
    reports_without_taps: int = 0  # StepReports of steps no record arrived for (rows without estimates)
    publish_failures: int = 0  # publishes/checkpoints that failed (disk full, export error); retried later
    untrainable_records: int = 0  # tapped records without a trainable target (response before position 2)
    version_overflows: int = 0  # messages refused: their policy version would pass the wire's int64
    rejected: Mapping[str, int] = field(default_factory=dict)  # wire rejections by reason (this process)
    train_state: str = "training"  # sidecar.trigger.when: training | settling | idle (always: training)
    waiting_for: str | None = None  # why the sidecar is not training now (None: it is)
    drift_triggers: int = 0  # idle → training transitions of the drift trigger (this process)
    trained_policy_version: int = -1  # the newest policy version a training batch came from (−1: none yet)
    # since the previous row: the share of the loop's wall time spent in optimizer steps, and the share spent
    # waiting, by reason (``waiting_for``'s values: replay cap, min buffer, no head yet, the trigger's, …)
    busy_frac: float | None = None
    wait_shares: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The sidecar's keys of a ``monitor.jsonl`` row."""
        return {
            "sidecar_draft_version": self.draft_version,
            "sidecar_draft_policy_version": self.draft_policy_version,
            "buffer_tokens": self.buffer_tokens,
            "buffer_fill": self.buffer_fill,
            "sidecar_train_steps": self.train_steps,
            "sidecar_trained_tokens": self.trained_tokens,
            "sidecar_train_tokens_per_s": self.train_tokens_per_s,
            "sidecar_ingest_tokens_per_s": self.ingest_tokens_per_s,
            "sidecar_ingested_tokens": self.ingested_tokens,
            "wire_rejected": sum(self.rejected.values()),
            "wire_nonfinite": self.wire_nonfinite,
            "wire_mismatched": self.wire_mismatched,
            "nonfinite_steps": self.nonfinite_steps,
            "nonfinite_heads": self.nonfinite_heads,
            "published_versions": self.draft_version,
            "gate_rejections": self.gate_rejections,
            "sidecar_restarts": self.restarts,
            "nonfinite_alarms": self.nonfinite_alarms,
            "held_dropped": self.held_dropped,
            "rl_restarts": self.rl_restarts,
            "old_version_batches": self.old_version_batches,
            "untapped_heads": self.untapped_heads,
            "reports_without_taps": self.reports_without_taps,
            "publish_failures": self.publish_failures,
            "untrainable_records": self.untrainable_records,
            "version_overflows": self.version_overflows,
            "sidecar_training": int(self.train_state == "training"),  # a number: Prometheus plots it
            "sidecar_train_state": self.train_state,
            "sidecar_waiting_for": self.waiting_for,
            "drift_triggers": self.drift_triggers,
            "sidecar_trained_policy_version": self.trained_policy_version,
            "sidecar_busy_frac": self.busy_frac,
            **{WAIT_FRAC_PREFIX + wait_key(k): v for k, v in self.wait_shares.items()},
        }


WAIT_FRAC_PREFIX = "sidecar_wait_frac_"  # + wait_key(reason): a row's share of loop time waiting for it


def wait_key(reason: str) -> str:
    """A waiting reason as a metric-name suffix (``replay cap`` → ``replay_cap``)."""
    return "".join(c if c.isalnum() else "_" for c in reason.lower()).strip("_")


@dataclass(frozen=True)
class StepRow:
    """One RL step as the monitor sees it.

    ``estimates``: ``accept_est_{adapted,frozen}`` (``greedy_draft``) and ``..._prob`` (``probabilistic``),
    mean acceptance lengths estimated on ``est_records`` records, with their cumulative per-position rates
    ``accept_est_r{i}_{adapted,frozen}[_prob]`` (i < sidecar.gate.k; all absent before the first HeadSync or
    for a step without records).  ``staleness_sidecar`` = policy_version − the published draft's policy
    version.
    """

    time: float  # unix time the row was started
    step: int
    policy_version: int
    rl: Mapping[str, Any]  # the StepReport's metrics, as the RL job sent them
    sidecar: SidecarStats
    estimates: Mapping[str, float] = field(default_factory=dict)
    est_records: int | None = None

    @classmethod
    def from_report(
        cls,
        report: StepReport,
        sidecar: SidecarStats,
        *,
        time: float,
        estimates: Mapping[str, float] | None = None,
        est_records: int | None = None,
    ) -> StepRow:
        return cls(
            time=time,
            step=int(report.step),
            policy_version=int(report.policy_version),
            rl=dict(report.metrics),
            sidecar=sidecar,
            estimates=dict(estimates or {}),
            est_records=est_records,
        )

    @property
    def staleness_sidecar(self) -> int:
        return self.policy_version - self.sidecar.draft_policy_version

    @property
    def train_step(self) -> int:
        """The sidecar's train step: wandb's one monotonic step axis (the RL step is a field of the row)."""
        return self.sidecar.train_steps

    def to_dict(self) -> dict[str, Any]:
        """The ``monitor.jsonl`` line: time, step, policy_version, the RL metrics, the estimates, the sidecar's
        keys (which win over RL metrics of the same name) and ``staleness_sidecar``."""
        row: dict[str, Any] = {"time": self.time, "step": self.step, "policy_version": self.policy_version}
        row.update({k: v for k, v in self.rl.items() if k not in row})
        row.update(self.estimates)
        if self.est_records is not None:
            row["est_records"] = self.est_records
        row.update(self.sidecar.to_dict())
        row["staleness_sidecar"] = self.staleness_sidecar
        return row

    def series(self) -> dict[str, float]:
        """The row's numbers as ``rl/<key>`` scalars (not ``time``), logged at :attr:`train_step`."""
        return {
            f"rl/{k}": v for k, v in self.to_dict().items() if isinstance(v, (int, float)) and k != "time"
        }
