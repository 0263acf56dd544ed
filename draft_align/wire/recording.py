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
says how many bytes it left; a damaged entry before the end is a :class:`RecordingError`.  A recorder that
reopens such a file (a restarted sidecar) first cuts it back to its last whole entry, so what it appends
stays readable; it never appends to a file that is not a recording.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

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
            self._f = open(self.path, "ab")  # noqa: SIM115 - open for the recorder's lifetime
            if self._f.tell() == 0:
                self._f.write(MAGIC)
            else:
                self._trim()
        except (OSError, RecordingError) as e:
            self._fail(e)

    def _trim(self) -> None:
        """An existing recording: cut an unfinished or damaged tail back to the last whole entry."""
        assert self._f is not None
        size = self._f.tell()
        end = whole_end(self.path)
        if end < size:
            log.warning(
                "wire recording %s: dropping %d bytes after its last whole entry", self.path, size - end
            )
            self._f.truncate(end)
            self._f.seek(end)

    def _fail(self, e: Exception) -> None:
        self.failed = f"{type(e).__name__}: {e}"
        log.error("wire recording %s stopped: %s", self.path, self.failed)
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None

    def record(self, msg: Message) -> None:
        """Append ``msg`` (validated by the encoder as the wire would), frame by frame."""
        if self._f is None:
            return
        frames = encode(msg, None)
        parts = [_HEAD.pack(time.monotonic() - self._t0, len(frames))]
        for fr in frames:
            parts += [_LEN.pack(len(fr)), fr]
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        try:
            self._f.writelines([_ENTRY, *parts, _CRC.pack(crc)])
            self._f.flush()
        except OSError as e:  # a half-written entry is cut back by the next recorder, skipped by a reader
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


def _mapped(path: Path) -> memoryview:
    """The file's bytes, memory-mapped (an empty file: empty); RecordingError when it is not a recording."""
    try:
        with open(path, "rb") as f:
            data: Any = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
            )
    except OSError as e:
        raise RecordingError(f"{path}: cannot read ({e})") from e
    if bytes(data[: len(MAGIC)]) != MAGIC:
        raise RecordingError(f"{path}: not a draft_align wire recording (no {MAGIC[:-1]!r} header)")
    return memoryview(data)


def whole_end(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """The byte offset just past the last whole, undamaged entry of the recording at ``path``."""
    view = _mapped(path)
    pos, n = len(MAGIC), 0
    while pos < len(view):
        try:
            entry = _entry(view, pos, max_bytes, f"{path}: entry {n} at byte {pos}")
        except RecordingError:
            return pos
        if entry is None:
            return pos
        pos, n = entry[2], n + 1
    return pos


def _entry(
    view: memoryview, pos: int, max_bytes: int, where: str
) -> tuple[float, list[memoryview], int] | None:
    """(seconds, frames, next position) of the entry at ``pos``; None when the file ends inside it;
    RecordingError when it is damaged."""
    end = len(view)
    if end - pos < len(_ENTRY) + _HEAD.size:
        return None
    if bytes(view[pos : pos + len(_ENTRY)]) != _ENTRY:
        raise RecordingError(f"{where}: no entry marker (damaged file)")
    body_start = pos + len(_ENTRY)
    t, n = _HEAD.unpack_from(view, body_start)
    if not 2 <= n <= MAX_FRAMES:
        raise RecordingError(f"{where}: {n} frames (damaged file)")
    p = body_start + _HEAD.size
    frames: list[memoryview] = []
    total = 0
    for _ in range(n):
        if end - p < _LEN.size:
            return None
        (size,) = _LEN.unpack_from(view, p)
        total += size
        if total > max_bytes:
            raise RecordingError(f"{where}: message of more than {max_bytes} bytes (damaged file)")
        p += _LEN.size
        if end - p < size:
            return None
        frames.append(view[p : p + size])
        p += size
    if end - p < _CRC.size:
        return None
    (crc,) = _CRC.unpack_from(view, p)
    if zlib.crc32(view[body_start:p]) != crc:
        raise RecordingError(f"{where}: checksum mismatch (damaged file)")
    return t, frames, p + _CRC.size


class Recording:
    """A recording to read: ``for t, msg in Recording(path)``.  After a full pass ``entries`` counts the
    messages read and ``truncated_bytes`` the bytes of an unfinished last entry (0 when the file ended on
    an entry's boundary)."""

    def __init__(
        self, path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES, max_tokens: int = DEFAULT_MAX_TOKENS
    ):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_tokens = max_tokens
        self.entries = 0
        self.truncated_bytes = 0

    def __iter__(self) -> Iterator[tuple[float, Message]]:
        self.entries = self.truncated_bytes = 0
        view = _mapped(self.path)
        pos = len(MAGIC)
        while pos < len(view):
            start = pos
            entry = _entry(view, pos, self.max_bytes, f"{self.path}: entry {self.entries} at byte {pos}")
            if entry is None:  # a writer killed mid-entry: everything before it stands
                self.truncated_bytes = len(view) - start
                log.warning(
                    "%s: last entry unfinished (%d bytes left unread)", self.path, self.truncated_bytes
                )
                return
            t, frames, pos = entry
            try:  # the decoded tensors own their memory (decode_frames copies them)
                msg = decode(frames, None, max_bytes=self.max_bytes, max_tokens=self.max_tokens)
            except WireError as e:
                raise RecordingError(f"{self.path}: entry {self.entries} at byte {start}: {e}") from e
            self.entries += 1
            yield t, msg
