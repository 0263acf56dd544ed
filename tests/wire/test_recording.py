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
