"""Adapters that attach draft_align to other RL frameworks (thin: they map a framework's hooks onto the Protocols
of ``tap/``, ``rl/`` and ``engines/``).

- ``trl/``: Hugging Face TRL's ``GRPOTrainer`` (docs/trl.md);
- ``ray/``: the sidecar hosted on a Ray cluster: an actor or a Ray Train gang, the run's registry (docs/ray.md);
- ``verl/``: verl 0.9: the Tap on its old-log-prob pass, the sidecar beside it on Ray, drafts into its vLLM
  servers (docs/verl.md; imports verl, which runs in its own venv).
"""
