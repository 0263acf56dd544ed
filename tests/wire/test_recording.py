"""wire/recording.py: a recording reads back the messages written, in order and exactly; a file cut short
reads to its last whole entry; damage, a foreign file and a full disk are one clear error each."""

from __future__ import annotations

import errno

import pytest
import torch

from draft_align.wire.messages import HeadSync, StepReport, TapBatch
from draft_align.wire.recording import MAGIC, Recording, RecordingError, WireRecorder


def _messages():
    return [HeadSync.make_dummy(policy_version=3), TapBatch.make_dummy(), StepReport.make_dummy(step=3)]


def _same(a, b) -> None:
    assert type(a) is type(b)
    for name, t in a.tensors().items():
        assert torch.equal(t, b.tensors()[name]), name
    assert {k: v for k, v in vars(a).items() if not isinstance(v, torch.Tensor)} == {
        k: v for k, v in vars(b).items() if not isinstance(v, torch.Tensor)
    }


def _write(path, msgs) -> WireRecorder:
    rec = WireRecorder(path)
    for m in msgs:
        rec.record(m)
    rec.close()
    return rec


def test_round_trip_in_order_and_appending(tmp_path):
    path = tmp_path / "wire.rec"
    msgs = _messages()
    assert _write(path, msgs[:2]).messages == 2
    _write(path, msgs[2:])  # a reopened recording appends, with one header
    rec = Recording(path)
    got = list(rec)
    assert [type(m) for _, m in got] == [type(m) for m in msgs] and rec.entries == 3
    for (_, a), b in zip(got, msgs, strict=True):
        _same(a, b)
    times = [t for t, _ in got[:2]]
    assert times == sorted(times) and all(t >= 0 for t in times)
    assert path.read_bytes().count(MAGIC) == 1 and rec.truncated_bytes == 0


def test_a_file_cut_short_reads_to_its_last_whole_entry(tmp_path):
    path = tmp_path / "wire.rec"
    _write(path, _messages())
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) - 40, len(data) - 200):
        path.write_bytes(data[:cut])
        rec = Recording(path)
        assert len(list(rec)) == 2 and rec.truncated_bytes > 0


def test_damage_and_foreign_files_are_one_clear_error(tmp_path):
    path = tmp_path / "wire.rec"
    _write(path, _messages())
    data = bytearray(path.read_bytes())
    flipped = bytearray(data)
    flipped[len(MAGIC) + 40] ^= 0xFF  # inside the first entry's header frame
    path.write_bytes(bytes(flipped))
    with pytest.raises(RecordingError, match="entry 0 .*checksum mismatch"):
        list(Recording(path))
    marker = bytearray(data)
    marker[len(MAGIC)] ^= 0x01
    path.write_bytes(bytes(marker))
    with pytest.raises(RecordingError, match="no entry marker"):
        list(Recording(path))
    path.write_bytes(b"not a recording at all")
    with pytest.raises(RecordingError, match="not a draft_align wire recording"):
        list(Recording(path))
    with pytest.raises(RecordingError, match="cannot read"):
        list(Recording(tmp_path / "missing.rec"))


def test_a_message_the_wire_refuses_is_refused_from_a_recording_too(tmp_path):
    """A forged entry with a correct checksum still goes through the wire's validating decoder."""
    import struct
    import zlib

    from draft_align.wire.codec import encode

    frames = encode(StepReport.make_dummy(), None)
    frames[0] = frames[0].replace(b'"step":0', b'"step":-5')
    body = struct.pack("<dI", 0.0, len(frames)) + b"".join(struct.pack("<Q", len(f)) + f for f in frames)
    path = tmp_path / "forged.rec"
    path.write_bytes(MAGIC + b"WREC" + body + struct.pack("<I", zlib.crc32(body)))
    with pytest.raises(RecordingError, match="entry 0 at byte"):
        list(Recording(path))


def test_a_full_disk_ends_the_recording_with_one_error_and_nothing_raised(tmp_path, monkeypatch, caplog):
    path = tmp_path / "wire.rec"
    rec = WireRecorder(path)
    rec.record(StepReport.make_dummy(step=1))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rec._f, "write", full)
    rec.record(StepReport.make_dummy(step=2))
    assert rec.failed is not None and "No space left" in rec.failed
    rec.record(StepReport.make_dummy(step=3))  # ignored, no second error
    rec.close()
    assert rec.messages == 1
    assert sum("wire recording" in r.message for r in caplog.records) == 1
    assert [m.step for _, m in Recording(path)] == [1]


