"""Rollout engines that serve published drafts. Nothing is imported here: vLLM is imported lazily, inside the
functions that need it; SGLang is documented in docs/engines.md.

- ``rollout_types.py``: what the RL job and an engine exchange, engine-neutral;
- ``client_check.py``: ``draft-align export --check CLIENT``: a client's own loader, or the rule-based check;
- ``reference/``: the lossless reference decoder in plain PyTorch (batch 1) and ``draft-align eval`` on it;
- ``vllm/``: vLLM as the rollout engine (start, counters, hot refresh, rollouts, eval).
"""
