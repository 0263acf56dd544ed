"""vLLM's plugin hook (entry point ``vllm.general_plugins``: ``draft_align``): registers the ``draft_align``
weight-transfer backend (:mod:`draft_align.engines.vllm.transfer`) by module path, so it is imported only in
a worker whose engine is configured with ``{"backend": "draft_align"}``.  vLLM calls this in every process it
starts, possibly more than once: registering again is a no-op."""

from __future__ import annotations

from draft_align.engines.vllm.draft_update import BACKEND


def register() -> None:
    """Register the backend with ``WeightTransferEngineFactory`` (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "draft_align.engines.vllm.transfer", "DraftAlignTransferEngine"
        )
