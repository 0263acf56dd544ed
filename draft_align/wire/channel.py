"""ZeroMQ channels for wire messages (docs/wire.md): the receiving ends and the draft announcements.

- :class:`Receiver` (sidecar): PULL, binds; validates every message, drops replays, counts rejections by
  reason, never raises on a bad message; :meth:`Receiver.drain` consumes up to a budget of messages or
  time, rejections included.
- :class:`Publisher` / :class:`Subscriber`: DraftPublished over PUB/SUB.
- Re-exported for one import: :class:`TapSender` (``sender.py``, the policy side), :func:`authenticate`
  (``sockets.py``: with a key every connection passes a PLAIN handshake checked by a ZAP handler before any
  of its frames is buffered), :func:`resolve_key` (``keys.py``), :func:`default_endpoint`,
  :func:`check_endpoint` (``endpoints.py``).

zmq is imported lazily, and only by this module, ``sender.py`` and ``sockets.py``.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator
from typing import Any

from draft_align.wire.codec import encode
from draft_align.wire.endpoints import (
    SOCKET_DIR_FILE,
    check_endpoint,
    default_endpoint,
    notify_endpoint,
    rank_endpoint,
    tap_endpoint,
    tap_endpoints,
)
from draft_align.wire.keys import KEY_BYTES, KEY_ENV, KEY_FILE_NAME, MIN_KEY_BYTES, resolve_key
from draft_align.wire.messages import DraftPublished, Message, decode_with_origin
from draft_align.wire.schema import DEFAULT_MAX_BYTES, DEFAULT_MAX_TOKENS, HEADER_MAX_BYTES, WireError
from draft_align.wire.sender import TapSender
from draft_align.wire.sequence_guard import Envelope, SequenceGuard
from draft_align.wire.sockets import (
    AUTH_EVENTS,
    Closing,
    ZapHandler,
    authenticate,
    bind_socket,
    close_bound,
    zap_server,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "DRAIN_MAX_MESSAGES",
    "KEY_BYTES",
    "KEY_ENV",
    "KEY_FILE_NAME",
    "MIN_KEY_BYTES",
    "SOCKET_DIR_FILE",
    "Publisher",
    "Receiver",
    "Subscriber",
    "TapSender",
    "authenticate",
    "check_endpoint",
    "default_endpoint",
    "notify_endpoint",
    "rank_endpoint",
    "resolve_key",
    "tap_endpoint",
    "tap_endpoints",
]

DEFAULT_BUFFER_BYTES = 1 << 30  # a receiver's queue per connection: RCVHWM = this // max_bytes messages
DRAIN_MAX_MESSAGES = 1024  # messages (valid or not) one drain consumes at most
_REFILL_GRACE_MS = (
    20  # after a rejection, how long a drain waits for the queue to refill before calling it empty
)


class _Inbox:
    """A receiving socket (bound or connected, to an endpoint :func:`check_endpoint` allows) that decodes,
    validates, drops replays and counts; used by Receiver and Subscriber.

    Memory before authentication is bounded: with a key, a peer must pass the PLAIN handshake (ZAP) before
    libzmq reads any of its frames; ``MAXMSGSIZE`` bounds each frame by the message limit and ``RCVHWM``
    is ``buffer_bytes // max_bytes`` messages per connection.  Failed handshakes are counted as ``auth``."""

    def __init__(
        self,
        sock_type: str,
        endpoint: str,
        key: bytes | None,
        *,
        bind: bool,
        allow_remote: bool,
        max_bytes: int,
        max_tokens: int,
        buffer_bytes: int,
        guard: SequenceGuard | None = None,
    ) -> None:
        check_endpoint(endpoint, key, allow_remote)
        import zmq

        if max_bytes < 1 or buffer_bytes < 1:
            raise ValueError(f"max_bytes ({max_bytes}) and buffer_bytes ({buffer_bytes}) must be ≥ 1")
        self.endpoint = endpoint
        self._key = key
        self._max_bytes = max_bytes
        self._max_tokens = max_tokens
        self.guard = guard if guard is not None else SequenceGuard()
        self.rejected: collections.Counter[str] = collections.Counter()
        self.counts = collections.Counter(received=0, bytes_received=0)
        self.rcvhwm = max(1, buffer_bytes // max_bytes)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(getattr(zmq, sock_type))
        self._zap: ZapHandler | None = None
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
                for name in AUTH_EVENTS:
                    events |= getattr(zmq, name)
                self._monitor = self._sock.get_monitor_socket(events)
            if bind:
                self._zap = zap_server(self._ctx, self._sock, key)
                self.endpoint = bind_socket(self._sock, endpoint)
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

    def _count_lost(self, origin: Any) -> None:
        """Count, as ``lost``, the messages a remembered sender numbered before ``origin`` that never arrived:
        libzmq drops a frame over MAXMSGSIZE (and the connection with it) without telling the socket, so the
        gap in the sender's sequence is where such a drop shows (the sender numbers only what it sent)."""
        missed = self.guard.missed(origin)
        if missed:
            first = self.rejected["lost"] == 0
            self.rejected["lost"] += missed
            (logger.warning if first else logger.debug)(
                "%s: %d message(s) of sender %s never arrived (sequence %d follows a gap): dropped in transit, "
                "e.g. over this receiver's size limit (wire.max_message_mb) or with a broken connection",
                self.endpoint,
                missed,
                origin.sender,
                origin.seq,
            )

    def _note_arrived(self, origin: Any) -> None:
        """A numbered message arrived but was rejected: its number is no gap (authenticated envelopes only:
        without a key anyone can write any number)."""
        if self._key is None:
            return
        try:
            self._count_lost(origin)
            self.guard.check(origin)
        except WireError:
            pass

    def _count_auth_failures(self) -> None:
        """Fold the handshake failures the monitor reported into ``rejected["auth"]``."""
        if self._monitor is None or self._monitor.closed:
            return
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self._monitor)
            self._count(
                WireError(
                    "auth",
                    f"handshake from {event.get('endpoint', b'?')!r} failed "
                    f"(no or another key; event {event['event']})",
                )
            )

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
        origin = None
        try:
            msg, origin = decode_with_origin(
                frames, self._key, max_bytes=self._max_bytes, max_tokens=self._max_tokens
            )
            if expect is not None and not isinstance(msg, expect):
                raise WireError("kind", f"{type(msg).__name__} on a {expect.__name__} channel")
            self._count_lost(origin)
            self.guard.check(origin)
        except WireError as e:
            self._count(e)
            origin = origin or e.origin
            if origin is not None and e.reason != "sequence":
                self._note_arrived(origin)
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

    def drain(
        self, budget_s: float, timeout_ms: int, max_messages: int, expect: type | None
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
        return {
            **self.counts,
            "rejected": sum(self.rejected.values()),
            "rejected_by_reason": dict(self.rejected),
        }

    def close(self) -> None:
        if self._monitor is not None and not self._monitor.closed:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        close_bound(self._sock, self._zap, self._ctx)


class _Listening(Closing):
    """A receiving end that owns an :class:`_Inbox`: its counters, ``close`` and ``with``."""

    _inbox: _Inbox

    @property
    def endpoint(self) -> str:
        """The address: as bound for a Receiver (a tcp '*' port resolved), as given for a Subscriber."""
        return self._inbox.endpoint

    @property
    def rejected(self) -> collections.Counter[str]:
        """Rejections so far, by reason (refused handshakes included)."""
        self._inbox._count_auth_failures()
        return self._inbox.rejected

    def stats(self) -> dict[str, Any]:
        """received, bytes_received (valid or not), rejected, rejected_by_reason."""
        return self._inbox.stats()

    @property
    def guard(self) -> SequenceGuard:
        """The sequence guard (wire/sequence_guard.py; a restarted receiver may be given the saved one)."""
        return self._inbox.guard

    def close(self) -> None:
        self._inbox.close()


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
        guard: SequenceGuard | None = None,
    ) -> None:
        self._inbox = _Inbox(
            "PULL",
            endpoint,
            key,
            bind=True,
            allow_remote=allow_remote,
            max_bytes=max_bytes,
            max_tokens=max_tokens,
            buffer_bytes=buffer_bytes,
            guard=guard,
        )

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """Next valid message; None when ``timeout_ms`` passes (None waits forever) or, with 0, when
        nothing valid is waiting.  Never raises for a bad message."""
        return self._inbox.next(timeout_ms, None)

    def drain(
        self, budget_s: float, timeout_ms: int = 0, max_messages: int = DRAIN_MAX_MESSAGES
    ) -> Iterator[Message]:
        """The valid messages among the next ``max_messages`` waiting (rejections count toward it), for at
        most about ``budget_s`` seconds after the first valid one, which is waited for up to ``timeout_ms``."""
        return self._inbox.drain(budget_s, timeout_ms, max_messages, None)