def test_a_restarted_recorder_cuts_an_unfinished_tail_so_what_it_appends_reads(tmp_path, caplog):
    path = tmp_path / "wire.rec"
    msgs = _messages()
    _write(path, msgs[:2])
    whole = path.stat().st_size
    with open(path, "ab") as f:  # a writer killed mid-entry
        f.write(b"WREC" + b"\x00" * 30)
    rec = WireRecorder(path)
    assert rec.failed is None and path.stat().st_size == whole
    rec.record(msgs[2])
    rec.close()
    got = Recording(path)
    assert [type(m) for _, m in got] == [type(m) for m in msgs] and got.truncated_bytes == 0
    assert any("dropping 34 bytes" in r.message for r in caplog.records)


def test_a_recorder_never_appends_to_a_file_that_is_not_a_recording(tmp_path):
    path = tmp_path / "wire.rec"
    path.write_bytes(b"someone else's data")
    rec = WireRecorder(path)
    assert rec.failed is not None and "not a draft_align wire recording" in rec.failed
    rec.record(StepReport.make_dummy())
    rec.close()
    assert path.read_bytes() == b"someone else's data" and rec.messages == 0


# --------------------------------------------------------------------------------------- damage kept, safe reads
def _many(n: int) -> list:
    return [StepReport.make_dummy(step=i) if i % 2 else TapBatch.make_dummy() for i in range(n)]


def _entry_starts(path) -> list[int]:
    import os

    from draft_align.wire.recording import _walk

    fd = os.open(path, os.O_RDONLY)
    try:
        return [s for k, s, _, _, _ in _walk(fd, os.fstat(fd).st_size, 1 << 28) if k == "entry"]
    finally:
        os.close(fd)


def test_a_restarted_recorder_keeps_damage_mid_file_and_every_whole_entry(tmp_path, caplog):
    path = tmp_path / "wire.rec"
    _write(path, _many(12))
    starts = _entry_starts(path)
    data = bytearray(path.read_bytes())
    data[starts[2] + 30] ^= 0xFF  # one flipped byte inside entry 2
    path.write_bytes(bytes(data))
    rec = WireRecorder(path)  # a restarted sidecar
    assert rec.failed is None and path.stat().st_size == len(data)  # nothing cut
    rec.record(StepReport.make_dummy(step=99))
    rec.close()
    assert any("damaged bytes from byte" in r.message and "kept" in r.message for r in caplog.records)
    with pytest.raises(RecordingError, match="entry 2 at byte .*checksum mismatch"):
        list(Recording(path))
    r = Recording(path, skip_damaged=True)
    got = [m for _, m in r]
    assert len(got) == 12 and r.damaged == 1 and r.damaged_bytes == starts[3] - starts[2]
    assert got[-1].step == 99 and [type(m) for m in got[:11]] == [
        type(m) for m in _many(12)[:2] + _many(12)[3:]
    ]


def test_a_damaged_length_field_is_damage_not_a_cut_tail(tmp_path):
    import struct

    path = tmp_path / "wire.rec"
    _write(path, _many(6))
    starts = _entry_starts(path)
    data = bytearray(path.read_bytes())
    first_len = starts[1] + 4 + 12  # entry 1's first frame length, after b"WREC", f64, u32
    struct.pack_into("<Q", data, first_len, 100_000_000)  # past the end of the file, under max_bytes
    path.write_bytes(bytes(data))
    with pytest.raises(RecordingError, match="entry 1 at byte .*damaged length field"):
        list(Recording(path))
    r = Recording(path, skip_damaged=True)
    assert len(list(r)) == 5 and r.damaged == 1 and r.truncated_bytes == 0


def test_a_file_shrinking_during_a_read_ends_the_read_like_a_cut(tmp_path):
    """A memory-mapped reader dies of SIGBUS here; the read must end like a cut file."""
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "wire.rec"
    _write(path, _many(40))
    assert path.stat().st_size > 4 * 4096
    script = f"""
import os
from draft_align.wire.recording import Recording
r = Recording({str(path)!r})
n = 0
for _, m in r:
    n += 1
    if n == 20:
        os.truncate({str(path)!r}, 100)
print("read", n, r.truncated_bytes > 0)
"""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-500:])
    assert out.stdout.split() == ["read", "20", "True"]


