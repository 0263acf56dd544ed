"""ZeroMQ channels for wire messages (docs/wire.md).  The only module that imports zmq, lazily.

- :class:`TapSender` (policy side): PUSH, connects; ``offer()`` never blocks, a bounded queue and a short
  send deadline drop (and count) instead of stalling the RL job.
- :class:`Receiver` (sidecar): PULL, binds; validates every message, counts rejections by reason, never
  raises on a bad message.
- :class:`Publisher` / :class:`Subscriber`: DraftPublished over PUB/SUB.
- :func:`resolve_key`, :func:`default_endpoint`, :func:`check_endpoint`: key and endpoint rules.
"""

from __future__ import annotations

import collections
import hashlib
import ipaddress
import logging
import os
import secrets
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from draft_align.wire.messages import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_TOKENS,
    HEADER_MAX_BYTES,
    DraftPublished,
    HeadSync,
    Message,
    StepReport,
    TapBatch,
    TapPart,
    WireError,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

KEY_ENV = "DRAFT_ALIGN_WIRE_KEY"
KEY_FILE_NAME = "wire.key"
MIN_KEY_BYTES = 16
KEY_BYTES = 32
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_MESSAGE_OVERHEAD = 1024  # estimated header + MAC bytes, for the send queue's byte budget


# ---------------------------------------------------------------------------------------------------- key
def _parse_key(data: bytes, source: str) -> bytes:
    """Hex text (whitespace around it ignored) or raw bytes."""
    text = data.strip()
    key = data
    if text and len(text) % 2 == 0:
        try:
            key = bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            key = data
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"wire key from {source} has {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
    return key


def _read_key_file(path: Path) -> bytes:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("wire key %s is readable by group/others (mode %o)", path, stat.S_IMODE(mode))
    return _parse_key(path.read_bytes(), str(path))


def _create_key_file(path: Path) -> None:
    """Write a random key to ``path`` atomically and exclusively: the key goes to a private temp file that is
    hard-linked into place, so a racing reader never sees a partial file and exactly one writer wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(KEY_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process won the race: use its key
    finally:
        tmp.unlink(missing_ok=True)


def resolve_key(key_file: str | None, run_dir: Path, create: bool) -> bytes:
    """The HMAC key: ``key_file`` (hex or raw bytes), else ``$DRAFT_ALIGN_WIRE_KEY`` (hex), else
    ``<run_dir>/wire.key``, created (random 32 bytes, hex, mode 0600) when ``create`` and absent; processes
    racing to create it all end with the winner's key.  Raises ValueError for a short or malformed key and
    FileNotFoundError when there is no key and ``create`` is False."""
    if key_file is not None:
        return _read_key_file(Path(key_file))
    env = os.environ.get(KEY_ENV)
    if env:
        try:
            key = bytes.fromhex(env.strip())
        except ValueError as e:
            raise ValueError(f"${KEY_ENV} must be hex: {e}") from e
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"${KEY_ENV} has {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
        return key
    path = Path(run_dir) / KEY_FILE_NAME
    if not path.exists():
        if not create:
            raise FileNotFoundError(
                f"no wire key: set wire.key_file or ${KEY_ENV}, or start the side that creates {path}"
            )
        _create_key_file(path)
    return _read_key_file(path)


# ---------------------------------------------------------------------------------------------- endpoints
def default_endpoint(run_dir: Path, name: str) -> str:
    """``ipc://<run_dir>/<name>.sock``, or ``ipc://<tmp>/draft_align-<hash of run_dir>-<name>.sock`` when that
    path is longer than a socket name may be."""
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"endpoint name {name!r}: use letters, digits, '-', '_' or '.'")
    run_dir = Path(os.path.abspath(run_dir))
    path = str(run_dir / f"{name}.sock")
    if len(path) > _MAX_SOCKET_PATH:
        digest = hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]
        path = os.path.join(tempfile.gettempdir(), f"draft_align-{digest}-{name}.sock")
        if len(path) > _MAX_SOCKET_PATH:
            raise ValueError(f"temp dir {tempfile.gettempdir()!r} is too long for an ipc socket name")
    return f"ipc://{path}"


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The PULL endpoint sidecar rank ``rank`` binds: rank 0 keeps ``endpoint``; rank r > 0 binds
    ``ipc://…/<name>.<r>.sock`` (``.<r>`` appended when the path does not end in ``.sock``) or the tcp port + r."""
    if rank < 0:
        raise ValueError(f"rank must be ≥ 0, got {rank}")
    if rank == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        stem, dot, ext = endpoint.rpartition(".sock")
        return f"{stem}.{rank}.sock" if dot and not ext else f"{endpoint}.{rank}"
    if endpoint.startswith("tcp://"):
        host, port = _split_tcp(endpoint)
        if port == "*":
            raise ValueError(f"{endpoint!r}: a multi-rank sidecar needs a fixed tcp port (rank r binds port + r)")
        if int(port) + rank > 65535:
            raise ValueError(f"{endpoint!r}: port + rank {rank} is beyond 65535")
        return endpoint[: -len(port)] + str(int(port) + rank)
    raise ValueError(f"{endpoint!r}: only ipc:// and tcp:// endpoints are supported")


