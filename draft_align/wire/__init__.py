"""Policy ↔ sidecar wire (docs/wire.md): it knows schemas, not models.

- ``schema.py``: constants, rejection reasons, :class:`WireError`, field and tensor specs, validators;
- ``messages.py``: the message dataclasses and ``decode``; ``codec.py``: bytes, HMAC and the envelope;
- ``packing.py``: ragged TapBatch packing; ``join.py``: pipeline stages' TapParts joined into TapBatches;
- ``sequence_guard.py``: the sequence guard (per-sender sequence numbers under the MAC);
- ``keys.py``: the HMAC key; ``endpoints.py``: ipc/tcp endpoint names;
- ``sockets.py``, ``sender.py``, ``channel.py``: the ZeroMQ side (the only modules that import zmq): socket
  rules and handshake, the policy's non-blocking :class:`TapSender`, the receivers and draft announcements;
- ``recording.py``: a file of the messages a receiver accepted, for playback later.
"""

from draft_align.wire.codec import Origin, encode, validate
from draft_align.wire.messages import (
    BatchHeader,
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
    "BatchHeader",
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
