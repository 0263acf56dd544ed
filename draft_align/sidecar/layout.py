"""Where a sidecar lives in a run folder: ``<run>/sidecar/`` and the sockets it binds (docs/formats.md).

The launcher (``cotrain.py``) and the RL side find the sidecar by these names; the monitor reads its files.
"""

SIDECAR_DIR = "sidecar"  # <run>/sidecar/
TRAINER_DIR = "trainer"  # <run>/sidecar/trainer/: the trainer checkpoint
STATE_FILE = "state.json"  # SidecarState, beside the trainer checkpoint
MONITOR_FILE = "monitor.jsonl"  # one monitoring row per RL step (lead rank)
PUBLISH_FILE = "publish.jsonl"  # one line per published version
PORT_FILE = "prometheus.port"  # the Prometheus page's port
READY_FILE = "ready.json"  # written once the sockets are bound: {"pid", "ppid", "time", "draft_version", …}
TAP_SOCKET = "tap"  # PULL: TapBatch / TapPart / HeadSync / StepReport from the policy side
NOTIFY_SOCKET = "notify"  # PUB: DraftPublished
