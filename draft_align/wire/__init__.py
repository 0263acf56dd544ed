"""Policy ↔ sidecar wire: versioned messages with strict validation and HMAC (``messages``), and the
ZeroMQ channels that carry them (``channel``, the only module that imports zmq)."""

from draft_align.wire.messages import (
    REASONS,
    DraftPublished,
    HeadSync,
    Message,
    StepReport,
    TapBatch,
    TapPart,
    WireError,
    decode,
    drop_nonfinite,
    encode,
    pack_sequences,
    validate,
)

__all__ = [
    "REASONS",
    "DraftPublished",
    "HeadSync",
    "Message",
    "StepReport",
    "TapBatch",
    "TapPart",
    "WireError",
    "decode",
    "drop_nonfinite",
    "encode",
    "pack_sequences",
    "validate",
]
