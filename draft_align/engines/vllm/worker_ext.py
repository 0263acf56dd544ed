"""The worker extension vLLM mixes into each of its workers (``worker_extension_cls``): draft_align's worker
calls by name, so no Python callable is pickled across the engine boundary (a multiprocess engine, every
``vllm serve``, needs no ``VLLM_ALLOW_INSECURE_SERIALIZATION``).

:func:`~draft_align.engines.vllm.start.start_engine` starts every engine with it, and
:func:`~draft_align.engines.vllm.start.collective_rpc` sends a module-level function of
:mod:`~draft_align.engines.vllm.worker_rpc` as the name in :data:`RPC_NAMES` whenever the engine has it.  A server
started by hand gets it with ``--worker-extension-cls draft_align.engines.vllm.worker_ext.DraftAlignWorkerExtension``
(only for ``/collective_rpc``'s ``draft_align_describe``; draft updates need only the weight-transfer backend).
"""

from __future__ import annotations

from typing import Any

from draft_align.engines.vllm.cpu_patch import rpc_patch_cpu_expand_kernel
from draft_align.engines.vllm.worker_rpc import (
    rpc_describe,
    rpc_load_draft,
    rpc_load_policy_layers,
    rpc_set_draft_sample_method,
)

EXTENSION = "draft_align.engines.vllm.worker_ext.DraftAlignWorkerExtension"

#: The method each worker function is called by on an engine with the extension.
RPC_NAMES: dict[Any, str] = {
    rpc_describe: "draft_align_describe",
    rpc_load_draft: "draft_align_load",
    rpc_load_policy_layers: "draft_align_load_policy_layers",
    rpc_set_draft_sample_method: "draft_align_set_draft_sample_method",
    rpc_patch_cpu_expand_kernel: "draft_align_patch_cpu_expand_kernel",
}


class DraftAlignWorkerExtension:
    """Mixed into vLLM's worker (``self`` is the worker): each method runs the worker function of its name."""

    def draft_align_describe(self) -> dict[str, Any]:
        info = rpc_describe(self)
        backend = getattr(self, "weight_transfer_engine", None)
        if backend is not None and hasattr(backend, "describe"):
            info["backend"] = backend.describe()
        return info

    def draft_align_load(
        self, weights_path: str, sha256: str, record: dict[str, Any], tensors: Any = None
    ) -> dict[str, Any]:
        return rpc_load_draft(self, weights_path, sha256, record, tensors)

    def draft_align_load_policy_layers(self, weights: Any, version: int) -> dict[str, Any]:
        return rpc_load_policy_layers(self, weights, version)

    def draft_align_set_draft_sample_method(self, method: str) -> str:
        return rpc_set_draft_sample_method(self, method)

    def draft_align_patch_cpu_expand_kernel(self) -> bool:
        return rpc_patch_cpu_expand_kernel(self)