def tap_endpoints(endpoint: str, ranks: int) -> list[str]:
    """The endpoints of an N-rank sidecar, rank order (what a TapSender connects to)."""
    if ranks < 1:
        raise ValueError(f"ranks must be ≥ 1, got {ranks}")
    return [rank_endpoint(endpoint, r) for r in range(ranks)]


def _split_tcp(endpoint: str) -> tuple[str, str]:
    rest = endpoint[len("tcp://"):]
    if rest.startswith("["):
        host, sep, port = rest[1:].partition("]:")
        if not sep:
            raise ValueError(f"{endpoint!r}: expected tcp://[ipv6]:port")
    else:
        host, sep, port = rest.rpartition(":")
        if not sep:
            raise ValueError(f"{endpoint!r}: expected tcp://host:port")
    if not host:
        raise ValueError(f"{endpoint!r}: empty host")
    if port != "*" and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{endpoint!r}: port must be 1..65535 or '*'")
    return host, port


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_endpoint(endpoint: str, key: bytes | None, allow_remote: bool) -> None:
    """Only ``ipc://path`` and ``tcp://host:port``; tcp needs a key and a loopback host unless
    ``allow_remote``.  Raises ValueError."""
    if not isinstance(endpoint, str):
        raise ValueError(f"endpoint must be a string, got {type(endpoint).__name__}")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path:
            raise ValueError(f"{endpoint!r}: empty ipc path")
        if len(path.encode()) > _MAX_SOCKET_PATH + 7:
            raise ValueError(f"{endpoint!r}: ipc path longer than a socket name may be; use default_endpoint()")
        return
    if endpoint.startswith("tcp://"):
        host, _ = _split_tcp(endpoint)
        if key is None:
            raise ValueError(f"{endpoint!r}: tcp needs an HMAC key (wire.key_file, ${KEY_ENV} or run_dir/wire.key)")
        if not allow_remote and not _is_loopback(host):
            raise ValueError(f"{endpoint!r}: tcp must use 127.0.0.1, localhost or ::1 unless wire.allow_remote")
        return
    raise ValueError(f"{endpoint!r}: only ipc:// and tcp:// endpoints are supported")


def _prepare_bind(endpoint: str) -> None:
    """For ipc: create the socket's folder and remove a stale socket file (never a regular file)."""
    if not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint[len("ipc://"):])
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a socket; refusing to replace it")
    path.unlink(missing_ok=True)


def _message_bytes(msg: Message) -> int:
    tensors = msg.tensors().values()
    return _MESSAGE_OVERHEAD + sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))


_MESSAGE_TYPES = (TapBatch, HeadSync, DraftPublished, StepReport, TapPart)


