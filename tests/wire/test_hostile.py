"""Hostile input over real sockets: junk floods, memory bombs before authentication, replays,
messages over the receiver's limit."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from draft_align.wire.channel import Receiver, TapSender, authenticate, default_endpoint
from draft_align.wire.codec import Origin, encode
from draft_align.wire.messages import HeadSync, StepReport, TapBatch
from draft_align.wire.schema import WireError
from draft_align.wire.sequence_guard import SequenceGuard
from draft_align.wire.sockets import zap_server

KEY = bytes(range(32))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _junk_sender(endpoint: str, stop: threading.Event, rate_hz: float, sent: list[int]) -> None:
    """An unauthenticated PUSH peer sending ``rate_hz`` junk messages a second."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(endpoint)
    i = 0
    try:
        while not stop.is_set():
            frames = [[b"one frame"], [b"{not json", b""], [os.urandom(64), os.urandom(200), b""]][i % 3]
            sent[0] += 1  # attempted (a refused peer has no connection to queue to)
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            i += 1
            time.sleep(1 / rate_hz)
    finally:
        sock.close(linger=0)
        ctx.term()


# --------------------------------------------------------------------------- 1: head-of-line stall
@pytest.mark.parametrize("key", [None, KEY], ids=["keyless", "keyed"])
def test_legit_batches_flow_under_a_junk_flood(tmp_path: Path, key: bytes | None):
    """A sidecar-like loop (0.2 s train steps, then a 50 ms drain with no wait) while an unauthenticated
    peer sends 100 junk msgs/s: none of the legit TapSender's 60 batches is dropped (the issue: 40 of 60
    dropped at 2 junk msgs/s, because a drain stopped at the first rejection)."""
    ep = default_endpoint(tmp_path, "tap")
    stop = threading.Event()
    junk_sent = [0]
    got: list[TapBatch] = []
    with Receiver(ep, key) as rx, TapSender(ep, key) as tx:
        junk = threading.Thread(target=_junk_sender, args=(ep, stop, 100.0, junk_sent), daemon=True)
        junk.start()

        def loop() -> None:
            end = time.monotonic() + 30
            while len(got) < 60 and time.monotonic() < end:
                time.sleep(0.2)  # a train step
                got.extend(m for m in rx.drain(0.05, 0) if isinstance(m, TapBatch))

        consumer = threading.Thread(target=loop, daemon=True)
        consumer.start()
        for i in range(60):
            assert tx.offer(TapBatch.make_dummy(batch_id=i, seed=i))
            time.sleep(0.1)
        consumer.join(40)
        stop.set()
        junk.join(5)
        st = tx.stats()
        rejected = dict(rx.rejected)
    assert junk_sent[0] >= 300, junk_sent  # the flood really ran (≥ 50 msgs/s over the ~6 s)
    assert st["dropped_peer"] == 0 and st["dropped_queue_full"] == 0, st
    assert sorted(b.batch_id for b in got) == list(range(60))
    if key is None:  # the junk reached the decoder and was counted there
        assert sum(rejected.values()) >= junk_sent[0] * 0.8 and set(rejected) <= {"frames", "header", "mac"}
    else:  # refused at the handshake, counted as auth
        assert rejected.get("auth", 0) >= 1 and set(rejected) == {"auth"}


def test_drain_counts_rejections_toward_its_budget(tmp_path: Path):
    """30 junk messages in front of one legit one: one drain with no wait gets the legit one; a budget of
    10 messages stops after 10 consumed (rejections included).  (1 MiB messages: all 62 fit the receive
    queue, RCVHWM = 1 GiB // 1 MiB, so none waits in the sender's queue to refill it.)"""
    ep = default_endpoint(tmp_path, "tap")
    with Receiver(ep, None, max_bytes=1 << 20) as rx:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 1000)
        raw.connect(ep)
        for _ in range(30):
            raw.send_multipart([b"junk"])
        raw.send_multipart(encode(StepReport.make_dummy(step=3), None, sender="s", seq=0))
        for _ in range(30):
            raw.send_multipart([b"junk"])
        raw.send_multipart(encode(StepReport.make_dummy(step=4), None, sender="s", seq=1))
        deadline = time.monotonic() + 5
        while rx._inbox._sock.poll(0) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # all 62 queued
        first = list(rx.drain(1.0, 0, max_messages=10))
        assert first == [] and rx.rejected["frames"] == 10
        rest = list(rx.drain(1.0, 0))
        assert [m.step for m in rest] == [3, 4] and rx.rejected["frames"] == 60
        assert rx.recv(timeout_ms=0) is None
        raw.close()
        ctx.term()


