"""A recording of the messages a receiver accepted, in wire format, to replay them later (docs/wire.md,
"Recordings").

A sidecar with ``sidecar.record_wire`` appends every valid message it handles to ``<run>/sidecar/wire.rec``;
``benchmarks/adapt_replay.py`` feeds such a file to sidecars with other settings, so that they can be compared
on the very same taps.  The file is ``MAGIC`` then entries::

    b"WREC" | f64 seconds since the recording began | u32 frame count | (u64 length | frame bytes)… | u32 crc32

little-endian, the CRC over everything after the entry's ``b"WREC"``.  Each message is re-encoded without a
MAC and without its sender's envelope (the recording was authenticated when it was received; a reader
decodes every entry with the wire's own validating decoder, so a forged or damaged file cannot yield a
message the wire would refuse).  A file cut short by a killed writer reads up to its last whole entry and
says how many bytes it left; a damaged entry before the end is a :class:`RecordingError`.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from draft_align.wire.codec import MAX_FRAMES, encode
from draft_align.wire.messages import Message, decode
from draft_align.wire.schema import DEFAULT_MAX_BYTES, DEFAULT_MAX_TOKENS, WireError

log = logging.getLogger(__name__)

MAGIC = b"DRAFT_ALIGN_WIRE_RECORDING 1\n"
_ENTRY = b"WREC"
_HEAD = struct.Struct("<dI")
_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")


class RecordingError(ValueError):
    """A recording that cannot be read: not one, damaged, or holding a message the wire refuses."""


class WireRecorder:
    """Appends messages to a recording.  A write that fails (a full disk) is logged once and ends the
    recording (``failed`` says why); the receiver it records for carries on."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.failed: str | None = None
        self.messages = 0
        self._t0 = time.monotonic()
        self._f: BinaryIO | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.exists() or self.path.stat().st_size == 0
            self._f = open(self.path, "ab")  # noqa: SIM115 - open for the recorder's lifetime
            if fresh:
                self._f.write(MAGIC)
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        self.failed = f"{type(e).__name__}: {e}"
        log.error("wire recording %s stopped: %s", self.path, self.failed)
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None

    def record(self, msg: Message) -> None:
        """Append ``msg`` (validated by the encoder as the wire would)."""
        if self._f is None:
            return
        frames = encode(msg, None)
        body = bytearray(_HEAD.pack(time.monotonic() - self._t0, len(frames)))
        for fr in frames:
            body += _LEN.pack(len(fr))
            body += fr
        try:
            self._f.write(_ENTRY + bytes(body) + _CRC.pack(zlib.crc32(body)))
            self._f.flush()
        except OSError as e:
            self._fail(e)
            return
        self.messages += 1

    def close(self) -> None:
        if self._f is None:
            return
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        except OSError as e:
            self._fail(e)
        self._f = None


class Recording:
    """A recording to read: ``for t, msg in Recording(path)``.  After a full pass ``entries`` counts the
    messages read and ``truncated_bytes`` the bytes of an unfinished last entry (0 when the file ended on
    an entry's boundary)."""

    def __init__(self, path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES, max_tokens: int = DEFAULT_MAX_TOKENS):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_tokens = max_tokens
        self.entries = 0
        self.truncated_bytes = 0

    def __iter__(self) -> Iterator[tuple[float, Message]]:
        self.entries = self.truncated_bytes = 0
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise RecordingError(f"{self.path}: cannot read ({e})") from e
        if not data.startswith(MAGIC):
            raise RecordingError(f"{self.path}: not a draft_align wire recording (no {MAGIC[:-1]!r} header)")
        view = memoryview(data)
        pos = len(MAGIC)
        while pos < len(data):
            start = pos
            entry = self._entry(view, pos)
            if entry is None:  # a writer killed mid-entry: everything before it stands
                self.truncated_bytes = len(data) - start
                log.warning("%s: last entry unfinished (%d bytes left unread)", self.path, self.truncated_bytes)
                return
            t, frames, pos = entry
            try:
                msg = decode(frames, None, max_bytes=self.max_bytes, max_tokens=self.max_tokens)
            except WireError as e:
                raise RecordingError(f"{self.path}: entry {self.entries} at byte {start}: {e}") from e
            self.entries += 1
            yield t, msg

    def _entry(self, view: memoryview, pos: int) -> tuple[float, list[bytes], int] | None:
        """(seconds, frames, next position) of the entry at ``pos``; None when the file ends inside it."""
        end = len(view)
        where = f"{self.path}: entry {self.entries} at byte {pos}"
        if end - pos < len(_ENTRY) + _HEAD.size:
            return None
        if bytes(view[pos:pos + len(_ENTRY)]) != _ENTRY:
            raise RecordingError(f"{where}: no entry marker (damaged file)")
        body_start = pos + len(_ENTRY)
        t, n = _HEAD.unpack_from(view, body_start)
        if not 2 <= n <= MAX_FRAMES:
            raise RecordingError(f"{where}: {n} frames (damaged file)")
        p = body_start + _HEAD.size
        frames: list[bytes] = []
        total = 0
        for _ in range(n):
            if end - p < _LEN.size:
                return None
            (size,) = _LEN.unpack_from(view, p)
            total += size
            if total > self.max_bytes:
                raise RecordingError(f"{where}: message of more than {self.max_bytes} bytes (damaged file)")
            p += _LEN.size
            if end - p < size:
                return None
            frames.append(bytes(view[p:p + size]))
            p += size
        if end - p < _CRC.size:
            return None
        (crc,) = _CRC.unpack_from(view, p)
        if zlib.crc32(view[body_start:p]) != crc:
            raise RecordingError(f"{where}: checksum mismatch (damaged file)")
        return t, frames, p + _CRC.size