class Publisher(Closing):
    """PUB socket that binds (sidecar side): announces DraftPublished to any subscriber (none is fine).
    With a key, subscribers authenticate at the handshake."""

    def __init__(self, endpoint: str, key: bytes | None, *, allow_remote: bool = False) -> None:
        check_endpoint(endpoint, key, allow_remote)
        import zmq

        self._key = key
        self._envelope = Envelope()  # the (sender id, seq) stamps
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._zap: ZapHandler | None = None
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._zap = zap_server(self._ctx, self._sock, key)
            self.endpoint = bind_socket(self._sock, endpoint)
        except Exception:
            self.close()
            raise

    def publish(self, msg: DraftPublished) -> None:
        """Send to current subscribers (PUB never blocks; a subscriber that joins later misses it)."""
        import zmq

        if not isinstance(msg, DraftPublished):
            raise TypeError(f"Publisher sends DraftPublished, got {type(msg).__name__}")
        sender, seq = self._envelope.next()
        frames = encode(msg, self._key, sender=sender, seq=seq)
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning(
                "%s: DraftPublished v%d not queued (subscriber not keeping up)",
                self.endpoint,
                msg.draft_version,
            )

    def close(self) -> None:
        close_bound(self._sock, self._zap, self._ctx)


class Subscriber(_Listening):
    """SUB socket that connects (engine/RL side) and receives every DraftPublished; anything else, invalid
    or replayed is counted in ``rejected`` and skipped."""

    def __init__(
        self, endpoint: str, key: bytes | None, *, allow_remote: bool = False, max_bytes: int = 1024 * 1024
    ) -> None:
        self._inbox = _Inbox(
            "SUB",
            endpoint,
            key,
            bind=False,
            allow_remote=allow_remote,
            max_bytes=max_bytes,
            max_tokens=DEFAULT_MAX_TOKENS,
            buffer_bytes=64 * max_bytes,
        )

    def poll(self, timeout_ms: int | None = 0) -> DraftPublished | None:
        """Next valid DraftPublished, or None after ``timeout_ms`` (0: only what already arrived)."""
        msg = self._inbox.next(timeout_ms, DraftPublished)
        assert msg is None or isinstance(msg, DraftPublished)
        return msg
