"""The reference engine: a lossless chain speculative decoder in plain PyTorch, beside vLLM (docs/acceptance.md).

- :mod:`.specdec`: :class:`~.specdec.SpecDecoder` (batch size 1, an HF target with its KV cache and a draft head
  with its own) and :func:`~.specdec.verify_chain`, the verification rules engines follow;
- :mod:`.reference_eval`: ``draft-align eval --engine reference``: decode with it, count its rounds as the
  measurement, and score the outputs as :mod:`draft_align.engines.vllm.vllm_eval` does vLLM's.

The RL job's reference rollouts (``rl.engine.kind: reference``) decode with it too.
"""
