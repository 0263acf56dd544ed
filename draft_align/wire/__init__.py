"""Policy ↔ sidecar wire: the schema and its validators (``schema``), the message dataclasses
(``messages``), the bytes, HMAC and envelope (``codec``), batch packing (``packing``), replay detection
(``replay``), and the ZeroMQ channels that carry them (``channel``, the only module that imports zmq)."""

from draft_align.wire.codec import Origin, encode, validate
from draft_align.wire.messages import (
    DraftPublished,
    HeadSync,
    Message,
    StepReport,
    TapBatch,
    TapPart,
    decode,
    decode_with_origin,
)
from draft_align.wire.packing import drop_nonfinite, pack_sequences
from draft_align.wire.schema import REASONS, WireError

__all__ = [
    "REASONS",
    "DraftPublished",
    "HeadSync",
    "Message",
    "Origin",
    "StepReport",
    "TapBatch",
    "TapPart",
    "WireError",
    "decode",
    "decode_with_origin",
    "drop_nonfinite",
    "encode",
    "pack_sequences",
    "validate",
]
