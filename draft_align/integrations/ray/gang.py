"""A multi-rank sidecar (``sidecar.ranks`` > 1) as a Ray Train gang: a ``TorchTrainer`` runs the sidecar's
per-rank main (``sidecar/launch.py``'s :func:`run_sidecar`, DDP or FSDP2 as under torchrun) on each worker.

Ray Train forms the process group (gloo on CPU, nccl with CUDA; ``sidecar.collective_timeout_s``) and the
ranks adopt it (``train/parallel.py``).  Each rank binds its tap endpoint on its node and registers it with the
run's registry; rank 0 reports its publishes there.  When a worker dies, Ray Train's failure handling
(``ray.max_failures``) tears the gang down and starts it again; every rank then resumes from rank 0's
checkpoint in the run folder, exactly as a restarted torchrun job does.  Ray Train's own checkpoints are not
used.  Device selection follows the local rank Ray Train gives each worker (``LOCAL_RANK``).

:class:`SidecarGang` is the small actor (no resources of its own) that runs the trainer, so that the gang can
be started, inspected and stopped by name like a single-rank sidecar.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from draft_align.config import CotrainRecipe, load_recipe
from draft_align.integrations.ray.host import attach_registry, bind_on_node, weights_digest
from draft_align.integrations.ray.runtime import (
    call,
    get_actor,
    identity_of,
    import_ray_train,
    import_ray_train_torch,
    registry_name,
)

log = logging.getLogger(__name__)

STOP_POLL_S = 1.0
# what each rank sets for itself (its node's address, its free or previous port): not compared between ranks
NODE_LOCAL_KEYS = (
    "wire.endpoint",
    "wire.notify_endpoint",
)  # how often each rank asks the registry whether a stop was requested


def _watch_stop(registry: Any, stop: threading.Event) -> None:
    """Set ``stop`` once the registry says a stop was requested (the ranks then agree to stop at the next step
    boundary); a registry that does not answer is asked again."""
    while not stop.wait(STOP_POLL_S):
        if call(registry.stop_requested.remote(), 10.0, "registry stop_requested()"):
            stop.set()


def rank_main(config: dict[str, Any]) -> None:
    """One rank of the gang (Ray Train's ``train_loop_per_worker``): ``config`` has ``recipe_file``,
    ``start_draft`` and ``namespace``."""
    import torch

    from draft_align.sidecar.launch import run_sidecar

    ctx = import_ray_train().get_context()
    rank, world, local = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    recipe = load_recipe(config["recipe_file"], [], CotrainRecipe)
    torch.set_num_threads(recipe.sidecar.num_threads)
    torch.manual_seed(recipe.seed)
    bind_on_node(recipe, rank, world)
    namespace = config["namespace"]
    registry = get_actor(registry_name(identity_of(recipe)), namespace)
    stop = threading.Event()
    if registry is not None:
        threading.Thread(target=_watch_stop, args=(registry, stop), daemon=True).start()
    built: list[Any] = []

    def on_ready(sidecar: Any) -> None:
        built.append(sidecar)
        attach_registry(sidecar, recipe, namespace, rank)

    try:
        state = run_sidecar(
            recipe,
            config["start_draft"],
            exit_when_done=True,
            stop=stop,
            on_ready=on_ready,
            rank_local=NODE_LOCAL_KEYS,
        )
    finally:
        stop.set()
    if registry is not None and built:
        digest = weights_digest(built[0].trainer.draft) if recipe.sidecar.parallel == "ddp" else None
        info = {"train_steps": int(state.train_steps), "weights_digest": digest, "done": bool(state.done)}
        call(registry.rank_done.remote(rank, info), 10.0, "registry rank_done()")


class SidecarGang:
    """The actor that runs a sidecar gang's ``TorchTrainer.fit()`` on a thread (see the module docstring)."""

    def __init__(self, recipe_file: str, start_draft: str, namespace: str) -> None:
        from draft_align.sidecar.launch import starting_draft

        train, train_torch = import_ray_train(), import_ray_train_torch()

        recipe = load_recipe(recipe_file, [], CotrainRecipe)
        rc, sc = recipe.ray, recipe.sidecar
        self.recipe = recipe
        self.registry = get_actor(registry_name(identity_of(recipe)), namespace)
        if self.registry is not None:
            call(self.registry.begin.remote(), 30.0, "registry begin()")
        per_worker = {
            "CPU": rc.num_cpus,
            **({"GPU": rc.num_gpus} if rc.num_gpus > 0 else {}),
            **dict(rc.resources),
        }
        cuda = str(recipe.device).startswith("cuda")
        self.trainer = train_torch.TorchTrainer(
            rank_main,
            train_loop_config={
                "recipe_file": recipe_file,
                "start_draft": str(starting_draft(recipe, start_draft)),
                "namespace": namespace,
            },
            scaling_config=train.ScalingConfig(
                num_workers=sc.ranks, use_gpu=rc.num_gpus > 0, resources_per_worker=per_worker
            ),
            run_config=train.RunConfig(
                name=f"draft_align-{recipe.run}",
                storage_path=str(recipe.run_dir / "ray_train"),
                failure_config=train.FailureConfig(max_failures=rc.max_failures),
            ),
            torch_config=train_torch.TorchConfig(
                backend="nccl" if cuda else "gloo", timeout_s=int(sc.collective_timeout_s)
            ),
        )
        self.error: str | None = None
        self.finished = False
        self.started = time.time()
        self.thread = threading.Thread(target=self._fit, name="draft_align-gang", daemon=True)
        self.thread.start()

    def _fit(self) -> None:
        try:
            self.trainer.fit()
            self.finished = True
        except BaseException as e:  # out of restarts, or a rank's error: reported by status()
            self.error = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
            log.exception("sidecar gang failed")

    def ready(self) -> dict[str, Any]:
        """The gang's size and pid (its ranks register their endpoints with the registry as they come up)."""
        return {"ranks": int(self.recipe.sidecar.ranks), "pid": os.getpid()}

    def status(self) -> dict[str, Any]:
        ranks = (
            call(self.registry.ranks.remote(), 10.0, "registry ranks()")
            if self.registry is not None
            else None
        )
        return {
            "running": self.thread.is_alive(),
            "done": self.finished,
            "error": self.error,
            "pid": os.getpid(),
            "ranks": ranks or {},
            "up_s": time.time() - self.started,
        }

    def stop(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Ask the ranks to stop (through the registry; they checkpoint and close) and wait for the gang."""
        if self.registry is not None:
            call(self.registry.request_stop.remote(), 10.0, "registry request_stop()")
        self.thread.join(timeout_s)
        return self.status()
