"""One draft_align run beside one TRL ``GRPOTrainer``: the sidecar, the wire, the drafts, the Tap and the
rollout engine, started by :class:`~draft_align.integrations.trl.callback.DraftAlignCallback` and used by
:meth:`DraftAlign.rollout_func`.

The recipe is a co-training recipe (``kind: cotrain``, validated like every recipe): its ``target``, ``tap``,
``wire``, ``sidecar`` and ``logging`` sections configure the sidecar side; of ``rl`` only what concerns
rollouts is read (``rl.task.temperature``, which must equal TRL's, ``rl.engine``, ``rl.guard``).  TRL owns
everything else (prompts, rewards, the optimizer, steps: ``rl.task``'s other keys, ``rl.policy``).
``sidecar``: ``spawn`` (a child process, like ``draft-align cotrain``), ``connect`` (one already running on the same run folder, e.g.
``draft-align sidecar RECIPE``), ``ray`` (an actor or gang on the Ray cluster the recipe's ``ray`` section names,
started or re-attached by name; its endpoints and drafts come through the run's registry, docs/ray.md) or
``off`` (taps go nowhere; drafts are still picked up from ``latest``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from draft_align.config import RESOLVED_RECIPE, CotrainRecipe, load_recipe, save_recipe
from draft_align.conventions import DRAFT_KINDS
from draft_align.engines.rollout_types import Decoding
from draft_align.integrations.trl.callback import DraftAlignCallback
from draft_align.integrations.trl.checks import TRLConfigError, check_trainer
from draft_align.integrations.trl.profile import StageTimer
from draft_align.integrations.trl.tap import TRLTap, policy_model
from draft_align.rl.build import (
    close_link,
    draft_notifications,
    draft_source,
    policy_tap,
    set_engine_env,
    start_rollout_engine,
    tap_sender,
)
from draft_align.rl.drafts import DraftSource
from draft_align.rl.rollouts import RolloutEngine, plan_given

log = logging.getLogger(__name__)

SidecarMode = Literal["spawn", "connect", "ray", "off"]
SIDECAR_MODES: tuple[str, ...] = ("spawn", "connect", "ray", "off")
#: the draft_align/* keys TRL's log carries under ``logging.trl_metrics: brief`` (the default; ``full``: every one)
BRIEF_METRICS = frozenset(
    {
        "accept_measured_adapted",
        "accept_measured_frozen",
        "draft_version",
        "staleness",
        "sidecar_alive",
        "wire_dropped",
    }
)


def start_draft(recipe: CotrainRecipe, draft: str | None) -> Path:
    """The starting draft (:func:`~draft_align.sidecar.launch.starting_draft`).  When none is named and the
    warm-start recipe has published none yet, a single-process run warm-starts here first, as ``draft-align
    cotrain`` does; the processes of a multi-process run (``WORLD_SIZE`` > 1) would each run it, so they stop with
    the SidecarError that says to run it first."""
    from draft_align import warmstart
    from draft_align.sidecar.launch import starting_draft

    alone = int(os.environ.get("WORLD_SIZE", "1")) <= 1
    return starting_draft(recipe, draft, warm_start=warmstart.run_in_process if alone else None)


class DraftAlign:
    """See the module docstring.  ``recipe``: a CotrainRecipe or a recipe file (``overrides``: key=value);
    ``draft``: the starting draft (default: the recipe's ``draft`` or its warm-start's published draft, warm-started
    here first when there is none: :func:`start_draft`)."""

    def __init__(
        self,
        recipe: CotrainRecipe | str | Path,
        overrides: Sequence[str] = (),
        *,
        draft: str | None = None,
        sidecar: SidecarMode = "spawn",
        ready_timeout_s: float = 180.0,
        exit_timeout_s: float = 120.0,
    ) -> None:
        if sidecar not in SIDECAR_MODES:
            raise TRLConfigError(f"sidecar={sidecar!r}: expected one of {SIDECAR_MODES}")
        if sidecar == "ray":  # fails now, in one line naming the extra, when Ray is not installed
            from draft_align.integrations.ray.runtime import import_ray

            import_ray()
        if isinstance(recipe, CotrainRecipe):
            if overrides:
                raise TRLConfigError("overrides apply to a recipe file, not to a CotrainRecipe object")
            self.recipe = recipe
        else:
            self.recipe = load_recipe(recipe, list(overrides), CotrainRecipe)
        self.recipe.validate()
        self.start_draft = start_draft(self.recipe, draft)
        self.sidecar_mode: SidecarMode = sidecar
        self.ready_timeout_s = float(ready_timeout_s)
        self.exit_timeout_s = float(exit_timeout_s)
        self.trainer: Any = None
        self.proc: subprocess.Popen | None = None
        self.ray_sidecar: Any = None  # sidecar="ray": integrations/ray/client.py's RaySidecar
        self.sender: Any = None
        self.notify: Any = None
        self.drafts: DraftSource | None = None
        self.tap: TRLTap | None = None
        self.engine: RolloutEngine | None = None
        self.timer = StageTimer(lambda: self.tap.seconds if self.tap is not None else 0.0)
        self.step_metrics: dict[str, float | None] = {}  # this optimizer step's, reported at its end
        self.reports_refused = 0
        self.callback_s = 0.0
        self.sidecar_exit: int | None = None  # the spawned sidecar's exit code once it has died

    @property
    def run_dir(self) -> Path:
        return self.recipe.run_dir

    def callback(self, trainer: Any) -> DraftAlignCallback:
        """The TrainerCallback for ``trainer`` (``trainer.add_callback(da.callback(trainer))``); checks the
        trainer's configuration now, so what cannot work fails before training starts."""
        check_trainer(trainer, self.recipe.rl.task, uses_rollout_func=self.uses_rollout_func(trainer))
        self.trainer = trainer
        return DraftAlignCallback(self, trainer)

    def uses_rollout_func(self, trainer: Any) -> bool:
        return trainer.rollout_func == self.rollout_func

    # ----------------------------------------------------------------- lifecycle (driven by the callback)
    def start(self, trainer: Any) -> None:
        """on_train_begin: sidecar, wire, drafts, Tap, engine (in this order: taps of the first step reach a
        sidecar that is up)."""
        from draft_align.sidecar.layout import SIDECAR_DIR
        from draft_align.sidecar.process import kill_at_exit, spawn_sidecar, wait_ready
        from draft_align.wire import channel

        recipe = self.recipe
        self.trainer = trainer
        run_dir = recipe.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        main = bool(trainer.accelerator.is_local_main_process)
        key = channel.resolve_key(recipe.wire.key_file, run_dir, create=main)
        if self.sidecar_mode == "spawn" and main:
            if (run_dir / SIDECAR_DIR).exists():
                log.info("draft_align: %s has a sidecar folder: the spawned sidecar resumes from it", run_dir)
            resolved = save_recipe(recipe, run_dir / RESOLVED_RECIPE)
            self.proc = spawn_sidecar(
                resolved, self.start_draft, run_dir / "sidecar.log", ranks=recipe.sidecar.ranks
            )
            kill_at_exit(self.proc)  # TRL's train() may raise before on_train_end
        if self.sidecar_mode == "ray":
            self._start_on_ray(key)
        elif self.sidecar_mode != "off":
            endpoint = channel.tap_endpoint(run_dir, recipe.wire.endpoint)
            self.sender = tap_sender(recipe.wire, channel.tap_endpoints(endpoint, recipe.sidecar.ranks), key)
            self.notify = draft_notifications(recipe.wire, run_dir, key)
        # new versions are hashed, loaded and checked off TRL's thread
        self.drafts = draft_source(
            recipe.rl.guard,
            run_dir,
            self.start_draft,
            run_id=recipe.run,
            device=trainer.accelerator.device,
            notifications=self.notify,
        )
        if recipe.tap.enabled and self.sender is not None:
            hf_tap = policy_tap(
                recipe.tap,
                recipe.wire,
                policy_model(trainer),
                self.start_draft,
                self.sender,
                rank=int(trainer.accelerator.process_index),
                run_id=recipe.run,
                seed=recipe.seed,
            )
            drafts = self.drafts
            self.tap = TRLTap(
                trainer, hf_tap, lambda version: hf_tap.head_sync(version, drafts.draft_to_target)
            )
        self.timer.install(trainer)  # after the Tap's own wrappers: its seconds are taken out of each stage
        if self.uses_rollout_func(trainer):
            self.engine = self._start_engine(trainer)
        if self.proc is not None:
            wait_ready(self.proc, run_dir, self.ready_timeout_s)

    def _start_on_ray(self, key: bytes) -> None:
        """sidecar="ray": start the run's sidecar on the cluster or re-attach to it (every process asks; the
        first creates it), then connect the Tap to the endpoints its ranks report.  A sidecar that is not ready
        within ``ray.ready_timeout_s`` means no Tap (logged); drafts still come from the registry or ``latest``."""
        from draft_align.integrations.ray.client import RaySidecar

        recipe = self.recipe
        resolved = save_recipe(recipe, recipe.run_dir / RESOLVED_RECIPE)
        self.ray_sidecar = RaySidecar.start(recipe, self.start_draft, resolved)
        self.notify = self.ray_sidecar.notifications()
        endpoints = self.ray_sidecar.ready()
        if endpoints is None:
            log.warning("draft_align: the Ray sidecar is not ready: this run trains without taps")
            return
        self.sender = tap_sender(recipe.wire, endpoints, key)

    def _start_engine(self, trainer: Any) -> RolloutEngine:
        """The engine the rollout_func decodes with: draft_align's vLLM engine (``rl.engine``), or the reference
        decoder on the live policy."""
        from draft_align.rl.rollouts import ReferenceRollouts

        recipe = self.recipe
        rl = recipe.rl
        if trainer.use_vllm:
            from draft_align.integrations.trl.colocate import colocate_rollouts

            return colocate_rollouts(
                trainer,
                self.drafts.frozen_version,
                rl.engine,
                recipe.target,
                run_dir=recipe.run_dir,
                key_file=recipe.wire.key_file,
            )
        set_engine_env(rl.engine)  # this session is the launcher of the TRL run's engine
        probes = self._probe_prompts(trainer)
        engine = start_rollout_engine(
            rl.engine,
            rl.guard,
            recipe.target,
            self.drafts.frozen_version,
            probes,
            run_dir=recipe.run_dir,
            seed=recipe.seed,
            key_file=recipe.wire.key_file,
            push=recipe.push,
        )
        if engine is None:
            return ReferenceRollouts(
                policy_model(trainer), self.drafts, rl.engine.spec_k, rl.engine.verify_mode
            )
        return engine

    def _probe_prompts(self, trainer: Any) -> list[torch.Tensor]:
        ds = trainer.train_dataset
        n = min(len(ds), self.recipe.rl.guard.probe_prompts)
        if n == 0:
            return []
        ids = trainer._tokenize_prompts([ds[i]["prompt"] for i in range(n)])[0]
        return [torch.tensor(x, dtype=torch.long) for x in ids]

    def refresh(self) -> bool:
        """on_step_begin: pick up the newest published draft (never waits); the engine is offered it before
        the step's rollouts."""
        self.timer.begin_step()
        with self.timer.region("draft_refresh"):
            refreshed = self.drafts.poll()
        self.step_metrics["draft_refreshed"] = float(refreshed)
        return refreshed

    def optimizer_step(self, begin: bool) -> None:
        """on_pre_optimizer_step (``begin``) / on_optimizer_step: the optimizer step is part of ``train``."""
        if begin:
            self.timer.open("optimizer", "train")
        else:
            self.timer.close("optimizer")

    def end_step(self, trainer: Any) -> dict[str, float | None]:
        """on_step_end: ship the step's taps, send the StepReport; returns the step's draft_align metrics."""
        from draft_align.wire.messages import StepReport

        metrics = dict(self.step_metrics)
        self.step_metrics = {}
        version = int(trainer.state.global_step)
        if self.proc is not None:
            metrics["sidecar_alive"] = float(self._sidecar_alive(version))
        if self.tap is not None:
            t0 = time.perf_counter()
            metrics["tap_tokens_accepted"] = float(self.tap.tap.end_step())
            metrics["tap_s"] = self.tap.take_seconds() + time.perf_counter() - t0
            metrics.update({f"tap_{k}": float(v) for k, v in self.tap.tap.stats().items()})
        profile = self.timer.end_step(float(metrics.get("tap_s") or 0.0))
        if profile is not None:
            metrics["step_s"] = profile.step_s
            metrics.update(profile.to_metrics())
        if self.sender is not None:
            wire = self.sender.stats()
            metrics.update({f"wire_{k}": float(v) for k, v in wire.items()})
            # every message the sender did not deliver, whatever the reason (as draft-align cotrain reports it)
            metrics["wire_dropped"] = float(sum(v for k, v in wire.items() if k.startswith("dropped_")))
        metrics["draft_failures"] = float(self.drafts.failures)
        metrics["draft_refreshes"] = float(self.drafts.refreshes)
        metrics["draft_rollbacks"] = float(self.drafts.rollbacks)
        trl = trainer._metrics["train"]  # this step's values TRL will average into its next log
        for name, key in (("reward", "reward_mean"), ("reward_std", "reward_std"), ("kl", "kl_ref")):
            if trl.get(name):
                metrics[key] = float(trl[name][-1])
        if self.sender is not None:
            report = StepReport(
                run_id=self.recipe.run,
                step=version - 1,
                policy_version=version,
                metrics={k: v for k, v in metrics.items() if v is None or v == v},
            )
            if not self.sender.offer(report):
                self.reports_refused += 1
        metrics.update(self._estimates())
        return metrics

    def logged(self, metrics: dict[str, float | None]) -> dict[str, float | None]:
        """The step's metrics TRL's log carries: :data:`BRIEF_METRICS`, or every one under
        ``logging.trl_metrics: full``."""
        if self.recipe.logging.trl_metrics == "full":
            return metrics
        return {k: v for k, v in metrics.items() if k in BRIEF_METRICS}

    def _sidecar_alive(self, step: int) -> bool:
        """Whether the spawned sidecar still runs; its death is logged once (ERROR, with its exit code and
        log file), and ``sidecar_alive`` = 0 in TRL's logs from then on."""
        rc = self.proc.poll() if self.proc is not None else None
        if rc is not None and self.sidecar_exit is None:
            self.sidecar_exit = rc
            log.error(
                "draft_align: the spawned sidecar died (exit code %s) by TRL step %d; see %s. Training goes on: "
                "taps are dropped and the last published draft stays in use (restart it with `draft-align "
                "sidecar %s` to resume)",
                rc,
                step,
                self.run_dir / "sidecar.log",
                self.run_dir / RESOLVED_RECIPE,
            )
        return rc is None

    def _estimates(self) -> dict[str, float | None]:
        """The sidecar's newest estimates (from ``monitor.jsonl``: they arrive a step or more later)."""
        from draft_align.monitor.live import last_record
        from draft_align.sidecar.layout import MONITOR_FILE, SIDECAR_DIR

        path = self.run_dir / SIDECAR_DIR / MONITOR_FILE
        if not path.exists():
            return {}
        row = last_record(path)  # read from the end: a step costs the same however long the log
        if row is None:
            return {}
        out = {
            k: row[k]
            for k in ("accept_est_adapted", "accept_est_frozen", "sidecar_draft_version", "buffer_fill")
            if isinstance(row.get(k), int | float)
        }
        out["est_step"] = row.get("step")
        return out

    def stop(self) -> int | None:
        """on_train_end: a final report, close the wire, let the sidecar publish and exit; its exit code."""
        from draft_align.sidecar.process import stop_sidecar

        self.timer.uninstall()  # before the Tap's: these wrap its wrappers
        if self.tap is not None:
            self.tap.uninstall()
        if self.engine is not None:
            self.engine.shutdown()
        version = int(self.trainer.state.global_step) if self.trainer is not None else 0
        close_link(self.sender, self.drafts, self.notify, final=(self.recipe.run, version, version))
        rc = None
        if self.ray_sidecar is not None:  # it ends after the final report; a detached one stays for re-attach
            self.ray_sidecar.wait(self.exit_timeout_s)
            final = self.ray_sidecar.stop(30.0, kill=self.recipe.ray.lifetime != "detached")
            rc = 0 if final is not None and final.get("error") is None else 1
            self.ray_sidecar = None
        if self.proc is not None:
            rc = stop_sidecar(self.proc, self.exit_timeout_s)
            self.proc = None
        return rc

    # ----------------------------------------------------------------- TRL's rollout_func
    def rollout_func(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """TRL's ``rollout_func(prompts, trainer)``: this generation batch's completions by speculative decoding
        (the policy synced into the engine first, the newest draft offered), a seeded ``rl.engine.frozen_fraction`` on
        the frozen draft; returns TRL's ``prompt_ids``/``completion_ids``/``logprobs`` (the engine's, so TRL
        can compare them with its own)."""
        if self.engine is None or self.drafts is None:
            raise TRLConfigError(
                "draft_align's rollout_func needs its callback: trainer.add_callback(da.callback(trainer))"
            )
        with self.timer.region("data"):  # what is left once the engine's own stages are recorded
            return self._rollouts(prompts, trainer)

    def _rollouts(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        assert self.engine is not None and self.drafts is not None
        version = int(trainer.state.global_step)
        metrics = self.engine.prepare(policy_model(trainer), version, self.drafts.adapted_version)
        self.timer.record("weight_sync", metrics.get("policy_sync_s", 0.0))
        self.timer.record("draft_refresh", metrics.get("draft_offer_s", 0.0))
        prompt_ids = trainer._tokenize_prompts(prompts)[0]  # TRL's own chat template and tokenisation
        tensors = [torch.tensor(p, dtype=torch.long) for p in prompt_ids]
        plan = plan_given(self.recipe.seed, version, len(tensors), self.recipe.rl.engine.frozen_fraction)
        max_tokens = int(trainer.args.max_completion_length)
        decoding = Decoding(
            float(trainer.temperature), max_tokens, frozenset(int(i) for i in trainer.eos_token_ids)
        )
        t0 = time.perf_counter()
        rollouts, tallies = self.engine.rollouts(plan, tensors, decoding)
        metrics["rollout_s"] = time.perf_counter() - t0
        timings = dict(getattr(self.engine, "last_timings", {}))
        swaps = timings.get("draft_swap_s", 0.0) + timings.get("verify_choice_s", 0.0)
        self.timer.record("generation", metrics["rollout_s"] - swaps)
        served = self.engine.adapted
        t0 = time.perf_counter()
        metrics["draft_rolled_back"] = float(self.drafts.judge(served, tallies))
        self.timer.record("draft_refresh", swaps + time.perf_counter() - t0)
        metrics["draft_version"] = float(served.version if served is not None else 0)
        metrics["draft_policy_version"] = float(served.policy_version if served is not None else 0)
        metrics["staleness"] = float(version - (served.policy_version if served is not None else 0))
        for kind in DRAFT_KINDS:
            tally = tallies[kind]
            metrics[f"accept_measured_{kind}"] = tally.mean_length() if tally.rounds else None
            metrics[f"accept_rounds_{kind}"] = float(tally.rounds)
            for i, rate in enumerate(tally.per_position()):  # P_{i+1}, what advise projects from
                metrics[f"accept_r{i}_{kind}"] = rate if tally.rounds else None
            metrics[f"rollouts_{kind}"] = float(sum(r.draft == kind for r in rollouts))
        if hasattr(self.engine, "metrics"):
            metrics.update(self.engine.metrics())
        self.step_metrics.update(metrics)
        logprobs = []
        for r in rollouts:
            lp = r.engine_logprobs
            logprobs.append(
                [None if x != x else float(x) for x in lp.tolist()]
                if lp is not None
                else [0.0] * int(r.response.numel())
            )
        return {
            "prompt_ids": [list(p) for p in prompt_ids],
            "completion_ids": [r.response.tolist() for r in rollouts],
            "logprobs": logprobs,
        }
