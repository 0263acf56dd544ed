"""Drafts into verl's vLLM server actors: a worker extension that loads a verified draft version in place, a
server that sleeps at level 1 while it serves an EAGLE-3 draft, and an engine handle through which
:class:`~draft_align.engines.vllm.refresher.DraftRefresher` (sha256 re-check in the worker, vocab-map and
shared-tensor checks, rollback) drives every server actor as it drives one in-process ``vllm.LLM``.

- :class:`DraftAlignWorkerExtension`: verl's ``vLLMColocateWorkerExtension`` plus ``draft_align_describe`` /
  ``draft_align_load`` (``engines/vllm/worker_rpc.py``'s :func:`rpc_describe` / :func:`rpc_load_draft` on the
  worker), called by name, so no function is pickled into vLLM's workers;
- :class:`DraftAlignHttpServer`: verl's ``vLLMHttpServer`` with that extension, ``draft_align_rpc`` (a
  ``collective_rpc`` that returns the workers' answers: verl's returns nothing) and level-1 sleep, which keeps
  every weight (the draft's included) in host memory, where level 2 would discard the draft;
- :class:`DraftAlignReplica` and :func:`install_rollout`: verl's ``vLLMReplica`` building those servers,
  registered as verl's ``vllm`` rollout in the driver process before the trainer builds its replicas;
- :class:`ServersEngine`: the LLM-shaped handle on the server actors (``collective_rpc``,
  ``reset_prefix_cache``, ``llm_engine.vllm_config.speculative_config``).

The acceptance probe of :class:`~draft_align.engines.vllm.refresher.ProbeGuard` needs ``LLM.generate`` and is
not offered here: a failed or refused load rolls back, an acceptance collapse does not yet.  Imports vLLM and
verl: used only in a verl job on a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from draft_align.engines.vllm.worker_rpc import rpc_describe, rpc_load_draft
from draft_align.integrations.ray.runtime import import_ray

#: The names the worker extension answers to, by the module-level function the refresher sends.
RPC_NAMES = {rpc_describe: "draft_align_describe", rpc_load_draft: "draft_align_load"}


class DraftAlignWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocate extension plus the draft loader (runs in each vLLM worker; ``self`` is the worker)."""

    def draft_align_describe(self) -> dict[str, Any]:
        return rpc_describe(self)

    def draft_align_load(
        self, weights_path: str, sha256: str, record: dict[str, Any], tensors: Any = None
    ) -> dict:
        return rpc_load_draft(self, weights_path, sha256, record, tensors)


class DraftAlignHttpServer(vLLMHttpServer):
    """verl's vLLM server with the draft loader and level-1 sleep (module docstring)."""

    def _get_worker_extension_cls(self) -> str:
        return f"{DraftAlignWorkerExtension.__module__}.{DraftAlignWorkerExtension.__qualname__}"

    def _resolve_sleep_level(self) -> int:
        return 1  # level 2 discards the draft's weights; verl's sync restores only the target's

    async def draft_align_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """``collective_rpc`` by method name, returning every worker's answer."""
        return list(await self.engine.collective_rpc(method=method, args=args))

    async def draft_align_reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()


class DraftAlignReplica(vLLMReplica):
    """verl's vLLM replica whose servers are :class:`DraftAlignHttpServer` actors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = import_ray().remote(DraftAlignHttpServer)


def install_rollout() -> None:
    """Register :class:`DraftAlignReplica` as verl's ``vllm`` rollout (in the driver, before the trainer's
    ``init_workers``)."""
    RolloutReplicaRegistry.register("vllm", lambda: DraftAlignReplica)


class ServersEngine:
    """The ``vllm.LLM`` surface :class:`~draft_align.engines.vllm.refresher.DraftRefresher` uses, over verl's
    server actors (every replica's): a call reaches every worker of every server; answers are concatenated."""

    def __init__(
        self, servers: list[Any], speculative_config: dict[str, Any], timeout_s: float = 300.0
    ) -> None:
        if not servers:
            raise ValueError("ServersEngine needs at least one vLLM server actor")
        self.servers = list(servers)
        self.timeout_s = float(timeout_s)
        spec = SimpleNamespace(
            method=str(speculative_config.get("method")),
            num_speculative_tokens=int(speculative_config.get("num_speculative_tokens", 1)),
            model=str(speculative_config.get("model")),
        )
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec))

    @classmethod
    def of_trainer(cls, trainer: Any, speculative_config: dict[str, Any]) -> ServersEngine:
        """The server actors of a verl ``RayPPOTrainer`` (its checkpoint manager's replicas)."""
        return cls([s for r in trainer.checkpoint_manager.replicas for s in r.servers], speculative_config)

    def collective_rpc(self, fn: Any, args: tuple = ()) -> list[Any]:
        name = RPC_NAMES.get(fn)
        if name is None:
            raise ValueError(f"{getattr(fn, '__name__', fn)}: not a draft_align worker call")
        ray = import_ray()
        answers = ray.get(
            [s.draft_align_rpc.remote(name, tuple(args)) for s in self.servers], timeout=self.timeout_s
        )
        return [a for server in answers for a in server]

    def reset_prefix_cache(self) -> None:
        ray = import_ray()
        ray.get([s.draft_align_reset_prefix_cache.remote() for s in self.servers], timeout=self.timeout_s)
