"""draft_align on a Ray cluster (docs/ray.md): Ray is the control plane (placement, discovery, supervision,
notification), the wire stays the data plane (taps over tcp with its HMAC, bounds and counted drops).

- :mod:`~draft_align.integrations.ray.runtime`: the one place Ray is imported; joining a running cluster;
  actor names; every RL-side Ray call bounded by a timeout;
- :mod:`~draft_align.integrations.ray.registry`: the named registry actor (rank endpoints, newest published
  version, rebuilt from the run folder) and :class:`RayNotifications`, the RL side's notification source;
- :mod:`~draft_align.integrations.ray.host`: one sidecar rank as a Ray actor (``max_restarts``, resume);
- :mod:`~draft_align.integrations.ray.gang`: a multi-rank sidecar as a Ray Train ``TorchTrainer`` gang;
- :mod:`~draft_align.integrations.ray.client`: the driver's handle (start or re-attach, ready, status, stop).

Nothing here imports Ray at import time.
"""