def test_a_symlinked_or_special_recording_path_is_refused(tmp_path):
    import os

    victim = tmp_path / "victim"
    victim.write_bytes(b"")  # an empty file: a recorder that follows the link writes into it
    path = tmp_path / "wire.rec"
    path.symlink_to(victim)
    rec = WireRecorder(path)
    rec.record(StepReport.make_dummy())
    rec.close()
    assert rec.failed is not None and "symbolic link" in rec.failed and rec.messages == 0
    assert victim.read_bytes() == b""
    fifo = tmp_path / "fifo.rec"
    os.mkfifo(fifo)
    rec = WireRecorder(fifo)  # would block on open, or append into a pipe
    assert rec.failed is not None and "not a regular file" in rec.failed
    with pytest.raises(RecordingError, match="not a regular file"):  # nor does a reader block on it
        list(Recording(fifo))


def test_a_recording_is_owner_only_whatever_the_umask(tmp_path):
    import os
    import stat

    old = os.umask(0)
    try:
        fresh = tmp_path / "wire.rec"
        _write(fresh, _many(1))
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
        older = tmp_path / "old.rec"
        _write(older, _many(1))
        older.chmod(0o644)  # written by an earlier version
        _write(older, _many(1))
        assert stat.S_IMODE(older.stat().st_mode) == 0o600
    finally:
        os.umask(old)


# --------------------------------------------------------------------------------------- bounded, never raising
def test_the_size_cap_stops_the_recording_with_one_line(tmp_path, caplog):
    path = tmp_path / "wire.rec"
    entry = _write(tmp_path / "probe.rec", [TapBatch.make_dummy()]).size - len(MAGIC)
    rec = WireRecorder(path, max_file_bytes=len(MAGIC) + 3 * entry + 10)
    for _ in range(10):
        rec.record(TapBatch.make_dummy())
    rec.close()
    assert rec.messages == 3 and "cap of" in rec.failed and "sidecar.recording.max_mb" in rec.failed
    assert path.stat().st_size <= rec.max_file_bytes
    assert sum("wire recording" in r.message for r in caplog.records) == 1
    assert len(list(Recording(path))) == 3
    again = WireRecorder(path, max_file_bytes=rec.max_file_bytes)  # a restart at the cap: stops at once
    again.record(TapBatch.make_dummy())
    assert again.messages == 0 and "cap of" in again.failed


def test_the_free_space_reserve_stops_the_recording_before_the_disk_fills(tmp_path, monkeypatch):
    from draft_align.wire import recording

    free = {"bytes": 10 << 20}
    monkeypatch.setattr(recording, "_free_bytes", lambda folder: free["bytes"])
    rec = WireRecorder(tmp_path / "wire.rec", reserve_bytes=8 << 20)
    rec.record(TapBatch.make_dummy())
    assert rec.messages == 1 and rec.failed is None
    free["bytes"] = (8 << 20) + 100  # the next entry would eat into the reserve
    rec.record(TapBatch.make_dummy())
    assert rec.messages == 1 and "kept in reserve for checkpoints and publishes" in rec.failed


def test_no_failure_of_a_recorder_reaches_its_caller(tmp_path, monkeypatch):
    from draft_align.wire import recording

    def broken(*a, **k):
        raise RuntimeError("bug")

    for part in ("encode", "_free_bytes"):
        with monkeypatch.context() as m:
            m.setattr(recording, part, broken)
            rec = WireRecorder(tmp_path / f"{part}.rec")
            rec.record(StepReport.make_dummy())  # must not raise
        assert rec.failed is not None and "bug" in rec.failed and rec.messages == 0


def test_a_file_shrinking_while_damage_is_scanned_ends_the_read(tmp_path, monkeypatch):
    """The scan for the next whole entry after damage read the file in chunks and stepped back a marker's
    length each time: a file cut to one byte past the scan position looped forever."""
    import threading

    from draft_align.wire import recording

    path = tmp_path / "wire.rec"
    _write(path, _many(6))
    starts = _entry_starts(path)
    data = bytearray(path.read_bytes())
    data[starts[1] : starts[1] + 4] = b"XXXX"  # damage: the scan for the next whole entry starts after it
    path.write_bytes(bytes(data))
    real, cut = recording._read_at, []

    def shrinking(fd, pos, n):
        if not cut and pos == starts[1] + 1:  # the scan past the damage begins: the file is cut one byte on
            import os

            os.truncate(path, pos + 1)
            cut.append(pos)
        return real(fd, pos, n)

    monkeypatch.setattr(recording, "_read_at", shrinking)
    result = {}

    def read():
        r = Recording(path, skip_damaged=True)
        result["n"] = len(list(r))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10.0)
    assert not t.is_alive(), "the reader loops on a shrinking file"
    assert cut and result["n"] == 1  # the entry before the damage