# ------------------------------------------------------------------------------------------------ sender
class TapSender:
    """PUSH socket (connects; to every rank of a multi-rank sidecar, which ZeroMQ then serves round-robin)
    on a background thread behind a bounded queue.  :meth:`offer` never blocks:
    a full queue (``queue_messages`` messages or ``queue_bytes`` estimated bytes) drops the message; the
    thread encodes and sends without blocking, and drops a message the peer has not taken within
    ``send_timeout_s`` (no receiver, or a slow one).  Every drop is counted in :meth:`stats`."""

    def __init__(
        self,
        endpoint: str | list[str],
        key: bytes | None,
        *,
        queue_messages: int = 8,
        queue_bytes: int = 512 * 1024 * 1024,
        allow_remote: bool = False,
        send_timeout_s: float = 0.05,
        sndhwm: int = 4,
    ) -> None:
        self.endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not self.endpoints:
            raise ValueError("TapSender needs at least one endpoint")
        for ep in self.endpoints:
            check_endpoint(ep, key, allow_remote)
        if queue_messages < 1 or queue_bytes < 1:
            raise ValueError("queue_messages and queue_bytes must be ≥ 1")
        import zmq

        self.endpoint = ", ".join(self.endpoints)  # for messages
        self._key = key
        self._queue_messages = queue_messages
        self._queue_bytes = queue_bytes
        self._send_timeout_s = send_timeout_s
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[Message, int]] = collections.deque()
        self._queued_bytes = 0
        self._closing = False
        self._close_deadline = 0.0
        self._counts = collections.Counter(
            offered=0, sent=0, dropped_queue_full=0, dropped_peer=0, dropped_invalid=0, dropped_closed=0,
            bytes_sent=0,
        )
        self._ctx = zmq.Context()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(sndhwm,), name="draft-align-tap-sender", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._ctx.term()
            raise ValueError(f"cannot connect to {endpoint!r}: {self._start_error}") from self._start_error

    def offer(self, msg: Message) -> bool:
        """Queue ``msg`` for sending (thread-safe, never blocks).  False when it was dropped (queue full or
        sender closed).  The message's tensors must not be modified afterwards."""
        if not isinstance(msg, _MESSAGE_TYPES):
            raise TypeError(f"cannot send {type(msg).__name__}: not a wire message")
        size = _message_bytes(msg)
        with self._cv:
            self._counts["offered"] += 1
            if self._closing:
                self._counts["dropped_closed"] += 1
                return False
            if len(self._queue) >= self._queue_messages or self._queued_bytes + size > self._queue_bytes:
                self._counts["dropped_queue_full"] += 1
                return False
            self._queue.append((msg, size))
            self._queued_bytes += size
            self._cv.notify()
        return True

    def stats(self) -> dict[str, int]:
        with self._cv:
            return {**self._counts, "queue_depth": len(self._queue)}

    def _run(self, sndhwm: int) -> None:
        import zmq

        sock = self._ctx.socket(zmq.PUSH)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, sndhwm)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected peer: "sent" means a peer took it
            for ep in self.endpoints:
                sock.connect(ep)
        except Exception as e:  # surfaced to the constructor
            sock.close(linger=0)
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._closing:
                        self._cv.wait()
                    if not self._queue:
                        break
                    if self._closing and time.monotonic() > self._close_deadline:
                        self._counts["dropped_closed"] += len(self._queue)
                        self._queue.clear()
                        self._queued_bytes = 0
                        break
                    msg, size = self._queue.popleft()
                    self._queued_bytes -= size
                self._send(sock, msg)
        finally:
            sock.close(linger=0)

    def _send(self, sock: Any, msg: Message) -> None:
        import zmq

        try:
            frames = encode(msg, self._key)
        except Exception as e:  # an invalid message must not kill the sending thread
            logger.warning("tap: dropping an invalid %s: %s", type(msg).__name__, e)
            with self._cv:
                self._counts["dropped_invalid"] += 1
            return
        deadline = time.monotonic() + self._send_timeout_s
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:
                now = time.monotonic()
                if e.errno != zmq.EAGAIN:
                    logger.warning("tap: send to %s failed: %s", self.endpoint, e)
                    now = deadline
                if now >= deadline or (self._closing and now >= self._close_deadline):
                    with self._cv:
                        self._counts["dropped_peer"] += 1
                    return
                time.sleep(0.002)
                continue
            with self._cv:
                self._counts["sent"] += 1
                self._counts["bytes_sent"] += sum(len(f) for f in frames)
            return

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued for up to about half of ``timeout_s``, drop the rest, stop the thread.
        Returns within about ``timeout_s`` whatever the peer does."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._close_deadline = time.monotonic() + timeout_s / 2
            self._cv.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("tap sender thread still busy after %.1fs; leaving it to exit on its own", timeout_s)
        else:
            self._ctx.term()

    def __enter__(self) -> TapSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- receivers
