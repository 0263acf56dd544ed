"""A recording of the messages a receiver accepted, in wire format, to play them back later (docs/wire.md,
"Recordings").

A sidecar with ``sidecar.recording.enabled`` appends every valid message it handles to ``<run>/sidecar/wire.rec``;
``benchmarks/adapt_playback.py`` feeds such a file to sidecars with other settings, so that they can be compared
on the very same taps.  The file is ``MAGIC`` then entries::

    b"WREC" | f64 seconds since the recording began | u32 frame count | (u64 length | frame bytes)… | u32 crc32

little-endian, the CRC over everything after the entry's ``b"WREC"``.  Each message is re-encoded without a
MAC and without its sender's envelope (the recording was authenticated when it was received; a reader
decodes every entry with the wire's own validating decoder, so a forged or damaged file cannot yield a
message the wire would refuse).

Damage.  A file cut short by a killed writer reads up to its last whole entry and says how many bytes it
left.  Bytes that are no whole entry but are followed by one (a flipped bit, a damaged length field) are
damage: a :class:`RecordingError` naming the entry, or, with ``skip_damaged``, counted and stepped over to the
next whole entry (found by its marker and checksum).  A recorder that reopens a file (a restarted sidecar)
cuts only what follows its last whole entry; damage before a whole entry is kept, reported in one line, and
appended after.
Reads use ``pread`` on a file descriptor, never a memory map: a file that shrinks while it is read ends the
read like a cut file.

Limits.  A recorder refuses a symbolic link or anything but a regular file at its path, creates the file
0600 (it holds every tapped hidden state and token id, like the wire key) and narrows an existing one to
0600.  ``max_file_bytes`` caps the file and ``reserve_bytes`` keeps that much free space on its filesystem:
the entry that would pass either stops the recording with one line.  No failure of a recorder reaches its
caller: it logs one line, sets ``failed`` and records nothing more.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
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
RECORDING_MODE = 0o600  # owner only, as the wire key: the file is a copy of every tapped hidden state
_ENTRY = b"WREC"
_HEAD = struct.Struct("<dI")
_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_SCAN_CHUNK = 1 << 20  # bytes read at a time while looking for the next whole entry after damage


class RecordingError(ValueError):
    """A recording that cannot be read: not one, damaged, or holding a message the wire refuses."""


# --------------------------------------------------------------------------------------- reading
def _read_at(fd: int, pos: int, n: int) -> bytes:
    """Up to ``n`` bytes at ``pos`` (fewer only where the file ends, e.g. it shrank since it was opened)."""
    parts, got = [], 0
    while got < n:
        b = os.pread(fd, min(n - got, 1 << 30), pos + got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _entry(fd: int, end: int, pos: int, max_bytes: int) -> tuple[float, list[bytes], int] | None:
    """(seconds, frames, next position) of the entry at ``pos`` in the first ``end`` bytes; None when the
    file ends inside it; RecordingError (the reason alone) when it is damaged."""
    head = _read_at(fd, pos, len(_ENTRY) + _HEAD.size)
    if len(head) < len(_ENTRY) + _HEAD.size and _ENTRY.startswith(head[: len(_ENTRY)]):
        return None
    if head[: len(_ENTRY)] != _ENTRY:
        raise RecordingError("no entry marker")
    t, n = _HEAD.unpack_from(head, len(_ENTRY))
    if not 2 <= n <= MAX_FRAMES:
        raise RecordingError(f"{n} frames")
    crc = zlib.crc32(head[len(_ENTRY) :])
    p = pos + len(head)
    frames: list[bytes] = []
    total = 0
    for _ in range(n):
        lb = _read_at(fd, p, _LEN.size)
        if len(lb) < _LEN.size:
            return None
        (size,) = _LEN.unpack(lb)
        total += size
        if total > max_bytes:
            raise RecordingError(f"a message of more than {max_bytes} bytes")
        if end - (p + _LEN.size) < size:
            return None
        fr = _read_at(fd, p + _LEN.size, size)
        if len(fr) < size:
            return None
        crc = zlib.crc32(fr, zlib.crc32(lb, crc))
        frames.append(fr)
        p += _LEN.size + size
    cb = _read_at(fd, p, _CRC.size)
    if len(cb) < _CRC.size:
        return None
    if _CRC.unpack(cb)[0] != crc:
        raise RecordingError("checksum mismatch")
    return t, frames, p + _CRC.size


def _next_whole(fd: int, end: int, start: int, max_bytes: int) -> int | None:
    """The offset of the first whole, undamaged entry at or after ``start`` (its marker and checksum
    found), or None."""
    pos = start
    while pos < end:
        want = min(_SCAN_CHUNK, end - pos)
        chunk = _read_at(fd, pos, want)
        if len(chunk) < want:  # a short read: the file shrank while it is read; its end is here now
            end = pos + len(chunk)
        if not chunk:
            return None
        i = chunk.find(_ENTRY)
        while i != -1:
            try:
                if _entry(fd, end, pos + i, max_bytes) is not None:
                    return pos + i
            except RecordingError:
                pass
            i = chunk.find(_ENTRY, i + 1)
        if pos + len(chunk) >= end:
            return None
        pos += max(1, len(chunk) - (len(_ENTRY) - 1))  # a marker may straddle two chunks; always forward
    return None


def _walk(
    fd: int, end: int, max_bytes: int
) -> Iterator[tuple[str, int, int, str, tuple[float, list[bytes]] | None]]:
    """The file's parts after MAGIC, in order, as (kind, start, stop, why, (seconds, frames)): ``entry``
    (whole), ``damage`` (bytes that are no whole entry, up to the next whole one or the end), ``tail`` (an
    unfinished last entry, to the end)."""
    pos = len(MAGIC)
    while pos < end:
        why = ""
        try:
            got = _entry(fd, end, pos, max_bytes)
        except RecordingError as e:
            got, why = None, str(e)
        if got is not None:
            yield "entry", pos, got[2], "", (got[0], got[1])
            pos = got[2]
            continue
        nxt = _next_whole(fd, end, pos + 1, max_bytes)
        if not why:  # runs past the end of the file: a cut, unless a whole entry follows
            if nxt is None:
                yield "tail", pos, end, "", None
                return
            why = f"runs past the next whole entry at byte {nxt} (damaged length field)"
        stop = end if nxt is None else nxt
        yield "damage", pos, stop, why, None
        pos = stop


def _open_read(path: Path) -> tuple[int, int]:
    """(fd, size) of the recording at ``path``, its MAGIC checked; RecordingError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    except OSError as e:
        raise RecordingError(f"{path}: cannot read ({e})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordingError(f"{path}: not a regular file")
        size = st.st_size
        if _read_at(fd, 0, len(MAGIC)) != MAGIC:
            raise RecordingError(f"{path}: not a draft_align wire recording (no {MAGIC[:-1]!r} header)")
    except BaseException:
        os.close(fd)
        raise
    return fd, size


class Recording:
    """A recording to read: ``for t, msg in Recording(path)``.  After a full pass ``entries`` counts the
    messages read, ``truncated_bytes`` the bytes of an unfinished last entry (0 when the file ended on an
    entry's boundary) and, with ``skip_damaged``, ``damaged`` / ``damaged_bytes`` the damaged stretches
    stepped over (without it, the first one is a :class:`RecordingError`)."""

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        skip_damaged: bool = False,
    ):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_tokens = max_tokens
        self.skip_damaged = skip_damaged
        self.entries = 0
        self.truncated_bytes = 0
        self.damaged = 0
        self.damaged_bytes = 0

    def _damage(self, start: int, stop: int, why: str) -> None:
        where = f"{self.path}: entry {self.entries} at byte {start}"
        if not self.skip_damaged:
            raise RecordingError(
                f"{where}: {why} (damaged file; {stop - start} bytes up to byte {stop}; "
                f"Recording(..., skip_damaged=True) reads the whole entries around it)"
            )
        self.damaged += 1
        self.damaged_bytes += stop - start
        log.warning("%s: %s: %d damaged bytes skipped", where, why, stop - start)

    def __iter__(self) -> Iterator[tuple[float, Message]]:
        self.entries = self.truncated_bytes = self.damaged = self.damaged_bytes = 0
        fd, size = _open_read(self.path)
        try:
            for kind, start, stop, why, got in _walk(fd, size, self.max_bytes):
                if kind == "tail":  # a writer killed mid-entry (or the file shrank): everything before stands
                    self.truncated_bytes = stop - start
                    log.warning(
                        "%s: last entry unfinished (%d bytes left unread)", self.path, self.truncated_bytes
                    )
                    return
                if kind == "damage":
                    self._damage(start, stop, why)
                    continue
                assert got is not None
                t, frames = got
                try:  # the decoded tensors own their memory (decode_frames copies them)
                    msg = decode(frames, None, max_bytes=self.max_bytes, max_tokens=self.max_tokens)
                except WireError as e:
                    self._damage(start, stop, f"a message the wire refuses: {e}")
                    continue
                self.entries += 1
                yield t, msg
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------- writing
def _free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


