"""ZeroMQ channels over real sockets (ipc in tmp_path, one tcp loopback case), keys and endpoint rules."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from draft_align.wire.channel import (
    KEY_ENV,
    Publisher,
    Receiver,
    Subscriber,
    TapSender,
    authenticate,
    check_endpoint,
    default_endpoint,
    resolve_key,
)
from draft_align.wire.codec import encode
from draft_align.wire.messages import DraftPublished, HeadSync, StepReport, TapBatch

KEY = bytes(range(32))


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    for fd in dataclasses.fields(a):
        x, y = getattr(a, fd.name), getattr(b, fd.name)
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def connect(sender: TapSender, receiver: Receiver, timeout_s: float = 5.0) -> None:
    """Wait until the PUSH→PULL connection carries messages (probes are StepReports with step 999)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sender.offer(StepReport(run_id="probe", step=999, policy_version=0))
        if receiver.recv(timeout_ms=100) is not None:
            while True:  # every probe sent or dropped, then drain the ones that arrived
                st = sender.stats()
                if (
                    st["offered"]
                    == st["queue_depth"]
                    + sum(v for k, v in st.items() if k == "sent" or k.startswith("dropped"))
                    and not st["queue_depth"]
                ):
                    break
                time.sleep(0.005)
            while receiver.recv(timeout_ms=50) is not None:
                pass
            return
    raise AssertionError("no connection")


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return default_endpoint(tmp_path, "tap")


# -------------------------------------------------------------------------------------- push / pull
def test_send_and_receive_every_kind(endpoint):
    with Receiver(endpoint, KEY) as rx, TapSender(endpoint, KEY) as tx:
        connect(tx, rx)
        before = tx.stats()["sent"]
        msgs = [
            HeadSync.make_dummy(),
            TapBatch.make_dummy(seed=1),
            TapBatch.make_dummy(final=False, topk=0, seed=2),
            StepReport.make_dummy(step=4),
        ]
        assert all(tx.offer(m) for m in msgs)
        got = [rx.recv(timeout_ms=5000) for _ in msgs]
        for g, m in zip(got, msgs, strict=True):
            assert same(g, m), type(m).__name__
        assert rx.recv(timeout_ms=50) is None
        st = tx.stats()
        assert st["sent"] - before == 4 and st["dropped_peer"] == 0 and st["queue_depth"] == 0
        assert st["bytes_sent"] > sum(sum(map(len, encode(m, KEY))) for m in msgs)  # plus the probes
        assert rx.stats()["received"] >= 5 and not rx.rejected


def test_tcp_loopback_with_key():
    with Receiver("tcp://127.0.0.1:*", KEY) as rx:
        assert rx.endpoint.startswith("tcp://127.0.0.1:")
        with TapSender(rx.endpoint, KEY) as tx:
            connect(tx, rx)
            tx.offer(TapBatch.make_dummy(seed=4))
            assert same(rx.recv(timeout_ms=5000), TapBatch.make_dummy(seed=4))


def test_receiver_survives_garbage_and_forgeries(endpoint):
    with Receiver(endpoint, KEY, max_bytes=100_000) as rx:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 1000)
        authenticate(raw, KEY)  # a key holder's socket: the garbage reaches the decoder
        raw.connect(endpoint)
        good = StepReport.make_dummy(step=7)
        forged = encode(good, KEY, sender="s", seq=1)[:-1] + [b"\0" * 32]
        raw.send_multipart([b"one frame"])  # frames
        raw.send_multipart([b"{not json", b"junk"])  # mac (checked before the header)
        raw.send_multipart(forged)  # mac
        raw.send_multipart(encode(good, bytes(32)))  # mac: another key
        raw.send_multipart([b"x" * 60_000, b"y" * 60_000])  # size: 120 kB > max_bytes
        raw.send_multipart(encode(good, KEY))  # replay: no sender id
        raw.send_multipart(encode(good, KEY, sender="s", seq=1))
        got = rx.recv(timeout_ms=5000)
        raw.close()
        ctx.term()
    assert same(got, good)
    assert rx.rejected == {"frames": 1, "mac": 3, "size": 1, "sequence": 1}
    st = rx.stats()
    assert st["received"] == 1 and st["rejected"] == 6 and st["rejected_by_reason"] == dict(rx.rejected)


def test_wrong_key_sender_is_rejected_and_recv_times_out(endpoint):
    with Receiver(endpoint, KEY) as rx, TapSender(endpoint, bytes(32)) as tx:
        deadline = time.monotonic() + 5
        while not rx.rejected and time.monotonic() < deadline:
            tx.offer(StepReport.make_dummy())
            t0 = time.monotonic()
            assert rx.recv(timeout_ms=100) is None  # never raises, waits out its timeout
            assert time.monotonic() - t0 >= 0.09
        assert set(rx.rejected) == {"auth"}  # refused at the handshake: not one frame was read
        assert rx.stats()["bytes_received"] == 0