class _Inbox:
    """A receiving socket (bound or connected) that decodes, validates and counts; used by Receiver and
    Subscriber."""

    def __init__(self, sock_type: str, endpoint: str, key: bytes | None, *, bind: bool, max_bytes: int,
                 max_tokens: int, rcvhwm: int) -> None:
        import zmq

        self.endpoint = endpoint
        self._key = key
        self._max_bytes = max_bytes
        self._max_tokens = max_tokens
        self.rejected: collections.Counter[str] = collections.Counter()
        self.counts = collections.Counter(received=0, bytes_received=0)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(getattr(zmq, sock_type))
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + HEADER_MAX_BYTES)  # per frame; decode checks the sum
            if sock_type == "SUB":
                self._sock.setsockopt(zmq.SUBSCRIBE, b"")
            if bind:
                _prepare_bind(endpoint)
                self._sock.bind(endpoint)
                self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            else:
                self._sock.connect(endpoint)
        except Exception:
            self._sock.close(linger=0)
            self._ctx.term()
            raise

    def next(self, timeout_ms: int | None, expect: type | None) -> Message | None:
        import zmq

        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(wait, zmq.POLLIN):
                return None
            frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            self.counts["bytes_received"] += sum(len(f) for f in frames)
            try:
                msg = decode(frames, self._key, max_bytes=self._max_bytes, max_tokens=self._max_tokens)
                if expect is not None and not isinstance(msg, expect):
                    raise WireError("kind", f"{type(msg).__name__} on a {expect.__name__} channel")
            except WireError as e:
                first = self.rejected[e.reason] == 0
                self.rejected[e.reason] += 1
                (logger.warning if first else logger.debug)("%s: rejected a message (%s)", self.endpoint, e)
            else:
                self.counts["received"] += 1
                return msg
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "rejected": sum(self.rejected.values()), "rejected_by_reason": dict(self.rejected)}

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
            self._ctx.term()


class Receiver:
    """PULL socket that binds (sidecar side).  :meth:`recv` returns the next valid message or None on
    timeout; invalid ones are counted in ``rejected`` (by reason) and skipped.  Not thread-safe.
    Non-finite hidden states are not filtered here: call :func:`~draft_align.wire.messages.drop_nonfinite`."""

    def __init__(
        self,
        endpoint: str,
        key: bytes | None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        allow_remote: bool = False,
        rcvhwm: int = 8,
    ) -> None:
        check_endpoint(endpoint, key, allow_remote)
        self._inbox = _Inbox("PULL", endpoint, key, bind=True, max_bytes=max_bytes, max_tokens=max_tokens,
                             rcvhwm=rcvhwm)
        self.endpoint = self._inbox.endpoint  # the bound address (a tcp '*' port resolved)

    @property
    def rejected(self) -> collections.Counter[str]:
        return self._inbox.rejected

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """Next valid message; None when ``timeout_ms`` passes (None waits forever).  Never raises for a
        bad message."""
        return self._inbox.next(timeout_ms, None)

    def stats(self) -> dict[str, Any]:
        """received, bytes_received (valid or not), rejected, rejected_by_reason."""
        return self._inbox.stats()

    def close(self) -> None:
        self._inbox.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Publisher:
    """PUB socket that binds (sidecar side): announces DraftPublished to any subscriber (none is fine)."""

    def __init__(self, endpoint: str, key: bytes | None, *, allow_remote: bool = False) -> None:
        check_endpoint(endpoint, key, allow_remote)
        import zmq

        self._key = key
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            _prepare_bind(endpoint)
            self._sock.bind(endpoint)
            self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        except Exception:
            self._sock.close(linger=0)
            self._ctx.term()
            raise

    def publish(self, msg: DraftPublished) -> None:
        """Send to current subscribers (PUB never blocks; a subscriber that joins later misses it)."""
        import zmq

        if not isinstance(msg, DraftPublished):
            raise TypeError(f"Publisher sends DraftPublished, got {type(msg).__name__}")
        try:
            self._sock.send_multipart(encode(msg, self._key), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("%s: DraftPublished v%d not queued (subscriber not keeping up)", self.endpoint,
                           msg.draft_version)

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
            self._ctx.term()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscriber:
    """SUB socket that connects (engine/RL side) and receives every DraftPublished; anything else or
    invalid is counted in ``rejected`` and skipped."""

    def __init__(self, endpoint: str, key: bytes | None, *, allow_remote: bool = False,
                 max_bytes: int = 1024 * 1024) -> None:
        check_endpoint(endpoint, key, allow_remote)
        self._inbox = _Inbox("SUB", endpoint, key, bind=False, max_bytes=max_bytes,
                             max_tokens=DEFAULT_MAX_TOKENS, rcvhwm=64)
        self.endpoint = endpoint

    @property
    def rejected(self) -> collections.Counter[str]:
        return self._inbox.rejected

    def poll(self, timeout_ms: int | None = 0) -> DraftPublished | None:
        """Next valid DraftPublished, or None after ``timeout_ms`` (0: only what already arrived)."""
        msg = self._inbox.next(timeout_ms, DraftPublished)
        assert msg is None or isinstance(msg, DraftPublished)
        return msg

    def stats(self) -> dict[str, Any]:
        return self._inbox.stats()

    def close(self) -> None:
        self._inbox.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
