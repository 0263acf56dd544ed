"""Draft training: records in, one optimizer step at a time (nothing of sidecars or sockets).

- ``records.py``: the record types every part shares (captured, tapped) and their batches;
- ``losses.py``: the TTT losses (soft/hard CE, acceptance objectives), memory-bounded;
- ``fused_lse.py``: Σ logsumexp over a large vocabulary with its gradient formed in the forward pass;
- ``objective.py``: :class:`LossSettings` and the TTT objective of one batch;
- ``precision.py``: whether training autocasts to bf16;
- ``trainer.py``: the draft trainer (AdamW, warmup/cosine, clipping);
- ``checkpoint.py``: trainer checkpoints on disk (safetensors + JSON, no pickle);
- ``replay.py``: the sidecar's replay buffer (token-bounded, recency-weighted, held-out tail);
- ``store.py``: on-disk caches of warm-start data (responses, captured states);
- ``parallel.py``: one draft trained on several ranks (torchrun: DDP or FSDP2).
"""