def test_recv_timeout_returns_none(endpoint):
    with Receiver(endpoint, None) as rx:
        t0 = time.monotonic()
        assert rx.recv(timeout_ms=0) is None
        assert rx.recv(timeout_ms=100) is None
        assert 0.09 <= time.monotonic() - t0 < 2


def test_receiver_replaces_a_stale_socket_but_not_a_file(tmp_path):
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the file stays: a crashed process's socket
    assert stat.S_ISSOCK(path.lstat().st_mode)
    with Receiver(f"ipc://{path}", None) as rx, TapSender(f"ipc://{path}", None) as tx:
        connect(tx, rx)
    other = tmp_path / "data.txt"
    other.write_text("keep me")
    with pytest.raises(ValueError, match="not a socket"):
        Receiver(f"ipc://{other}", None)
    assert other.read_text() == "keep me"


# ------------------------------------------------------------------------------------ sender drops
def test_sender_without_receiver_never_blocks(tmp_path):
    tx = TapSender(default_endpoint(tmp_path, "nobody"), KEY)
    batch = TapBatch.make_dummy()
    t0 = time.monotonic()
    results = [tx.offer(batch) for _ in range(50)]
    assert time.monotonic() - t0 < 1.0
    assert results.count(False) >= 50 - 8 - 2  # the queue holds 8 (the thread may have taken one or two)
    t0 = time.monotonic()
    tx.close(timeout_s=1.0)
    assert time.monotonic() - t0 < 1.5
    st = tx.stats()
    assert st["offered"] == 50 and st["sent"] == 0 and st["queue_depth"] == 0
    assert st["dropped_queue_full"] == results.count(False) and st["dropped_peer"] >= 1
    assert st["dropped_queue_full"] + st["dropped_peer"] + st["dropped_closed"] == 50


def test_queue_full_counting(tmp_path):
    with TapSender(default_endpoint(tmp_path, "nobody"), None, queue_messages=2, send_timeout_s=30.0) as tx:
        r = StepReport.make_dummy()
        assert tx.offer(r)  # the thread takes it and waits (up to 30 s) for a peer
        deadline = time.monotonic() + 5
        while tx.stats()["queue_depth"] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert [tx.offer(r) for _ in range(5)] == [True, True, False, False, False]
        st = tx.stats()
        assert (st["offered"], st["dropped_queue_full"], st["queue_depth"], st["sent"]) == (6, 3, 2, 0)
        t0 = time.monotonic()
        tx.close(timeout_s=0.5)  # interrupts the 30 s send deadline
        assert time.monotonic() - t0 < 1.0
    st = tx.stats()
    assert st["dropped_peer"] + st["dropped_closed"] == 3 and st["queue_depth"] == 0
    assert not tx.offer(r) and tx.stats()["dropped_closed"] >= 1


def test_queue_byte_budget(tmp_path):
    with TapSender(default_endpoint(tmp_path, "nobody"), None, queue_bytes=4096) as tx:
        big = TapBatch.make_dummy(num_sequences=8, min_len=8, max_len=8, hidden_size=32)  # ~12 kB of tensors
        assert not tx.offer(big)
        assert tx.offer(StepReport.make_dummy())
        assert tx.stats()["dropped_queue_full"] == 1


def test_sender_rejects_bad_input(tmp_path):
    with TapSender(default_endpoint(tmp_path, "x"), None) as tx:
        with pytest.raises(TypeError):
            tx.offer({"not": "a message"})
    with pytest.raises(ValueError):
        TapSender(default_endpoint(tmp_path, "x"), None, queue_messages=0)
    with pytest.raises(ValueError, match="needs an HMAC key"):
        TapSender("tcp://127.0.0.1:5555", None)


