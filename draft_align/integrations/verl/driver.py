"""draft_align on verl's driver (the process that runs ``RayPPOTrainer.fit()``): the sidecar on its own Ray
resources, step reports over the wire, drafts picked up and pushed into the rollout servers, and draft_align's
metrics in verl's own tracking.

verl's ``fit()`` has no callbacks; :meth:`VerlDraftAlign.install` wraps trainer methods, as a trainer subclass
would:

- ``trainer.checkpoint_manager.update_weights(global_steps)``: the step boundary, after the policy is synced
  into the rollout servers (awake again).  There :meth:`VerlDraftAlign.step_end` sends the StepReport, picks up
  the newest verified draft (:class:`~draft_align.rl.drafts.DraftSource`, never waits), hands it to the
  :class:`~draft_align.engines.vllm.refresher.DraftRefresher` of the rollout servers when one is attached, and
  returns its ``draft_align/…`` metrics;
- where those metrics join the step's own, so verl's ``Tracking`` logs them with the step: the ``metrics``
  dict ``_compute_metrics`` fills (verl's TransferQueue trainer, ``trainer.use_v1``, verl 0.9's default), or
  the actor metrics dict ``_update_actor`` returns (``RayPPOTrainer``), which ``fit()`` reduces after the sync.

The sidecar is the Ray integration's :class:`~draft_align.integrations.ray.client.RaySidecar` (one actor with
``ray.num_cpus``/``num_gpus``/``resources``, or a Ray Train gang), started or re-attached by the run's name; the
actor workers find its endpoints through the run's registry.  A sidecar that is slow or gone never stops verl:
each Ray call is bounded, reports are dropped and counted, and the last verified draft keeps serving; the step
boundary logs one ERROR line when it first sees the sidecar gone (and a warning if it answers again).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draft_align.config import RESOLVED_RECIPE, CotrainRecipe, load_recipe, save_recipe
from draft_align.integrations.verl.checks import VerlConfigError, check_verl_config, select

log = logging.getLogger(__name__)

#: Where a verl config names the co-training recipe (read by the driver and by every actor worker).
RECIPE_KEY = "actor_rollout_ref.draft_align.recipe"
METRIC_PREFIX = "draft_align/"


def recipe_of(config: Any, recipe: str | Path | None = None, overrides: Sequence[str] = ()) -> CotrainRecipe:
    """The co-training recipe: ``recipe``, else the file at :data:`RECIPE_KEY` in verl's config (neither: the
    schema defaults with ``overrides``)."""
    path = recipe if recipe is not None else select(config, RECIPE_KEY)
    if path is None and not overrides:
        raise VerlConfigError(f"no draft_align recipe: set +{RECIPE_KEY}=<co-training recipe file>")
    out = load_recipe(path, list(overrides), CotrainRecipe)
    out.validate()
    return out


class VerlDraftAlign:
    """See the module docstring.  ``config``: verl's trainer config (checked by
    :func:`~draft_align.integrations.verl.checks.check_verl_config` unless ``check`` is False);
    ``recipe``/``overrides``: the co-training recipe (default: :data:`RECIPE_KEY`)."""

    def __init__(
        self,
        config: Any,
        recipe: str | Path | None = None,
        overrides: Sequence[str] = (),
        *,
        check: bool = True,
    ) -> None:
        if check:
            check_verl_config(config)
        from draft_align.sidecar.launch import starting_draft

        self.config = config
        self.recipe = recipe_of(config, recipe, overrides)
        self.start_draft = starting_draft(self.recipe)
        self.sidecar: Any = None
        self.sender: Any = None
        self.notify: Any = None
        self.drafts: Any = None
        self.refresher: Any = None
        self.endpoints: list[str] | None = None
        self.reports_refused = 0
        self.step_end_s = 0.0
        self.last_step = 0
        self.sidecar_alive = False  # as the last step boundary saw it (a change is logged once)
        self._actor_metrics: dict[str, Any] | None = None
        self._pending: dict[str, float] = {}
        self._installed: list[tuple[Any, str]] = []

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> list[str] | None:
        """Start (or re-attach to) the run's sidecar on Ray, connect the report sender and the draft source;
        returns the sidecar's tap endpoints (None: not ready within ``ray.ready_timeout_s``, logged; verl runs
        on without taps)."""
        from draft_align.integrations.ray.client import RaySidecar
        from draft_align.rl.build import draft_source, tap_sender
        from draft_align.wire import channel

        recipe = self.recipe
        run_dir = recipe.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        key = channel.resolve_key(recipe.wire.key_file, run_dir, create=True)
        resolved = save_recipe(recipe, run_dir / RESOLVED_RECIPE)
        self.sidecar = RaySidecar.start(recipe, self.start_draft, resolved)
        self.notify = self.sidecar.notifications()
        self.endpoints = self.sidecar.ready()
        if self.endpoints is None:
            log.warning("draft_align: the Ray sidecar is not ready: verl trains on without taps")
        else:
            self.sidecar_alive = True
            self.sender = tap_sender(recipe.wire, self.endpoints, key)
        # new versions are hashed, loaded and checked off verl's driver thread
        self.drafts = draft_source(
            recipe.rl.guard, run_dir, self.start_draft, run_id=recipe.run, notifications=self.notify
        )
        return self.endpoints

    def attach_servers(self, engine: Any) -> None:
        """Push each new verified draft into the rollout servers through ``engine`` (a ``vllm.LLM`` or
        :class:`~draft_align.integrations.verl.server.ServersEngine`), by the vLLM draft refresher."""
        from draft_align.engines.vllm.refresher import DraftRefresher

        self.refresher = DraftRefresher(
            engine,
            serving=self.drafts.frozen_version,
            run_dir=self.recipe.run_dir,
            key_file=self.recipe.wire.key_file,
        )

    def install(self, trainer: Any) -> None:
        """Wrap the trainer's step boundary and metrics (module docstring); call it after the trainer built its
        workers and checkpoint manager (``init_workers()``, or ``init()`` for verl's TransferQueue trainer)."""
        manager = trainer.checkpoint_manager
        update_weights = manager.update_weights

        def _update_weights(global_steps: int | None = None, *args: Any, **kwargs: Any) -> Any:
            result = update_weights(global_steps, *args, **kwargs)
            if global_steps:  # 0: the sync before the first step; None: a sync that is no step boundary
                self._pending = self.step_end(int(global_steps))
                if (
                    self._actor_metrics is not None
                ):  # RayPPOTrainer: reduced into fit()'s metrics after the sync
                    self._actor_metrics.update(self._pending)
                    self._actor_metrics, self._pending = None, {}
            return result

        manager.update_weights = _update_weights
        self._installed = [(manager, "update_weights")]
        if hasattr(trainer, "_compute_metrics"):  # verl's TransferQueue trainer (trainer.use_v1)
            compute_metrics = trainer._compute_metrics

            def _compute_metrics(batch: Any, metrics: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
                out = compute_metrics(batch, metrics, *args, **kwargs)
                metrics.update(self._pending)  # the step's boundary ran just before (on_step_end)
                self._pending = {}
                return out

            trainer._compute_metrics = _compute_metrics
            self._installed.append((trainer, "_compute_metrics"))
        else:  # RayPPOTrainer
            update_actor = trainer._update_actor

            def _update_actor(batch: Any, *args: Any, **kwargs: Any) -> Any:
                out = update_actor(batch, *args, **kwargs)
                self._actor_metrics = out.meta_info.setdefault("metrics", {})
                return out

            trainer._update_actor = _update_actor
            self._installed.append((trainer, "_update_actor"))

    def uninstall(self) -> None:
        for owner, name in self._installed:
            vars(owner).pop(name, None)
        self._installed = []

    # ----------------------------------------------------------------- per step
    def step_end(self, global_steps: int, reported: dict[str, float] | None = None) -> dict[str, float]:
        """The boundary after step ``global_steps``'s weight sync: report, pick up and push the newest draft;
        returns the ``draft_align/…`` metrics (``reported``: verl's own numbers of the step to report, e.g.
        reward or acceptance)."""
        from draft_align.wire.messages import StepReport

        t0 = time.perf_counter()
        self.last_step = int(global_steps)
        metrics: dict[str, float] = {}
        refreshed = bool(self.drafts.poll()) if self.drafts is not None else False
        metrics["draft_refreshed"] = float(refreshed)
        served = self.drafts.adapted_version if self.drafts is not None else None
        if refreshed and served is not None and self.refresher is not None:
            metrics["engine_draft_applied"] = float(self.refresher.apply(served, probe=False))
            metrics.update(self.refresher.metrics())
        if self.drafts is not None:
            metrics["draft_version"] = float(served.version if served is not None else 0)
            metrics["draft_failures"] = float(self.drafts.failures)
            metrics["draft_refreshes"] = float(self.drafts.refreshes)
            metrics["staleness"] = float(global_steps - (served.policy_version if served is not None else 0))
        if self.sender is not None:
            report = StepReport(
                run_id=self.recipe.run,
                step=global_steps - 1,
                policy_version=global_steps,
                metrics={k: float(v) for k, v in (reported or {}).items() if isinstance(v, int | float)},
            )
            if not self.sender.offer(report):
                self.reports_refused += 1
            metrics.update({f"wire_{k}": float(v) for k, v in self.sender.stats().items()})
        metrics["reports_refused"] = float(self.reports_refused)
        if self.sidecar is not None:
            status = self.sidecar.status()  # bounded by ray.call_timeout_s; None when unreachable
            alive = status is not None and bool(status.get("running"))
            if alive != self.sidecar_alive:
                self._log_sidecar(alive, status, metrics.get("draft_version", 0.0))
            self.sidecar_alive = alive
            metrics["sidecar_alive"] = float(alive)
            if status is not None:
                for k in ("published_version", "train_steps", "ingested_messages"):
                    if isinstance(status.get(k), int | float):
                        metrics[f"sidecar_{k}"] = float(status[k])
        self.step_end_s = time.perf_counter() - t0
        metrics["step_end_s"] = self.step_end_s
        return {METRIC_PREFIX + k: v for k, v in metrics.items() if not math.isnan(v)}

    def _log_sidecar(self, alive: bool, status: dict[str, Any] | None, serving: float) -> None:
        """One line when the sidecar is seen gone (or back, e.g. restarted by Ray)."""
        if alive:
            log.warning("draft_align: the Ray sidecar of run %s answers again", self.recipe.run)
            return
        if status is None:
            why = "unreachable"
        else:
            why = f"its loop failed: {status['error']}" if status.get("error") else "its loop ended"
        log.error(
            "draft_align: the Ray sidecar of run %s is gone (%s) at step %d: verl trains on, taps and reports "
            "are dropped and counted (draft_align/wire_*), draft v%d keeps serving",
            self.recipe.run,
            why,
            self.last_step,
            int(serving),
        )

    def stop(self, exit_timeout_s: float = 120.0) -> dict[str, Any] | None:
        """A final report, close the wire and the draft source, let the sidecar publish once more and end; the
        sidecar's final status (a detached one stays for the next job)."""
        from draft_align.rl.build import close_link

        self.uninstall()
        final = (self.recipe.run, self.last_step, self.last_step)
        close_link(self.sender, self.drafts, self.notify, final=final)
        self.sender = None
        final = None
        if self.sidecar is not None:
            self.sidecar.wait(exit_timeout_s)
            final = self.sidecar.stop(30.0, kill=self.recipe.ray.lifetime != "detached")
            self.sidecar = None
        return final
