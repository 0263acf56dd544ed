"""``draft-align push``: the process beside a fleet of vLLM servers that keeps every server on a run's newest
published draft, through vLLM's own RL weight-update API (docs/servers.md).

- ``follow.py``: the run's newest verified version (the sidecar's notifications, ``latest`` as the fallback),
  each version verified once;
- ``fleet.py``: one state per server (version serving, lag, failures, refusals, measured acceptance) and the
  push of a version to each server that is behind, with retries and backoff, never to an older version;
- ``loop.py``: the long-running loop, the servers file it re-reads, the state rows (``<run>/push/push.jsonl``)
  and the Prometheus page.
"""