def test_invalid_message_is_dropped_on_the_thread(endpoint):
    bad = dataclasses.replace(TapBatch.make_dummy(), vocab_size=2)  # ids out of range
    with Receiver(endpoint, None) as rx, TapSender(endpoint, None) as tx:
        connect(tx, rx)
        assert tx.offer(bad)  # offer does not encode (cheap); the thread refuses to send it
        deadline = time.monotonic() + 5
        while tx.stats()["dropped_invalid"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tx.stats()["dropped_invalid"] == 1
        assert rx.recv(timeout_ms=100) is None


def test_offer_is_thread_safe(endpoint):
    with Receiver(endpoint, None) as rx, TapSender(endpoint, None, queue_messages=1000) as tx:
        connect(tx, rx)
        base = tx.stats()["offered"]

        def work(k: int) -> None:
            for i in range(25):
                tx.offer(StepReport(run_id="t", step=k * 100 + i, policy_version=0))

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        steps = set()
        while len(steps) < 100:
            m = rx.recv(timeout_ms=5000)
            assert m is not None
            steps.add(m.step)
        assert steps == {k * 100 + i for k in range(4) for i in range(25)}
        assert tx.stats()["offered"] - base == 100


# --------------------------------------------------------------------------------------------- pub / sub
def test_pub_sub_delivers_draft_published(tmp_path):
    ep = default_endpoint(tmp_path, "notify")
    msg = DraftPublished.make_dummy(draft_version=3, policy_version=2, path=str(tmp_path / "v0003"))
    with Publisher(ep, KEY) as pub, Subscriber(ep, KEY) as sub:
        got = None
        deadline = time.monotonic() + 5
        while got is None and time.monotonic() < deadline:  # PUB/SUB slow joiner: repeat until heard
            pub.publish(msg)
            got = sub.poll(timeout_ms=50)
        assert got == msg
        with pytest.raises(TypeError):
            pub.publish(StepReport.make_dummy())
    with Publisher(ep, bytes(32)) as pub, Subscriber(ep, KEY) as sub:
        deadline = time.monotonic() + 5
        while not sub.rejected and time.monotonic() < deadline:
            pub.publish(msg)
            assert sub.poll(timeout_ms=50) is None
        assert set(sub.rejected) == {"auth"}


def test_subscriber_rejects_other_kinds(tmp_path):
    ep = default_endpoint(tmp_path, "notify")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(ep)
    try:
        with Subscriber(ep, None) as sub:
            deadline = time.monotonic() + 5
            while not sub.rejected and time.monotonic() < deadline:
                pub.send_multipart(encode(StepReport.make_dummy(), None))
                assert sub.poll(timeout_ms=50) is None
            assert set(sub.rejected) == {"kind"}
    finally:
        pub.close()
        ctx.term()


# -------------------------------------------------------------------------------------------------- keys
@pytest.fixture
def no_env_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


def test_key_file_is_created_private_and_reused(tmp_path, no_env_key):
    run = tmp_path / "run"
    with pytest.raises(FileNotFoundError):
        resolve_key(None, run, create=False)
    key = resolve_key(None, run, create=True)
    path = run / "wire.key"
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert bytes.fromhex(path.read_text().strip()) == key
    assert resolve_key(None, run, create=False) == key == resolve_key(None, run, create=True)
    assert [p.name for p in run.iterdir()] == ["wire.key"]  # no temp files left


def _race(run: str, barrier, out) -> None:
    barrier.wait()
    out.put(resolve_key(None, Path(run), create=True).hex())


def test_key_creation_race_ends_with_one_key(tmp_path, no_env_key):
    run = tmp_path / "race"
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(run), barrier, out)) for _ in range(4)]
    for p in procs:
        p.start()
    keys = {out.get(timeout=20) for _ in procs}
    for p in procs:
        p.join(10)
    assert len(keys) == 1 and bytes.fromhex(keys.pop()) == resolve_key(None, run, create=False)
    # and threads of one process
    run2 = tmp_path / "race2"
    tbar = threading.Barrier(6)
    got: list[bytes] = []

    def go() -> None:
        tbar.wait()
        got.append(resolve_key(None, run2, create=True))

    ts = [threading.Thread(target=go) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(got) == 6 and len(set(got)) == 1


def test_key_sources_and_precedence(tmp_path, monkeypatch):
    hex_file = tmp_path / "hex.key"
    hex_file.write_text("ab" * 20 + "\n")
    raw_file = tmp_path / "raw.key"
    raw_file.write_bytes(bytes(range(200, 240)))
    short = tmp_path / "short.key"
    short.write_text("abcd")
    for f in (hex_file, raw_file, short):
        f.chmod(0o600)
    monkeypatch.setenv(KEY_ENV, "cd" * 16)
    assert resolve_key(str(hex_file), tmp_path, create=True) == b"\xab" * 20  # key_file first
    assert resolve_key(str(raw_file), tmp_path, create=True) == bytes(range(200, 240))
    with pytest.raises(ValueError, match="at least 16"):
        resolve_key(str(short), tmp_path, create=True)
    assert resolve_key(None, tmp_path, create=True) == b"\xcd" * 16  # then the environment
    assert not (tmp_path / "wire.key").exists()
    monkeypatch.setenv(KEY_ENV, "cd" * 8)
    with pytest.raises(ValueError, match="at least 16"):
        resolve_key(None, tmp_path, create=True)
    monkeypatch.setenv(KEY_ENV, "not hex at all")
    with pytest.raises(ValueError, match="hex"):
        resolve_key(None, tmp_path, create=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "wire.key").write_text("00")
    (tmp_path / "run" / "wire.key").chmod(0o600)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ValueError, match="at least 16"):
        resolve_key(None, tmp_path / "run", create=True)


