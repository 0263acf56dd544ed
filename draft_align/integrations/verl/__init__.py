"""draft_align beside verl 0.9 (docs/verl.md): verl's hooks mapped onto draft_align's Tap, wire, Ray sidecar,
DraftSource and draft refresher, nothing of those written again.  verl pins transformers<5.11, so it runs in
its own venv (``make verl-venv``); nothing here is imported by draft_align itself.

- :mod:`~draft_align.integrations.verl.tap`: the Tap on verl's old-log-prob pass through the FSDP engine's
  ``forward_step`` (packed and padded micro-batches, per-sample temperatures, the policy version from
  ``global_steps``), never on a reference pass;
- :mod:`~draft_align.integrations.verl.checks`: verl configurations refused at start, one line each;
- :mod:`~draft_align.integrations.verl.worker`: verl's ``ActorRolloutRefWorker`` with the Tap on its
  ``compute_log_prob`` and the version from its ``update_weights``;
- :mod:`~draft_align.integrations.verl.driver`: on the driver, the sidecar on its own Ray resources (the Ray
  integration's actor), step reports, drafts picked up and pushed to the rollout servers, ``draft_align/…``
  metrics merged into verl's tracking;
- :mod:`~draft_align.integrations.verl.server`: the vLLM worker extension and server that load a verified
  draft in place and keep it through sleep (imports vLLM: a GPU job only).
"""
