"""GPU only — written against TRL 1.16 and vLLM, NOT YET RUN ON A GPU: TRL's colocate vLLM engine with an
EAGLE-3 draft, driven by draft_align's rollout_func.

- :func:`speculative_colocate` (a context around ``GRPOTrainer(...)``) makes TRL's colocate ``LLM(...)`` start
  with ``speculative_config = {"method": "eagle3", "model": <draft>, "num_speculative_tokens": k}`` and its
  statistics on (the spec-decode counters are how acceptance is measured);
- :func:`colocate_rollouts` wraps ``trainer.vllm_generation.llm`` in draft_align's
  :class:`~draft_align.engines.vllm.vllm_rollouts.VLLMRollouts` with ``policy_sync="external"``: TRL syncs the
  policy itself (``vllm_generation.sync_weights`` before each rollout_func call), the refresher hot-swaps
  drafts into the same engine, frozen/adapted rollouts are split as on CPU, and TRL's importance-sampling
  correction uses the engine's log-probs.
- ``vllm_enable_sleep_mode`` is refused at start (:mod:`~draft_align.integrations.trl.checks`): level-2
  sleep discards all weights and TRL re-pushes only the policy's, which would silently wipe the draft.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draft_align.config import RLEngineConfig
from draft_align.config.sections import TargetConfig
from draft_align.conventions import AUTO_VERIFY_MODE
from draft_align.engines.rollout_types import DraftVersion
from draft_align.engines.vllm.draft_update import BACKEND
from draft_align.engines.vllm.vllm_rollouts import VERIFY_TO_SAMPLE_METHOD, VLLMRollouts
from draft_align.engines.vllm.worker_ext import EXTENSION


@contextlib.contextmanager
def speculative_colocate(draft: DraftVersion, *, k: int, verify_mode: str = "greedy_draft") -> Iterator[None]:
    """Inside: TRL's colocate engine is built with ``draft`` as its EAGLE-3 speculative draft."""
    import trl.generation.vllm_generation as vg

    original = vg.LLM
    spec = {
        "method": "eagle3",
        "model": str(draft.path),
        "num_speculative_tokens": int(k),
        "draft_sample_method": VERIFY_TO_SAMPLE_METHOD[verify_mode],
    }

    def build(*args: Any, **kwargs: Any) -> Any:
        kwargs["speculative_config"] = spec
        kwargs["disable_log_stats"] = False
        kwargs.setdefault("weight_transfer_config", {"backend": BACKEND})  # drafts through vLLM's RL API
        kwargs.setdefault("worker_extension_cls", EXTENSION)  # draft_align's worker calls by name
        return original(*args, **kwargs)

    vg.LLM = build
    try:
        yield
    finally:
        vg.LLM = original


def colocate_rollouts(
    trainer: Any,
    frozen: DraftVersion,
    engine: RLEngineConfig,
    target: TargetConfig,
    *,
    run_dir: Path,
    key_file: str | None,
) -> VLLMRollouts:
    """draft_align's rollouts on TRL's own colocate engine (built inside :func:`speculative_colocate`): ``engine``
    (``rl.engine``) sets k and the verify mode; ``run_dir`` and ``key_file`` (``wire.key_file``) are the run's."""
    from draft_align.integrations.trl.checks import TRLConfigError

    if trainer.vllm_mode != "colocate":
        raise TRLConfigError(
            "use_vllm with vllm_mode='server': draft_align cannot reach the server's engine to swap drafts or read "
            "its counters; use vllm_mode='colocate' (GPU) or use_vllm=False with draft_align's rollout_func (CPU)"
        )
    if engine.verify_mode == AUTO_VERIFY_MODE:
        raise TRLConfigError(
            "rl.engine.verify_mode=auto measures both draft sampling methods on draft_align's probe "
            "prompts, which TRL's colocate engine is not given: choose greedy_draft or probabilistic"
        )
    return VLLMRollouts(
        target.model,
        frozen,
        k=engine.spec_k,
        verify_mode=engine.verify_mode,
        dtype=target.dtype,
        llm=trainer.vllm_generation.llm,
        policy_sync="external",
        run_dir=run_dir,
        key_file=key_file,
    )