def test_key_file_others_can_read_is_refused(tmp_path, caplog):
    f = tmp_path / "k"
    f.write_text("ab" * 16)
    for mode in (0o644, 0o604, 0o602):
        f.chmod(mode)
        with pytest.raises(ValueError, match="chmod 600"):
            resolve_key(str(f), tmp_path, create=False)
    f.chmod(0o640)  # group access: allowed, with a warning
    assert resolve_key(str(f), tmp_path, create=False) == b"\xab" * 16
    assert "accessible by its group" in caplog.text
    with pytest.raises(ValueError, match="not a regular file"):
        resolve_key(str(tmp_path), tmp_path, create=False)


# --------------------------------------------------------------------------------------------- endpoints
def test_default_endpoint(tmp_path):
    assert default_endpoint(tmp_path, "tap") == f"ipc://{tmp_path}/tap.sock"
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    ep = default_endpoint(deep, "tap")
    path = Path(ep.removeprefix("ipc://"))
    assert ep.startswith("ipc://") and len(str(path)) <= 100 and str(path).startswith(tempfile.gettempdir())
    # a private folder with an unpredictable name, recorded in the run folder for the other side
    folder = path.parent
    assert folder.name != "draft_align" and len(folder.name) > len("draft_align-") + 6
    st = folder.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert (deep / ".ipc_dir").read_text().strip() == str(folder)
    assert default_endpoint(deep, "tap") == ep != default_endpoint(deep / "x", "tap")
    assert default_endpoint(deep, "notify") == f"ipc://{folder}/notify.sock"
    folder.rmdir()  # the temp dir was cleared (a reboot): made again, private
    assert default_endpoint(deep, "tap") == ep and stat.S_IMODE(folder.stat().st_mode) == 0o700
    folder.chmod(0o755)  # not private (or another user's): refused
    with pytest.raises(ValueError, match="not a private folder"):
        default_endpoint(deep, "tap")
    folder.chmod(0o700)


def test_ipc_socket_is_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        ep = default_endpoint(tmp_path / "new", "tap")
        with Receiver(ep, None), Publisher(default_endpoint(tmp_path / "new", "notify"), None):
            assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
            for name in ("tap.sock", "notify.sock"):
                assert stat.S_IMODE((tmp_path / "new" / name).lstat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_endpoint_names_are_checked(tmp_path):
    for bad in ("", "a/b", "a b"):
        with pytest.raises(ValueError):
            default_endpoint(tmp_path, bad)
    ep = default_endpoint(tmp_path / ("d" * 60) / ("e" * 60), "tap")
    with Receiver(ep, None) as rx, TapSender(ep, None) as tx:  # the short path works as a socket
        connect(tx, rx)
    assert os.path.dirname(os.path.dirname(ep.removeprefix("ipc://"))) == tempfile.gettempdir()


@pytest.mark.parametrize(
    ("endpoint", "key", "remote", "error"),
    [
        ("ipc:///tmp/x.sock", None, False, None),
        ("ipc:///tmp/x.sock", KEY, False, None),
        ("ipc://", None, False, "empty"),
        ("ipc:///" + "a" * 120, None, False, "longer"),
        ("tcp://127.0.0.1:5555", KEY, False, None),
        ("tcp://localhost:5555", KEY, False, None),
        ("tcp://[::1]:5555", KEY, False, None),
        ("tcp://127.0.0.1:*", KEY, False, None),
        ("tcp://127.0.0.1:5555", None, False, "needs an HMAC key"),
        ("tcp://10.0.0.1:5555", KEY, False, "allow_remote"),
        ("tcp://*:5555", KEY, False, "allow_remote"),
        ("tcp://10.0.0.1:5555", KEY, True, None),
        ("tcp://*:5555", KEY, True, None),
        ("tcp://10.0.0.1:5555", None, True, "needs an HMAC key"),
        ("tcp://127.0.0.1", KEY, False, "host:port"),
        ("tcp://127.0.0.1:0", KEY, False, "port"),
        ("tcp://127.0.0.1:99999", KEY, False, "port"),
        ("tcp://:5555", KEY, False, "empty host"),
        ("inproc://x", None, False, "only ipc"),
        ("udp://127.0.0.1:5555", KEY, False, "only ipc"),
        ("/tmp/x.sock", None, False, "only ipc"),
    ],
)
def test_check_endpoint(endpoint, key, remote, error):
    if error is None:
        check_endpoint(endpoint, key, remote)
    else:
        with pytest.raises(ValueError, match=error):
            check_endpoint(endpoint, key, remote)


def test_importing_the_wire_does_not_import_zmq():
    import subprocess
    import sys

    code = "import sys, draft_align.wire, draft_align.wire.channel; print('zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
