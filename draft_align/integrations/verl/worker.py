"""verl's hybrid actor worker with the Tap, and verl's trainer with draft_align beside it.

- :class:`DraftAlignActorRolloutRefWorker`: ``ActorRolloutRefWorker`` whose actor engine's ``infer_batch`` runs
  inside :meth:`~draft_align.integrations.verl.tap.VerlTap.log_prob_call` (only the old-log-prob pass is tapped;
  the reference pass through the actor is recognised and left alone) and whose ``update_weights(global_steps)``
  sets the policy version;
- :func:`with_draft_align`: a verl trainer class (``PPOTrainerSync`` and the other TransferQueue trainers)
  extended to check the config, start the sidecar before the workers, build the workers above and the rollout
  servers of :mod:`~draft_align.integrations.verl.server`, install the driver's hooks and stop it all after
  ``fit()``; :func:`register_trainer_mode` registers it as a ``trainer.v1.trainer_mode``.

The recipe comes from ``actor_rollout_ref.draft_align.recipe`` in the worker's config, the sidecar's endpoints
from the run's Ray registry (the driver started the sidecar before the workers: docs/verl.md).  No recipe, or
no sidecar endpoints: the worker runs as verl's own, logged once.  Imports verl.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from draft_align.integrations.ray.runtime import import_ray
from draft_align.integrations.verl.tap import VerlTap, worker_tap

log = logging.getLogger(__name__)


def start_worker_tap(worker: Any) -> VerlTap | None:
    """Build the actor rank's Tap and wrap its engine's ``infer_batch`` (None: no recipe or no sidecar)."""
    from draft_align.config import CotrainRecipe, load_recipe
    from draft_align.integrations.ray.client import RaySidecar

    section = worker.config.get("draft_align", None) or {}
    path = section.get("recipe", None)
    if path is None:
        log.warning("draft_align: no actor_rollout_ref.draft_align.recipe: this worker taps nothing")
        return None
    recipe = load_recipe(path, [], CotrainRecipe)
    sidecar = RaySidecar.attach(recipe)
    endpoints = sidecar.endpoints() if sidecar is not None else None
    if not endpoints:
        log.warning("draft_align: no sidecar endpoints in the run's registry: this worker taps nothing")
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    tap = worker_tap(worker.actor.engine, recipe, endpoints, rank)
    actor = worker.actor
    infer_batch = actor.infer_batch

    def tapped_infer_batch(data: Any) -> Any:
        with tap.log_prob_call(data):
            return infer_batch(data)

    actor.infer_batch = tapped_infer_batch
    return tap


class DraftAlignActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker`` with the Tap (module docstring)."""

    draft_align_tap: VerlTap | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        if "actor" in self.role:
            self.draft_align_tap = start_worker_tap(self)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        if self.draft_align_tap is not None:
            self.draft_align_tap.set_version(global_steps)
        return await super().update_weights(global_steps=global_steps, mode=mode)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def draft_align_stats(self) -> dict[str, float]:
        """This rank's Tap counters: the HF Tap's (``tap_*``), its sender's (``wire_*``), the calls tapped and
        skipped, and the policy version it tags (empty without a Tap)."""
        tap = self.draft_align_tap
        if tap is None:
            return {}
        stats = {f"tap_{k}": float(v) for k, v in tap.tap.stats().items()}
        stats.update({f"wire_{k}": float(v) for k, v in tap.tap.sink.stats().items()})
        stats["tap_s"] = tap.seconds
        stats.update(
            tapped_calls=float(tap.tapped_calls),
            skipped_calls=float(tap.skipped_calls),
            micro_batches=float(tap.micro_batches),
            policy_version=float(tap.version),
        )
        return stats


def with_draft_align(trainer_cls: type) -> type:
    """``trainer_cls`` (a verl 0.9 TransferQueue trainer class) with draft_align beside it (module docstring)."""
    from verl.trainer.ppo.utils import Role

    from draft_align.integrations.verl.checks import speculative_config
    from draft_align.integrations.verl.driver import VerlDraftAlign

    actor_roles = {Role.Actor, Role.ActorRollout, Role.ActorRolloutRef}

    class DraftAlignTrainer(trainer_cls):  # type: ignore[misc, valid-type]
        draft_align: VerlDraftAlign | None = None

        def _init_resource_pool_mgr(self) -> None:
            super()._init_resource_pool_mgr()
            for role in list(self.role_worker_mapping):
                if role in actor_roles:
                    self.role_worker_mapping[role] = import_ray().remote(DraftAlignActorRolloutRefWorker)

        def init(self) -> None:
            from draft_align.integrations.verl.server import ServersEngine, install_rollout

            self.draft_align = VerlDraftAlign(
                self.config
            )  # refuses what cannot work, before any worker starts
            self.draft_align.start()  # the actor workers find its endpoints in the run's registry
            install_rollout()  # verl's "vllm" replicas: draft_align's servers (loader, level-1 sleep)
            super().init()
            self.draft_align.install(self)
            spec = speculative_config(self.config) or {}
            self.draft_align.attach_servers(ServersEngine.of_trainer(self, spec))

        def fit(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().fit(*args, **kwargs)
            finally:
                if self.draft_align is not None:
                    self.draft_align.stop()

    DraftAlignTrainer.__name__ = DraftAlignTrainer.__qualname__ = f"DraftAlign{trainer_cls.__name__}"
    return DraftAlignTrainer


def register_trainer_mode(mode: str = "sync") -> str:
    """Register ``with_draft_align(<verl's trainer of mode>)`` as ``draft_align_<mode>`` (call it in the
    process that runs verl's TaskRunner); returns the name for ``trainer.v1.trainer_mode``."""
    from verl.trainer.ppo.v1 import get_trainer_cls, register_trainer
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    name = f"draft_align_{mode}"
    if name not in TRAINER_REGISTRY:
        register_trainer(name)(with_draft_align(get_trainer_cls(mode)))
    return name
