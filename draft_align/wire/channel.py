"""ZeroMQ channels for wire messages (docs/wire.md).  The only module that imports zmq, lazily.

- :class:`TapSender` (policy side): PUSH, connects; ``offer()`` never blocks, a bounded queue and a short
  send deadline drop (and count) instead of stalling the RL job; it stamps every message with its sender
  id and sequence number and refuses (counts) a message over the receiver's size limit.
- :class:`Receiver` (sidecar): PULL, binds; validates every message, drops replays, counts rejections by
  reason, never raises on a bad message; :meth:`Receiver.drain` consumes up to a budget of messages or
  time, rejections included.
- With a key every connection authenticates at the ZeroMQ handshake (PLAIN with a key-derived password,
  checked by this module's ZAP handler) before any of its frames is buffered.
- :class:`Publisher` / :class:`Subscriber`: DraftPublished over PUB/SUB.
- :func:`resolve_key` (``keys.py``), :func:`default_endpoint`, :func:`check_endpoint` (``endpoints.py``):
  key and endpoint rules, re-exported here.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any, Self

from draft_align.wire.codec import encode
from draft_align.wire.endpoints import (
    SOCKET_DIR_FILE,
    _prepare_bind,
    check_endpoint,
    default_endpoint,
    rank_endpoint,
    tap_endpoints,
)
from draft_align.wire.keys import KEY_BYTES, KEY_ENV, KEY_FILE_NAME, MIN_KEY_BYTES, resolve_key
from draft_align.wire.messages import (
    DraftPublished,
    HeadSync,
    Message,
    StepReport,
    TapBatch,
    TapPart,
    decode_with_origin,
)
from draft_align.wire.replay import ReplayGuard
from draft_align.wire.schema import DEFAULT_MAX_BYTES, DEFAULT_MAX_TOKENS, HEADER_MAX_BYTES, WireError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BUFFER_BYTES", "DRAIN_MAX_MESSAGES", "KEY_BYTES", "KEY_ENV", "KEY_FILE_NAME", "MIN_KEY_BYTES",
    "SOCKET_DIR_FILE", "Publisher", "Receiver", "Subscriber", "TapSender", "authenticate", "check_endpoint",
    "default_endpoint", "rank_endpoint", "resolve_key", "tap_endpoints",
]

_MESSAGE_OVERHEAD = 1024  # estimated header + MAC bytes, for the send queue's byte budget
DEFAULT_BUFFER_BYTES = 1 << 30  # a receiver's queue per connection: RCVHWM = this // max_bytes messages
DRAIN_MAX_MESSAGES = 1024  # messages (valid or not) one drain consumes at most
_REFILL_GRACE_MS = 20  # after a rejection, how long a drain waits for the queue to refill before calling it empty
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
_ZAP_USER = b"draft_align"
_ZAP_DOMAIN = "draft_align.wire"
_AUTH_EVENTS = ("EVENT_HANDSHAKE_FAILED_AUTH", "EVENT_HANDSHAKE_FAILED_PROTOCOL",
                "EVENT_HANDSHAKE_FAILED_NO_DETAIL")


def _bind(sock: Any, endpoint: str) -> str:
    """Bind ``sock``; an ipc socket file is made 0600 at once (libzmq creates it through the umask)."""
    _prepare_bind(endpoint)
    import zmq

    sock.bind(endpoint)
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://"):], 0o600)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def _zap_password(key: bytes) -> bytes:
    """The PLAIN password every party with ``key`` derives: HMAC-SHA256(key, "draft_align.wire zap"), hex."""
    return hmac.new(key, b"draft_align.wire zap", hashlib.sha256).hexdigest().encode()


def authenticate(sock: Any, key: bytes) -> None:
    """Make a connecting zmq socket present ``key``'s credentials at the handshake (tools and tests that
    drive a raw socket; TapSender and Subscriber do it themselves)."""
    import zmq

    sock.setsockopt(zmq.PLAIN_USERNAME, _ZAP_USER)
    sock.setsockopt(zmq.PLAIN_PASSWORD, _zap_password(key))


class _ZapHandler:
    """A context's ZAP handler (ZeroMQ RFC 27) on a thread: accepts a PLAIN handshake iff the password is
    the key's (constant-time), so a peer without the key never gets a frame into the receive queue."""

    def __init__(self, ctx: Any, key: bytes) -> None:
        import zmq

        self._password = _zap_password(key)
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_ZAP_ENDPOINT)
        self._stop = threading.Event()
        self.denied = 0
        self._thread = threading.Thread(target=self._run, name="draft-align-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        try:
            while not self._stop.is_set():
                if not self._sock.poll(50, zmq.POLLIN):
                    continue
                req = self._sock.recv_multipart()
                version, request_id = (req + [b"", b""])[:2]
                ok = (len(req) == 8 and req[5] == b"PLAIN" and req[6] == _ZAP_USER
                      and hmac.compare_digest(req[7], self._password))
                if not ok:
                    self.denied += 1
                self._sock.send_multipart([version, request_id, b"200" if ok else b"400",
                                           b"OK" if ok else b"bad credentials", _ZAP_USER if ok else b"", b""])
        except zmq.ZMQError:
            pass  # the context is closing
        finally:
            self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


def _zap_server(ctx: Any, sock: Any, key: bytes | None) -> _ZapHandler | None:
    """With a key, make bound ``sock`` a PLAIN server checked by a ZAP handler on ``ctx``."""
    if key is None:
        return None
    import zmq

    handler = _ZapHandler(ctx, key)
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt_string(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
    return handler


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
    ``send_timeout_s`` (no receiver, or a slow one) or one over ``max_message_bytes`` (the receiver's
    ``max_bytes``: it would drop it), with a log line.  Every drop is counted in :meth:`stats`.  Messages
    carry a sender id drawn at construction and a sequence number (docs/wire.md, "Envelope")."""

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
        max_message_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not self.endpoints:
            raise ValueError("TapSender needs at least one endpoint")
        for ep in self.endpoints:
            check_endpoint(ep, key, allow_remote)
        if queue_messages < 1 or queue_bytes < 1 or max_message_bytes < 1:
            raise ValueError("queue_messages, queue_bytes and max_message_bytes must be ≥ 1")
        import zmq

        self.endpoint = ", ".join(self.endpoints)  # for messages
        self._key = key
        self._queue_messages = queue_messages
        self._queue_bytes = queue_bytes
        self._send_timeout_s = send_timeout_s
        self._max_message_bytes = max_message_bytes
        self.sender_id = secrets.token_hex(8)
        self._seq = 0
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[Message, int]] = collections.deque()
        self._queued_bytes = 0
        self._closing = False
        self._close_deadline = 0.0
        self._counts = collections.Counter(
            offered=0, sent=0, dropped_queue_full=0, dropped_peer=0, dropped_invalid=0, dropped_closed=0,
            dropped_too_large=0, bytes_sent=0,
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
            if self._key is not None:
                authenticate(sock, self._key)
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
            frames = encode(msg, self._key, sender=self.sender_id, seq=self._seq)
        except Exception as e:  # an invalid message must not kill the sending thread
            logger.warning("tap: dropping an invalid %s: %s", type(msg).__name__, e)
            with self._cv:
                self._counts["dropped_invalid"] += 1
            return
        self._seq += 1
        size = sum(len(f) for f in frames)
        if size > self._max_message_bytes:
            logger.warning("tap: not sending a %s of %d bytes: over the receiver's limit of %d bytes "
                           "(wire.max_message_mb)", type(msg).__name__, size, self._max_message_bytes)
            with self._cv:
                self._counts["dropped_too_large"] += 1
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
    """A receiving socket (bound or connected) that decodes, validates, drops replays and counts; used by
    Receiver and Subscriber.

    Memory before authentication is bounded: with a key, a peer must pass the PLAIN handshake (ZAP) before
    libzmq reads any of its frames; ``MAXMSGSIZE`` bounds each frame by the message limit and ``RCVHWM``
    is ``buffer_bytes // max_bytes`` messages per connection.  Failed handshakes are counted as ``auth``."""

    def __init__(self, sock_type: str, endpoint: str, key: bytes | None, *, bind: bool, max_bytes: int,
                 max_tokens: int, buffer_bytes: int) -> None:
        import zmq

        if max_bytes < 1 or buffer_bytes < 1:
            raise ValueError(f"max_bytes ({max_bytes}) and buffer_bytes ({buffer_bytes}) must be ≥ 1")
        self.endpoint = endpoint
        self._key = key
        self._max_bytes = max_bytes
        self._max_tokens = max_tokens
        self._guard = ReplayGuard()
        self.rejected: collections.Counter[str] = collections.Counter()
        self.counts = collections.Counter(received=0, bytes_received=0)
        self.rcvhwm = max(1, buffer_bytes // max_bytes)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(getattr(zmq, sock_type))
        self._zap: _ZapHandler | None = None
        self._monitor: Any = None
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            # per frame: no frame of a valid message exceeds the message limit (decode checks the sum)
            self._sock.setsockopt(zmq.MAXMSGSIZE, max(max_bytes, HEADER_MAX_BYTES))
            if sock_type == "SUB":
                self._sock.setsockopt(zmq.SUBSCRIBE, b"")
            if key is not None:
                events = 0
                for name in _AUTH_EVENTS:
                    events |= getattr(zmq, name)
                self._monitor = self._sock.get_monitor_socket(events)
            if bind:
                self._zap = _zap_server(self._ctx, self._sock, key)
                self.endpoint = _bind(self._sock, endpoint)
            else:
                if key is not None:
                    authenticate(self._sock, key)
                self._sock.connect(endpoint)
        except Exception:
            self.close()
            raise

    def _count(self, e: WireError) -> None:
        first = self.rejected[e.reason] == 0
        self.rejected[e.reason] += 1
        (logger.warning if first else logger.debug)("%s: rejected a message (%s)", self.endpoint, e)

    def _count_auth_failures(self) -> None:
        """Fold the handshake failures the monitor reported into ``rejected["auth"]``."""
        if self._monitor is None or self._monitor.closed:
            return
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self._monitor)
            self._count(WireError("auth", f"handshake from {event.get('endpoint', b'?')!r} failed "
                                          f"(no or another key; event {event['event']})"))

    def take(self, timeout_ms: int | None, expect: type | None) -> tuple[bool, Message | None]:
        """Consume at most one message, waiting up to ``timeout_ms`` for it: (whether one was consumed,
        the valid message or None when it was rejected and counted)."""
        import zmq

        self._count_auth_failures()
        if not self._sock.poll(timeout_ms, zmq.POLLIN):
            return False, None
        try:
            frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # readable, then gone: a peer that died mid-message has its partial one rolled back
            return False, None
        self.counts["bytes_received"] += sum(len(f) for f in frames)
        try:
            msg, origin = decode_with_origin(frames, self._key, max_bytes=self._max_bytes,
                                             max_tokens=self._max_tokens)
            if expect is not None and not isinstance(msg, expect):
                raise WireError("kind", f"{type(msg).__name__} on a {expect.__name__} channel")
            self._guard.check(origin)
        except WireError as e:
            self._count(e)
            return True, None
        self.counts["received"] += 1
        return True, msg

    def next(self, timeout_ms: int | None, expect: type | None) -> Message | None:
        """The next valid message, waiting up to ``timeout_ms`` (None: forever).  Rejections are consumed
        and counted and never end the wait early; with ``timeout_ms`` 0 the call reads until the queue is
        empty or :data:`DRAIN_MAX_MESSAGES` were rejected."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        rejected = 0
        while deadline is None or rejected < DRAIN_MAX_MESSAGES:
            wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            got, msg = self.take(wait, expect)
            if msg is not None:
                return msg
            if not got:
                return None
            rejected += 1
        return None

    def drain(self, budget_s: float, timeout_ms: int, max_messages: int, expect: type | None
              ) -> Iterator[Message]:
        """Yield valid messages, consuming (valid or rejected) up to ``max_messages`` or until ``budget_s``
        has passed (at least one is consumed if one is waiting); wait up to ``timeout_ms`` for the first
        valid one.  A rejection is never taken for an empty queue."""
        t0 = time.monotonic()
        first_by = t0 + timeout_ms / 1000
        end = max(t0 + budget_s, first_by)
        yielded = rejected = False
        for i in range(max_messages):
            now = time.monotonic()
            if i and now >= end:
                return
            wait = 0 if yielded else max(0, int((first_by - now) * 1000))
            if rejected:  # the queue is only RCVHWM deep and refills from the peer as it is read
                wait = max(wait, _REFILL_GRACE_MS)
            got, msg = self.take(wait, expect)
            if not got:
                return
            rejected = msg is None
            if msg is not None:
                yielded = True
                yield msg

    def stats(self) -> dict[str, Any]:
        self._count_auth_failures()
        return {**self.counts, "rejected": sum(self.rejected.values()), "rejected_by_reason": dict(self.rejected)}

    def close(self) -> None:
        if self._monitor is not None and not self._monitor.closed:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        if not self._sock.closed:
            self._sock.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        if not self._ctx.closed:
            self._ctx.term()


class _Listening:
    """A receiving end that owns an :class:`_Inbox`: its counters, ``close`` and ``with``."""

    _inbox: _Inbox

    @property
    def rejected(self) -> collections.Counter[str]:
        """Rejections so far, by reason (refused handshakes included)."""
        self._inbox._count_auth_failures()
        return self._inbox.rejected

    def stats(self) -> dict[str, Any]:
        """received, bytes_received (valid or not), rejected, rejected_by_reason."""
        return self._inbox.stats()

    def close(self) -> None:
        self._inbox.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Receiver(_Listening):
    """PULL socket that binds (sidecar side).  :meth:`recv` returns the next valid message or None on
    timeout, :meth:`drain` yields what is waiting within a budget; invalid, replayed and unauthenticated
    messages are counted in ``rejected`` (by reason) and skipped.  Not thread-safe.  Non-finite hidden
    states are not filtered here: call :func:`~draft_align.wire.packing.drop_nonfinite`.

    Memory held for unread messages is at most about ``buffer_bytes`` per connected (authenticated)
    sender: ``RCVHWM = buffer_bytes // max_bytes`` messages of at most ``max_bytes`` each."""

    def __init__(
        self,
        endpoint: str,
        key: bytes | None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        allow_remote: bool = False,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ) -> None:
        check_endpoint(endpoint, key, allow_remote)
        self._inbox = _Inbox("PULL", endpoint, key, bind=True, max_bytes=max_bytes, max_tokens=max_tokens,
                             buffer_bytes=buffer_bytes)
        self.endpoint = self._inbox.endpoint  # the bound address (a tcp '*' port resolved)

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """Next valid message; None when ``timeout_ms`` passes (None waits forever) or, with 0, when
        nothing valid is waiting.  Never raises for a bad message."""
        return self._inbox.next(timeout_ms, None)

    def drain(self, budget_s: float, timeout_ms: int = 0,
              max_messages: int = DRAIN_MAX_MESSAGES) -> Iterator[Message]:
        """The valid messages among the next ``max_messages`` waiting (rejections count toward it), for at
        most about ``budget_s`` seconds after the first valid one, which is waited for up to ``timeout_ms``."""
        return self._inbox.drain(budget_s, timeout_ms, max_messages, None)



class Publisher:
    """PUB socket that binds (sidecar side): announces DraftPublished to any subscriber (none is fine).
    With a key, subscribers authenticate at the handshake."""

    def __init__(self, endpoint: str, key: bytes | None, *, allow_remote: bool = False) -> None:
        check_endpoint(endpoint, key, allow_remote)
        import zmq

        self._key = key
        self.sender_id = secrets.token_hex(8)
        self._seq = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._zap: _ZapHandler | None = None
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._zap = _zap_server(self._ctx, self._sock, key)
            self.endpoint = _bind(self._sock, endpoint)
        except Exception:
            self.close()
            raise

    def publish(self, msg: DraftPublished) -> None:
        """Send to current subscribers (PUB never blocks; a subscriber that joins later misses it)."""
        import zmq

        if not isinstance(msg, DraftPublished):
            raise TypeError(f"Publisher sends DraftPublished, got {type(msg).__name__}")
        frames = encode(msg, self._key, sender=self.sender_id, seq=self._seq)
        self._seq += 1
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("%s: DraftPublished v%d not queued (subscriber not keeping up)", self.endpoint,
                           msg.draft_version)

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        if not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscriber(_Listening):
    """SUB socket that connects (engine/RL side) and receives every DraftPublished; anything else, invalid
    or replayed is counted in ``rejected`` and skipped."""

    def __init__(self, endpoint: str, key: bytes | None, *, allow_remote: bool = False,
                 max_bytes: int = 1024 * 1024) -> None:
        check_endpoint(endpoint, key, allow_remote)
        self._inbox = _Inbox("SUB", endpoint, key, bind=False, max_bytes=max_bytes,
                             max_tokens=DEFAULT_MAX_TOKENS, buffer_bytes=64 * max_bytes)
        self.endpoint = endpoint

    def poll(self, timeout_ms: int | None = 0) -> DraftPublished | None:
        """Next valid DraftPublished, or None after ``timeout_ms`` (0: only what already arrived)."""
        msg = self._inbox.next(timeout_ms, DraftPublished)
        assert msg is None or isinstance(msg, DraftPublished)
        return msg