class WireRecorder:
    """Appends messages to a recording (see the module docstring for damage, modes and limits).

    ``max_file_bytes``: the file's cap (None: none); ``reserve_bytes``: free space on the file's filesystem
    that recording never takes.  ``failed`` says why the recording stopped (None while it records).
    """

    def __init__(self, path: Path, *, max_file_bytes: int | None = None, reserve_bytes: int = 0) -> None:
        self.path = Path(path)
        self.max_file_bytes = max_file_bytes
        self.reserve_bytes = int(reserve_bytes)
        self.failed: str | None = None
        self.messages = 0
        self.size = 0
        self._t0 = time.monotonic()
        self._f: BinaryIO | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = self._open()
            self.size = os.fstat(self._f.fileno()).st_size
            if self.size == 0:
                self._f.write(MAGIC)
                self._f.flush()
                self.size = len(MAGIC)
            else:
                self._resume()
        except Exception as e:  # never into the receiver's loop
            self._fail(str(e) if isinstance(e, RecordingError) else f"{type(e).__name__}: {e}")

    def _open(self) -> BinaryIO:
        """The file for appending: never through a symbolic link, a regular file only, mode 0600."""
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, RECORDING_MODE)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RecordingError(
                    f"{self.path} is a symbolic link: refused (remove it; a recording is written in place)"
                ) from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RecordingError(f"{self.path} is not a regular file: refused (remove it)")
            if stat.S_IMODE(st.st_mode) != RECORDING_MODE:
                os.fchmod(fd, RECORDING_MODE)
            os.set_blocking(fd, True)
            return os.fdopen(fd, "ab")
        except BaseException:
            os.close(fd)
            raise

    def _resume(self) -> None:
        """An existing file: a recording's, or refused.  What follows its last whole entry (an unfinished
        entry of a killed writer, or damage with nothing whole after it) is cut; damage before a whole entry is
        kept (readers step over it with ``skip_damaged``) and reported in one line."""
        assert self._f is not None
        fd = self._f.fileno()
        if _read_at(fd, 0, len(MAGIC)) != MAGIC:
            raise RecordingError(f"{self.path}: not a draft_align wire recording (no {MAGIC[:-1]!r} header)")
        damaged, first, last = 0, -1, len(MAGIC)
        for kind, start, stop, _, _ in _walk(fd, self.size, DEFAULT_MAX_BYTES):
            if kind == "entry":
                last = stop
            elif kind == "damage" and stop < self.size:
                damaged += stop - start
                first = start if first < 0 else first
        if last < self.size:
            log.warning(
                "wire recording %s: dropping %d bytes after its last whole entry", self.path, self.size - last
            )
            os.ftruncate(fd, last)
            self.size = last
        if damaged:
            log.warning(
                "wire recording %s: %d damaged bytes from byte %d kept before later whole entries; appending "
                "after them (Recording(..., skip_damaged=True) reads every whole entry)",
                self.path,
                damaged,
                first,
            )

    def _fail(self, why: str) -> None:
        self.failed = why
        log.error("wire recording %s stopped: %s", self.path, why)
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None

    def record(self, msg: Message) -> None:
        """Append ``msg`` (validated by the encoder as the wire would), frame by frame; never raises."""
        if self._f is None:
            return
        try:
            frames = encode(msg, None)
            parts = [_HEAD.pack(time.monotonic() - self._t0, len(frames))]
            for fr in frames:
                parts += [_LEN.pack(len(fr)), fr]
            crc = 0
            for part in parts:
                crc = zlib.crc32(part, crc)
            n = len(_ENTRY) + sum(len(p) for p in parts) + _CRC.size
            if self.max_file_bytes is not None and self.size + n > self.max_file_bytes:
                self._fail(
                    f"the next entry would pass the recording's cap of {self.max_file_bytes >> 20} MiB "
                    f"({self.messages} messages recorded; a sidecar's cap is sidecar.recording.max_mb)"
                )
                return
            free = _free_bytes(self.path.parent)
            if free - n < self.reserve_bytes:
                self._fail(
                    f"{free >> 20} MiB free on its disk, {self.reserve_bytes >> 20} MiB kept in reserve for "
                    f"checkpoints and publishes ({self.messages} messages recorded)"
                )
                return
            self._f.writelines([_ENTRY, *parts, _CRC.pack(crc)])
            self._f.flush()
        except Exception as e:  # never into the receiver's loop; a half-written entry is cut later
            self._fail(f"{type(e).__name__}: {e}")
            return
        self.size += n
        self.messages += 1

    def close(self) -> None:
        if self._f is None:
            return
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        except OSError as e:
            self._fail(f"{type(e).__name__}: {e}")
        self._f = None
