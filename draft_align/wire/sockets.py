"""Socket-level rules every wire channel shares (docs/wire.md): binding (ipc sockets 0600 in a private folder),
the PLAIN handshake with a key-derived password checked by a ZAP handler before any frame of a peer is
buffered, and closing.  Imports zmq lazily."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from typing import Any, Self

from draft_align.wire.endpoints import _prepare_bind

logger = logging.getLogger(__name__)

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
_ZAP_USER = b"draft_align"
_ZAP_DOMAIN = "draft_align.wire"
AUTH_EVENTS = (
    "EVENT_HANDSHAKE_FAILED_AUTH",
    "EVENT_HANDSHAKE_FAILED_PROTOCOL",
    "EVENT_HANDSHAKE_FAILED_NO_DETAIL",
)  # socket-monitor events of a refused handshake


def bind_socket(sock: Any, endpoint: str) -> str:
    """Bind ``sock``; an ipc socket file is made 0600 at once (libzmq creates it through the umask)."""
    _prepare_bind(endpoint)
    import zmq

    sock.bind(endpoint)
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://") :], 0o600)
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


class ZapHandler:
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
                ok = (
                    len(req) == 8
                    and req[5] == b"PLAIN"
                    and req[6] == _ZAP_USER
                    and hmac.compare_digest(req[7], self._password)
                )
                if not ok:
                    self.denied += 1
                self._sock.send_multipart(
                    [
                        version,
                        request_id,
                        b"200" if ok else b"400",
                        b"OK" if ok else b"bad credentials",
                        _ZAP_USER if ok else b"",
                        b"",
                    ]
                )
        except zmq.ZMQError:
            pass  # the context is closing
        finally:
            self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


def zap_server(ctx: Any, sock: Any, key: bytes | None) -> ZapHandler | None:
    """With a key, make bound ``sock`` a PLAIN server checked by a ZAP handler on ``ctx``."""
    if key is None:
        return None
    import zmq

    handler = ZapHandler(ctx, key)
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt_string(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
    return handler


def close_bound(sock: Any, zap: ZapHandler | None, ctx: Any) -> None:
    """Close a socket, its ZAP handler and its context (each once)."""
    if not sock.closed:
        sock.close(linger=0)
    if zap is not None:
        zap.close()
    if not ctx.closed:
        ctx.term()


class Closing:
    """``with`` closes it."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