# --------------------------------------------------------------------- 4: memory bomb before auth
_BOMB = r"""
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.PUSH); s.setsockopt(zmq.LINGER, 5000); s.connect(sys.argv[1])
frame = b"\0" * (15 << 20)
for _ in range(12):
    s.send_multipart([frame] * 8)  # 8 × 15 MiB frames, each under the 16 MiB limit; unsigned
s.close(); ctx.term()
"""


def test_unauthenticated_memory_bomb_is_not_buffered(tmp_path: Path):
    """12 unsigned messages of 8 × 15 MiB (1.4 GiB) at a keyed receiver with a 16 MiB limit: the peer fails
    the handshake, so the receiving process buffers none of it (the issue: RSS +1.2 GB)."""
    ep = default_endpoint(tmp_path, "tap")
    with Receiver(ep, KEY, max_bytes=16 << 20) as rx:
        base = peak = _rss_bytes()
        bomb = subprocess.Popen([sys.executable, "-c", _BOMB, ep])
        end = time.monotonic() + 8
        while time.monotonic() < end and bomb.poll() is None:
            assert rx.recv(timeout_ms=100) is None
            peak = max(peak, _rss_bytes())
        bomb.kill()
        bomb.wait()
        assert rx.rejected["auth"] >= 1 and rx.stats()["bytes_received"] == 0
    assert peak - base < 100 << 20, f"RSS grew by {(peak - base) >> 20} MiB"


def test_receive_queue_is_sized_in_bytes(tmp_path: Path):
    ep = default_endpoint(tmp_path, "tap")
    with Receiver(ep, KEY, max_bytes=16 << 20, buffer_bytes=256 << 20) as rx:
        assert rx._inbox.rcvhwm == 16
        assert rx._inbox._sock.getsockopt(zmq.RCVHWM) == 16
        assert rx._inbox._sock.getsockopt(zmq.MAXMSGSIZE) == 16 << 20
    with Receiver(ep, KEY, max_bytes=1 << 30, buffer_bytes=1 << 20) as rx:
        assert rx._inbox.rcvhwm == 1  # at least one message


# --------------------------------------------------------------------------------------- 7: replays
def _capture(tmp_path: Path, msgs: list) -> list[list[bytes]]:
    """What a TapSender puts on the wire for ``msgs`` (as an eavesdropper would see it)."""
    ep = default_endpoint(tmp_path, "capture")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    zap = zap_server(ctx, pull, KEY)  # the sender authenticates; the eavesdropper sees the frames
    pull.bind(ep)
    out = []
    with TapSender(ep, KEY, send_timeout_s=2.0) as tx:
        for m in msgs:
            tx.offer(m)
        while len(out) < len(msgs):
            assert pull.poll(5000)
            out.append(pull.recv_multipart())
    pull.close()
    zap.close()
    ctx.term()
    return out


def test_replayed_batch_and_final_report_are_rejected(tmp_path: Path):
    batch = TapBatch.make_dummy(seed=3)
    final = StepReport(run_id="r", step=5, policy_version=1, metrics={"final": 1.0})
    frames = _capture(tmp_path, [batch, final])
    ep = default_endpoint(tmp_path, "tap")
    with Receiver(ep, KEY) as rx:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.PUSH)  # a peer that passed the handshake: the envelope still stops a replay
        raw.setsockopt(zmq.LINGER, 1000)
        authenticate(raw, KEY)
        raw.connect(ep)
        for f in frames + frames * 5:
            raw.send_multipart(f)
        got = []
        end = time.monotonic() + 5
        while time.monotonic() < end and rx.rejected["sequence"] < 10:
            m = rx.recv(timeout_ms=100)
            if m is not None:
                got.append(m)
        raw.close()
        ctx.term()
        assert [type(m).__name__ for m in got] == ["TapBatch", "StepReport"]
        assert rx.rejected == {"sequence": 10}
        # a restarted sender has a new id and starts again at 0: accepted
        with TapSender(ep, KEY, send_timeout_s=2.0) as tx:
            tx.offer(final)
            assert rx.recv(timeout_ms=5000) == final


def test_replay_guard_drops_duplicates_and_stale():
    g = SequenceGuard(max_senders=2)
    g.check(Origin("a", 0))
    g.check(Origin("a", 5))
    for seq, what in ((5, "duplicate"), (3, "stale")):
        with pytest.raises(WireError, match=what) as e:
            g.check(Origin("a", seq))
        assert e.value.reason == "sequence"
    g.check(Origin("a", 6))
    with pytest.raises(WireError, match="no sender id"):
        g.check(Origin("", 0))
    SequenceGuard(require_sender=False).check(Origin("", 0))
    g.check(Origin("b", 0))
    g.check(Origin("c", 0))  # bounded: "a", the least recently heard, goes dormant; "c" is not refused
    assert len(g) == 2 and g.dormant == 1
    with pytest.raises(WireError, match="stale"):
        g.check(Origin("a", 0))  # still remembered: its old messages stay refused


