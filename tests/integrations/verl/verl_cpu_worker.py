"""``DraftAlignActorRolloutRefWorker`` in a verl Ray worker on this CPU.

verl's ``TrainingWorker`` joins the process group with ``f"cpu:gloo,{device}:{backend}"``
(``initialize_global_process_group_ray``), which torch refuses when the device is "cpu" ("Duplicate device
type cpu"); it skips that when a group already exists.  This subclass joins verl's group itself (gloo, the
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` verl's ``RayWorkerGroup`` gave the worker) before
verl's ``init_model``; everything else is draft_align's worker as verl runs it.  :meth:`draft_align_set_version`
is the first thing ``DraftAlignActorRolloutRefWorker.update_weights`` does (the Tap's policy version); verl's
own weight sync after it needs a rollout (or a checkpoint engine) this CPU has not, so a test's step boundary
calls only that.  Imported by its top-level name
(verl_cpu_platform.py says why)."""

from __future__ import annotations

import os

import torch
from verl.single_controller.base.decorator import Dispatch, register

from draft_align.integrations.verl.worker import DraftAlignActorRolloutRefWorker


class CPUDraftAlignActorRolloutRefWorker(DraftAlignActorRolloutRefWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                "gloo",
                init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
            )
        return super().init_model()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def draft_align_set_version(self, global_steps: int) -> None:
        """What ``update_weights(global_steps)`` does for draft_align, without verl's weight sync."""
        assert self.draft_align_tap is not None
        self.draft_align_tap.set_version(global_steps)
