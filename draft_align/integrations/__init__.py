"""Adapters that attach draft_align to other RL frameworks (thin: they map a framework's hooks onto the Protocols
of ``tap/``, ``rl/`` and ``engines/``).

- ``trl/``: Hugging Face TRL's ``GRPOTrainer`` (docs/trl.md);
- ``ray/``: the sidecar hosted on a Ray cluster: an actor or a Ray Train gang, the run's registry (docs/ray.md).
"""
