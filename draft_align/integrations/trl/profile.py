"""The stage profile of one TRL optimizer step (:class:`~draft_align.monitor.step_profile.StepProfile`), timed
from what the adapter already wraps and from TRL's callback hooks.

The step runs from ``on_step_begin`` to ``on_step_end`` (TRL's batch fetch before it and its logging and
saving after it are outside).  Wrapped regions, each charged with its own time minus the regions nested in it
and minus the Tap's seconds spent inside it:

- ``trainer.training_step`` → ``train`` (forward, backward; with TRL's ``_prepare_inputs`` nested in it);
- ``_generate_and_score_completions`` → ``data`` (TRL's tokenisation, rewards, advantages: what is left once
  generation, weight sync and the log-prob passes nested in it are taken out);
- ``_get_per_token_logps_and_entropies`` → ``logprob`` inside generation (the old and reference passes),
  ``train`` otherwise (the training forward);
- ``_generate_single_turn`` → ``generation`` (TRL's own generation; draft_align's ``rollout_func`` reports its
  engine's stages with :meth:`StageTimer.record` instead) and ``vllm_generation.sync_weights`` →
  ``weight_sync``;
- ``on_pre_optimizer_step`` → ``on_optimizer_step`` → ``train`` (the optimizer step);
- the callback's draft pick-up → ``draft_refresh``.

Everything else inside the step (gradient clipping, TRL's bookkeeping) is ``other``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

from draft_align.monitor.step_profile import STAGES, StepProfile


class StageTimer:
    """Exclusive seconds per stage within one step; ``tap_seconds()``: the Tap's running total of seconds
    (charged to the ``tap`` stage by the caller, and taken out of the region it ran in)."""

    def __init__(self, tap_seconds: Callable[[], float] = lambda: 0.0) -> None:
        self.tap_seconds = tap_seconds
        self.seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self._stack: list[list[float]] = []  # per open region: [nested seconds, nested Tap seconds]
        self._open: dict[
            str, tuple[str, float, float]
        ] = {}  # regions opened by one hook and closed by another
        self._step_t0: float | None = None
        self.in_generation = False
        self._originals: list[tuple[Any, str, Any]] = []

    # ----------------------------------------------------------------- regions
    def begin_step(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self._stack.clear()
        self._step_t0 = time.perf_counter()

    def _enter(self) -> tuple[float, float]:
        self._stack.append([0.0, 0.0])
        return time.perf_counter(), self.tap_seconds()

    def _exit(self, stage: str, t0: float, tap0: float) -> None:
        nested, nested_tap = self._stack.pop()
        total = time.perf_counter() - t0
        tap = self.tap_seconds() - tap0
        self.seconds[stage] += max(total - nested - (tap - nested_tap), 0.0)
        if self._stack:
            self._stack[-1][0] += total
            self._stack[-1][1] += tap

    @contextlib.contextmanager
    def region(self, stage: str | Callable[[], str]) -> Iterator[None]:
        """Charge the block's exclusive time to ``stage`` (a callable: decided when the block ends)."""
        t0, tap0 = self._enter()
        try:
            yield
        finally:
            self._exit(stage() if callable(stage) else stage, t0, tap0)

    def open(self, key: str, stage: str) -> None:
        """Start a region that :meth:`close` ends (two callback hooks)."""
        t0, tap0 = self._enter()
        self._open[key] = (stage, t0, tap0)

    def close(self, key: str) -> None:
        if key in self._open:
            stage, t0, tap0 = self._open.pop(key)
            self._exit(stage, t0, tap0)

    def record(self, stage: str, seconds: float) -> None:
        """``seconds`` measured elsewhere inside the current region: charged to ``stage``, taken from the region."""
        seconds = max(float(seconds), 0.0)
        self.seconds[stage] += seconds
        if self._stack:
            self._stack[-1][0] += seconds

    def end_step(self, tap_s: float) -> StepProfile | None:
        """The step's profile (``tap_s``: the Tap's seconds of the step); None when no step was begun."""
        if self._step_t0 is None:
            return None
        step_s = time.perf_counter() - self._step_t0
        self._step_t0 = None
        return StepProfile(step_s, {**self.seconds, "tap": tap_s})

    # ----------------------------------------------------------------- TRL's methods
    def _wrap(self, owner: Any, name: str, stage: str | Callable[[], str], generation: bool = False) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            was = self.in_generation
            self.in_generation = was or generation
            try:
                with self.region(stage):
                    return original(*args, **kwargs)
            finally:
                self.in_generation = was

        self._originals.append((owner, name, original))
        setattr(owner, name, timed)

    def install(self, trainer: Any) -> None:
        """Wrap ``trainer``'s methods (after the Tap installed its own, so its seconds are inside these)."""
        self._wrap(trainer, "training_step", "train")
        self._wrap(trainer, "_generate_and_score_completions", "data", generation=True)
        self._wrap(
            trainer,
            "_get_per_token_logps_and_entropies",
            lambda: "logprob" if self.in_generation else "train",
        )
        self._wrap(trainer, "_generate_single_turn", "generation")
        vg = getattr(trainer, "vllm_generation", None)
        if getattr(trainer, "use_vllm", False) and vg is not None:
            self._wrap(vg, "sync_weights", "weight_sync")

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()
