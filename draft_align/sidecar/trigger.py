"""When the sidecar trains: always, or only when the published draft drifts (``sidecar.trigger.when``).

``always``: the sidecar trains whenever it has a head and data (bounded by ``max_replay_ratio``).

``drift``: the sidecar trains while training pays, then stops and watches the published draft:

- **still improving**: while the publishes of this training burst beat the drafts they replaced by at least
  ``drift_min_gain`` on average (acceptance length, paired on the gate's hold-out, over the last
  ``drift_window`` publishes; a burst makes at least that many), the sidecar keeps training: a draft still
  catching up with the policy (an under-trained warm-start, a policy that moved a lot) is not "holding";
- **settling**: the first ``drift_window`` per-step estimates of the published draft's acceptance length on
  fresh taps (the estimates every StepReport already gets, in the gate's verify mode) give its level at
  publication, ``baseline``;
- **idle**: training resumes when the mean of the last ``drift_window`` estimates falls below
  ``1 + (1 − drift_tolerance) · (baseline − 1)`` (the acceptance *gain* over plain decoding lost more than
  ``drift_tolerance`` of itself), or when a HeadSync moved the head rows by more than
  ``drift_head_threshold`` relative to the head at publication: ``‖S(W) − S(W₀)‖ / ‖S(W₀)‖`` with
  ``S(W) = W·R`` a fixed random projection (R [H, 64], seed 0) of the rows W [Vd, H], which keeps the
  comparison cheap and memory-free for large vocabularies (a Johnson–Lindenstrauss sketch of the change);
- **training** until the next publish.

The trigger only decides; the loop asks :meth:`DriftTrigger.wants_training` before each step and reports
:attr:`state` and :attr:`reason` in its monitoring row.  Verl-SpeCo-style fixed-interval training is
``always`` with ``publish.every_s``.
"""

from __future__ import annotations

import enum
import logging
import statistics
from collections import deque

import torch

log = logging.getLogger(__name__)

SKETCH_DIM = 64


class TriggerState(enum.Enum):
    TRAINING = "training"
    SETTLING = "settling"  # idle after a publish, measuring the published draft's level on fresh taps
    IDLE = "idle"  # idle, the published draft holds


def head_sketch(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [Vd, H] · R [H, 64] in fp32 (R: a fixed Gaussian projection, seed 0, scaled by 1/√64)."""
    g = torch.Generator().manual_seed(0)
    r = torch.randn(rows.shape[1], SKETCH_DIM, generator=g) / SKETCH_DIM**0.5
    return rows.float().cpu() @ r


def head_change(sketch: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative change ‖sketch − ref‖ / ‖ref‖ (∞ for a zero reference)."""
    den = float(ref.norm())
    return float((sketch - ref).norm()) / den if den > 0 else float("inf")


class DriftTrigger:
    """The state machine of the module docstring.  ``mode`` ``always`` never leaves TRAINING."""

    def __init__(
        self, mode: str, *, tolerance: float, head_threshold: float, window: int, min_gain: float
    ) -> None:
        if mode not in ("always", "drift"):
            raise ValueError(f"trigger {mode!r}: must be always or drift")
        if not 0.0 < tolerance < 1.0 or head_threshold <= 0.0 or window < 1 or not min_gain >= 0.0:
            raise ValueError(
                "drift_tolerance must be in (0, 1), drift_head_threshold > 0, drift_window ≥ 1, drift_min_gain ≥ 0"
            )
        self.mode = mode
        self.min_gain = float(min_gain)
        self.tolerance = float(tolerance)
        self.head_threshold = float(head_threshold)
        self.window = int(window)
        self.state = TriggerState.TRAINING
        self.reason = "no draft published yet"
        self.baseline: float | None = None
        self.recent: deque[float] = deque(maxlen=self.window)
        self._head_ref: torch.Tensor | None = None
        self.gains: deque[float] = deque(maxlen=self.window)  # this burst's publish gains
        self.triggers = 0  # idle → training transitions

    def wants_training(self) -> bool:
        return self.state is TriggerState.TRAINING

    def threshold(self) -> float | None:
        """The acceptance length below which training resumes (None before the baseline is known)."""
        return None if self.baseline is None else 1.0 + (1.0 - self.tolerance) * (self.baseline - 1.0)

    def on_publish(self, rows: torch.Tensor | None, gain: float | None = None) -> None:
        """A new version was published (trained on head ``rows``; ``gain``: how much it beat the draft it replaced,
        paired on the gate's hold-out): keep training while this burst's last ``window`` gains average ≥ ``min_gain``
        (or it has made fewer publishes than that), else settle and measure it; no ``gain``: settle."""
        if self.mode == "always":
            return
        self._head_ref = head_sketch(rows) if rows is not None else None
        self.baseline = None
        self.recent.clear()
        if gain is not None:
            self.gains.append(float(gain))
            paying = statistics.fmean(self.gains)
            if len(self.gains) < self.window or paying >= self.min_gain:
                self.state = TriggerState.TRAINING
                self.reason = (
                    f"still improving: publishes gain +{paying:.3f} on average "
                    f"(idle once {self.window} average < {self.min_gain:g})"
                )
                return
        self.gains.clear()
        self.state = TriggerState.SETTLING
        self.reason = "settling: measuring the new draft on fresh taps"

    def on_estimate(self, accept_len: float | None) -> None:
        """The published draft's estimated acceptance length on one RL step's fresh taps (None: none)."""
        if self.mode == "always" or accept_len is None or self.state is TriggerState.TRAINING:
            return
        self.recent.append(float(accept_len))
        mean = statistics.fmean(self.recent)
        if self.state is TriggerState.SETTLING:
            if len(self.recent) >= self.window:
                self.baseline = mean
                self.state = TriggerState.IDLE
                self.reason = f"idle: the draft holds {mean:.3f} (train below {self.threshold():.3f})"
            return
        limit = self.threshold()
        assert limit is not None
        if len(self.recent) >= self.window and mean < limit:
            self._train(f"acceptance fell: {mean:.3f} < {limit:.3f} (published at {self.baseline:.3f})")
        else:
            self.reason = f"idle: the draft holds {mean:.3f} (train below {limit:.3f})"

    def on_head(self, rows: torch.Tensor) -> None:
        """A HeadSync replaced the head rows."""
        if self.mode == "always" or self.state is TriggerState.TRAINING or self._head_ref is None:
            return
        change = head_change(head_sketch(rows), self._head_ref)
        if change > self.head_threshold:
            self._train(f"head moved {change:.3f} > {self.head_threshold:.3f} since the publish")

    def _train(self, why: str) -> None:
        self.state = TriggerState.TRAINING
        self.gains.clear()
        self.reason = why
        self.triggers += 1
        log.info("drift trigger: training (%s)", why)
