"""Rollout engines that serve published drafts (vLLM; SGLang is documented in docs/engines.md).

Nothing is imported here: ``draft_align.engines.vllm_engine`` imports vLLM lazily, inside its functions.
"""
