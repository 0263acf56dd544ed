"""Rollout engines that serve published drafts (vLLM in :mod:`draft_align.engines.vllm`; SGLang is documented
in docs/engines.md), and the engine-neutral records an engine and the RL job exchange
(:mod:`draft_align.engines.rollout_types`).

Nothing is imported here: vLLM is imported lazily, inside the functions that need it.
"""
