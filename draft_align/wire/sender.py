"""The policy side's sending end: :class:`TapSender` (docs/wire.md).  ``offer()`` never blocks: a bounded queue
and a short send deadline drop (and count) instead of stalling the RL job; every message is stamped with the
sender's id and sequence number, and one over the receiver's size limit is refused (counted).  Imports zmq
lazily."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from draft_align.wire.codec import encode_views
from draft_align.wire.endpoints import check_endpoint
from draft_align.wire.messages import DraftPublished, HeadSync, Message, StepReport, TapBatch, TapPart
from draft_align.wire.schema import DEFAULT_MAX_BYTES
from draft_align.wire.sequence_guard import Envelope
from draft_align.wire.sockets import Closing, authenticate

logger = logging.getLogger(__name__)

_MESSAGE_OVERHEAD = 1024  # estimated header + MAC bytes, for the send queue's byte budget


def _message_bytes(msg: Message) -> int:
    tensors = msg.tensors().values()
    return _MESSAGE_OVERHEAD + sum(
        t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size")
    )


_MESSAGE_TYPES = (TapBatch, HeadSync, DraftPublished, StepReport, TapPart)


class TapSender(Closing):
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
        self._envelope = Envelope()  # the (sender id, seq) stamps
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[Message, int]] = collections.deque()
        self._queued_bytes = 0
        self._closing = False
        self._close_deadline = 0.0
        self._counts = collections.Counter(
            offered=0,
            sent=0,
            dropped_queue_full=0,
            dropped_peer=0,
            dropped_invalid=0,
            dropped_closed=0,
            dropped_too_large=0,
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

    @property
    def sender_id(self) -> str:
        """The id the next message goes out under (a new one after a long silence: wire/sequence_guard.py)."""
        return self._envelope.sender_id

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

        sender, seq = self._envelope.stamp()
        try:
            frames = encode_views(msg, self._key, sender=sender, seq=seq)
        except Exception as e:  # an invalid message must not kill the sending thread
            logger.warning("tap: dropping an invalid %s: %s", type(msg).__name__, e)
            with self._cv:
                self._counts["dropped_invalid"] += 1
            return
        size = sum(len(f) for f in frames)
        if size > self._max_message_bytes:
            logger.warning(
                "tap: not sending a %s of %d bytes: over the receiver's limit of %d bytes "
                "(wire.max_message_mb)",
                type(msg).__name__,
                size,
                self._max_message_bytes,
            )
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
            self._envelope.advance()  # numbers only what reached libzmq: a gap at the receiver is a loss in transit
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
            logger.warning(
                "tap sender thread still busy after %.1fs; leaving it to exit on its own", timeout_s
            )
        else:
            self._ctx.term()
