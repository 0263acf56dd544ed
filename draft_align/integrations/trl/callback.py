"""The ``transformers.TrainerCallback`` that runs draft_align beside a TRL ``GRPOTrainer``.

Given the trainer at construction (as TRL's own callbacks are): ``on_train_begin`` starts (or connects to) the
sidecar, the wire, the drafts, the Tap and the engine; ``on_step_begin`` picks up the newest published draft
(between steps, before generation) and starts the step's stage profile
(:mod:`~draft_align.integrations.trl.profile`), which ``on_pre_optimizer_step``/``on_optimizer_step`` also
feed; ``on_step_end`` ships the step's taps and sends the StepReport;
``on_train_end`` stops cleanly.  draft_align's metrics go into TRL's own metric store under ``draft_align/…``
(a handful by default, every one with ``logging.trl_metrics: full``), so ``trainer.log`` averages them with TRL's
and every ``report_to`` backend gets them.  Nothing here blocks on the sidecar: a dead sidecar means dropped
(counted) taps and the last draft staying in use.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Protocol

from transformers import TrainerCallback

log = logging.getLogger(__name__)

METRIC_PREFIX = "draft_align/"


class Session(Protocol):
    """What the callback drives (:class:`~draft_align.integrations.trl.session.DraftAlign`)."""

    @property
    def run_dir(self) -> Path: ...

    def start(self, trainer: Any) -> None: ...

    def refresh(self) -> bool: ...

    def optimizer_step(self, begin: bool) -> None: ...

    def end_step(self, trainer: Any) -> dict[str, float | None]: ...

    def logged(self, metrics: dict[str, float | None]) -> dict[str, float | None]: ...

    def stop(self) -> int | None: ...


class DraftAlignCallback(TrainerCallback):
    """See the module docstring; build it with :meth:`DraftAlign.callback`."""

    def __init__(self, session: Session, trainer: Any) -> None:
        self.session = session
        self.trainer = trainer
        self.callback_s = 0.0  # time TRL spent in this callback during the current step
        self.sidecar_rc: int | None = None

    def _log(self, metrics: dict[str, Any]) -> None:
        store = self.trainer._metrics["train"]
        for k, v in metrics.items():
            if isinstance(v, int | float) and v == v:
                store[f"{METRIC_PREFIX}{k}"].append(float(v))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        self.session.start(self.trainer)
        log.info(
            "draft_align: started beside TRL in %.1f s (run folder %s)",
            time.perf_counter() - t0,
            self.session.run_dir,
        )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        self.session.refresh()
        self.callback_s = time.perf_counter() - t0

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.optimizer_step(True)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.optimizer_step(False)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        metrics = self.session.end_step(self.trainer)
        self.callback_s += time.perf_counter() - t0
        metrics["callback_s"] = self.callback_s
        self._log(self.session.logged(metrics))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.sidecar_rc = self.session.stop()
