"""verl's hybrid actor worker with the Tap: ``ActorRolloutRefWorker`` whose actor engine's ``infer_batch`` runs
inside :meth:`~draft_align.integrations.verl.tap.VerlTap.log_prob_call` (only the old-log-prob pass is tapped;
the reference pass through the actor is recognised and left alone) and whose ``update_weights(global_steps)``
sets the policy version.  Use it in place of verl's class in the trainer's ``role_worker_mapping``.

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
        """This rank's Tap counters (empty without a Tap)."""
        tap = self.draft_align_tap
        if tap is None:
            return {}
        stats = {f"tap_{k}": float(v) for k, v in tap.tap.stats().items()}
        stats.update({f"wire_{k}": float(v) for k, v in tap.tap.sink.stats().items()})
        stats["tap_s"] = tap.seconds
        return stats
