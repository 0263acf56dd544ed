"""Drafts into verl's vLLM server actors: the ``draft_align`` weight-transfer backend (vLLM's own RL weight-update
API, docs/servers.md) where verl's vLLM has it, a worker extension for the by-name worker calls, a server that
sleeps at level 1 while it serves an EAGLE-3 draft, and an engine handle through which
:class:`~draft_align.engines.vllm.refresher.DraftRefresher` (signed updates checked in each worker: sha256 of
the bytes read, vocab map, shared tensors, tensor layout; the previous version restored on failure) drives
every server actor as it drives one in-process ``vllm.LLM``.

- :class:`DraftAlignWorkerExtension`: verl's ``vLLMColocateWorkerExtension`` plus draft_align's worker calls by
  name (``engines/vllm/worker_ext.py``), so no function is pickled into vLLM's workers;
- :class:`DraftAlignHttpServer`: verl's ``vLLMHttpServer`` with that extension, ``weight_transfer_config =
  {"backend": "draft_align"}`` (unless verl's own ``delta_sharded`` checkpoint engine holds that slot, or this
  vLLM has no draft target in its RL API: then the by-name ``draft_align_load`` serves), the RL API's calls
  forwarded to its ``AsyncLLM``, ``draft_align_rpc`` (a ``collective_rpc`` that returns the workers' answers:
  verl's returns nothing) and level-1 sleep, which keeps every weight (the draft's included) in host memory,
  where level 2 would discard the draft;
- :class:`DraftAlignReplica` and :func:`install_rollout`: verl's ``vLLMReplica`` building those servers,
  registered as verl's ``vllm`` rollout in the driver process before the trainer builds its replicas;
- :class:`ServersEngine`: the LLM-shaped handle on the server actors (``collective_rpc``,
  ``reset_prefix_cache``, the RL API's ``init_weight_transfer_engine`` / ``start_draft_weight_update`` /
  ``update_weights`` / ``finish_weight_update``, ``llm_engine.vllm_config``).

The acceptance probe of :class:`~draft_align.engines.vllm.refresher.ProbeGuard` needs ``LLM.generate`` and is
not offered here: a failed or refused load keeps the previous version, an acceptance collapse does not yet roll
back.  Imports vLLM and verl: used only in a verl job on a GPU (not yet run on one).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from draft_align.engines.vllm.draft_update import BACKEND
from draft_align.engines.vllm.worker_ext import RPC_NAMES
from draft_align.engines.vllm.worker_ext import DraftAlignWorkerExtension as _DraftAlignCalls
from draft_align.integrations.ray.runtime import import_ray


def has_draft_update_api() -> bool:
    """Whether this vLLM's RL weight-update API can target the draft (vLLM ≥ 0.32's ``start_draft_weight_update``)."""
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine
    except ImportError:
        return False
    return hasattr(WeightTransferEngine, "supports_draft_weight_update")


class DraftAlignWorkerExtension(vLLMColocateWorkerExtension, _DraftAlignCalls):
    """verl's colocate extension plus draft_align's worker calls (runs in each vLLM worker; ``self`` is the worker)."""


class DraftAlignHttpServer(vLLMHttpServer):
    """verl's vLLM server with the draft loader and level-1 sleep (module docstring)."""

    def _get_worker_extension_cls(self) -> str:
        return f"{DraftAlignWorkerExtension.__module__}.{DraftAlignWorkerExtension.__qualname__}"

    def _resolve_sleep_level(self) -> int:
        return 1  # level 2 discards the draft's weights; verl's sync restores only the target's

    def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(engine_kwargs)
        delta = getattr(getattr(self.config, "checkpoint_engine", None), "backend", None) == "delta_sharded"
        if has_draft_update_api() and not delta:
            engine_kwargs.setdefault("weight_transfer_config", {"backend": BACKEND})

    async def draft_align_init(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def draft_align_start(self) -> None:
        await self.engine.start_draft_weight_update()

    async def draft_align_update(self, update_info: dict[str, Any]) -> None:
        """The signed update through vLLM's RL API (the backend checks and loads it in every worker)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def draft_align_finish(self, weight_version: str | None) -> None:
        await self.engine.finish_weight_update(weight_version)

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
        transfer = SimpleNamespace(backend=BACKEND) if has_draft_update_api() else None
        self.llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(
                speculative_config=spec,
                weight_transfer_config=transfer,
                parallel_config=SimpleNamespace(worker_extension_cls=""),
            )
        )

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

    # vLLM's RL API, as LLM has it: the refresher's three calls become one call per server actor
    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        ray = import_ray()
        ray.get(
            [s.draft_align_init.remote(request["init_info"]) for s in self.servers], timeout=self.timeout_s
        )

    def start_draft_weight_update(self) -> None:
        self._each("draft_align_start")

    def update_weights(self, request: dict[str, Any]) -> None:
        self._each("draft_align_update", request["update_info"])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("draft_align_finish", weight_version)

    def _each(self, method: str, *args: Any) -> None:
        ray = import_ray()
        ray.get([getattr(s, method).remote(*args) for s in self.servers], timeout=self.timeout_s)