# ------------------------------------------------------------------------- 10: over the size limit
def test_sender_refuses_a_message_over_the_receivers_limit(tmp_path: Path, caplog):
    ep = default_endpoint(tmp_path, "tap")
    big = HeadSync.make_dummy(hidden_size=512, vocab_size=1000, draft_vocab=256)  # ~262 KB of rows
    limit = 64 * 1024
    with (
        Receiver(ep, KEY, max_bytes=limit) as rx,
        TapSender(ep, KEY, max_message_bytes=limit, send_timeout_s=2.0) as tx,
    ):
        tx.offer(big)
        tx.offer(StepReport.make_dummy(step=1))
        got = rx.recv(timeout_ms=5000)
        assert isinstance(got, StepReport) and got.step == 1
        end = time.monotonic() + 5
        while tx.stats()["sent"] < 1 and time.monotonic() < end:  # counted just after the send returns
            time.sleep(0.01)
        st = tx.stats()
        assert st["dropped_too_large"] == 1 and st["sent"] == 1
    assert "over the receiver's limit" in caplog.text and "HeadSync" in caplog.text


# ------------------------------------------------------------------------- temperatures out of range
def test_signed_batches_with_unusable_temperatures_are_counted_drops(tmp_path: Path):
    """A key holder's TapBatches at T = 1e308 and 5e-324 (acceptance k + 1, NaN estimates downstream) are
    dropped at the receiver and counted under ``fields``; the legit batch after them arrives.  (Our own
    encoder refuses to build them: the attacker rewrites a signed header.)"""
    import json

    from draft_align.wire.codec import frame_mac

    def signed(msg, seq, temperature=None):
        frames = [bytes(f) for f in encode(msg, KEY, sender="attacker", seq=seq)]
        if temperature is not None:  # the attacker's own encoder: the field rewritten, the MAC made again
            header = json.loads(frames[0])
            header["fields"]["temperature"] = temperature
            frames[0] = json.dumps(header).encode()
            frames[-1] = frame_mac(KEY, frames[:-1])
        return frames

    ep = default_endpoint(tmp_path, "tap")
    good = TapBatch.make_dummy(seed=4)
    sends = [signed(good, 0, 1e308), signed(good, 1, 5e-324), signed(good, 2)]
    with Receiver(ep, KEY) as rx:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 1000)
        authenticate(raw, KEY)
        raw.connect(ep)
        for frames in sends:
            raw.send_multipart(frames)
        got = None
        end = time.monotonic() + 10
        while got is None and time.monotonic() < end:
            got = rx.recv(timeout_ms=200)
        raw.close()
        ctx.term()
        assert got is not None and got.temperature == good.temperature
        assert rx.rejected == {"fields": 2}


# ------------------------------------------------------------------------- frames libzmq drops
def test_a_frame_over_the_receivers_limit_dropped_by_libzmq_is_counted_as_lost(tmp_path: Path):
    """A sender configured with a larger limit than the receiver: libzmq drops the oversize frame at the
    receiver (MAXMSGSIZE, and the connection with it) without telling the socket.  The sender numbers each
    message it hands to libzmq, so the next message that arrives shows the gap: counted as ``lost``."""
    ep = default_endpoint(tmp_path, "tap")
    small = StepReport(run_id="r", step=0, policy_version=0, metrics={})
    big = TapBatch.make_dummy(num_sequences=8, min_len=200, max_len=200, hidden_size=256, seed=1)
    with Receiver(ep, KEY, max_bytes=128 * 1024) as rx, TapSender(ep, KEY, send_timeout_s=2.0) as tx:
        assert tx.offer(small)
        assert rx.recv(timeout_ms=5000) == small
        assert tx.offer(big)  # its hidden-state frame alone is over 128 KiB
        got = None
        end = time.monotonic() + 20
        while got is None and time.monotonic() < end:
            time.sleep(0.3)  # the PUSH socket reconnects after libzmq dropped the connection
            tx.offer(small)
            got = rx.recv(timeout_ms=500)
        assert got == small
        sent = tx.stats()["sent"]
        received = rx.stats()["received"]
        assert sent >= 3 and rx.rejected["lost"] == sent - received >= 1
        assert set(rx.rejected) == {"lost"}
