"""Wire endpoints (docs/wire.md, "Transports"): ``ipc://`` in the run folder (or its private socket folder
when the path is too long for a socket name), ``tcp://`` with a key on loopback; per-rank endpoints; the
ipc socket's folder and file permissions."""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
import tempfile
from pathlib import Path

from draft_align.wire.keys import KEY_ENV

_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SOCKET_DIR_FILE = ".ipc_dir"  # in a run folder too long for socket names: where its sockets live


def _is_private_dir(path: Path) -> bool:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _private_socket_dir(run_dir: Path) -> Path:
    """The private folder (mode 0700, a random name under the temp dir) that holds the sockets of a run
    folder whose own path is too long for a socket name.  The first caller creates it and records its path
    in ``<run_dir>/.ipc_dir`` (exclusively: racing callers all end with the winner's); the others read it.
    A recorded folder that is gone (the temp dir was cleared) is made again, private; one that is not
    private (another user's, or group/other-accessible) is refused."""
    run_dir.mkdir(parents=True, exist_ok=True)
    pointer = run_dir / SOCKET_DIR_FILE
    for _ in range(3):
        try:
            target = Path(pointer.read_text(encoding="utf-8").strip())
        except FileNotFoundError:
            fresh = Path(tempfile.mkdtemp(prefix="draft_align-"))  # 0700, unpredictable, O_EXCL
            tmp = run_dir / f"{SOCKET_DIR_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
            tmp.write_text(f"{fresh}\n", encoding="utf-8")
            try:
                os.link(tmp, pointer)
            except FileExistsError:  # another process recorded its folder first: use that one
                fresh.rmdir()
                continue
            finally:
                tmp.unlink(missing_ok=True)
            return fresh
        except (UnicodeDecodeError, IsADirectoryError) as e:
            raise ValueError(f"{pointer} is not a socket folder record ({e}); remove it") from e
        if not target.is_absolute() or len(str(target)) > _MAX_SOCKET_PATH - 40:
            raise ValueError(f"{pointer} names {str(target)!r}, not a short absolute folder; remove it")
        try:
            target.mkdir(mode=0o700)
            os.chmod(target, 0o700)  # mkdir's mode is masked by the umask
        except FileExistsError:
            pass
        if not _is_private_dir(target):
            raise ValueError(
                f"socket folder {target} (from {pointer}) is not a private folder of this user "
                f"(owner {os.getuid()}, mode 0700); remove {pointer}"
            )
        return target
    raise RuntimeError(f"could not agree on a socket folder through {pointer}")


TAP_SOCKET = "tap"  # PULL: TapBatch / TapPart / HeadSync / StepReport from the policy side
NOTIFY_SOCKET = "notify"  # PUB: DraftPublished


def tap_endpoint(run_dir: Path, configured: str | None = None) -> str:
    """Where the sidecar's tap socket is: ``configured`` (``wire.endpoint``), else the run folder's."""
    return configured or default_endpoint(run_dir, TAP_SOCKET)


def notify_endpoint(run_dir: Path, configured: str | None = None) -> str:
    """Where the sidecar publishes DraftPublished: ``configured`` (``wire.notify_endpoint``), else the run
    folder's."""
    return configured or default_endpoint(run_dir, NOTIFY_SOCKET)


def default_endpoint(run_dir: Path, name: str) -> str:
    """``ipc://<run_dir>/<name>.sock``, or, when that path is longer than a socket name may be,
    ``ipc://<private folder>/<name>.sock`` in the run's private socket folder (:func:`_private_socket_dir`:
    a random 0700 folder under the temp dir, recorded in ``<run_dir>/.ipc_dir``)."""
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"endpoint name {name!r}: use letters, digits, '-', '_' or '.'")
    run_dir = Path(os.path.abspath(run_dir))
    path = str(run_dir / f"{name}.sock")
    if len(path) > _MAX_SOCKET_PATH:
        path = str(_private_socket_dir(run_dir) / f"{name}.sock")
        if len(path) > _MAX_SOCKET_PATH:
            raise ValueError(f"temp dir {tempfile.gettempdir()!r} is too long for an ipc socket name")
    return f"ipc://{path}"


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The PULL endpoint sidecar rank ``rank`` binds: rank 0 keeps ``endpoint``; rank r > 0 binds
    ``ipc://…/<name>.<r>.sock`` (``.<r>`` appended when the path does not end in ``.sock``) or the tcp port + r
    (a ``*`` port: each rank any free one, which it reports)."""
    if rank < 0:
        raise ValueError(f"rank must be ≥ 0, got {rank}")
    if rank == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        stem, dot, ext = endpoint.rpartition(".sock")
        return f"{stem}.{rank}.sock" if dot and not ext else f"{endpoint}.{rank}"
    if endpoint.startswith("tcp://"):
        host, port = _split_tcp(endpoint)
        if port == "*":  # every rank binds its own free port and reports it (integrations/ray)
            return endpoint
        if int(port) + rank > 65535:
            raise ValueError(f"{endpoint!r}: port + rank {rank} is beyond 65535")
        return endpoint[: -len(port)] + str(int(port) + rank)
    raise ValueError(f"{endpoint!r}: only ipc:// and tcp:// endpoints are supported")


def tap_endpoints(endpoint: str, ranks: int) -> list[str]:
    """The endpoints of an N-rank sidecar, rank order (what a TapSender connects to)."""
    if ranks < 1:
        raise ValueError(f"ranks must be ≥ 1, got {ranks}")
    if ranks > 1 and endpoint.startswith("tcp://") and _split_tcp(endpoint)[1] == "*":
        raise ValueError(
            f"{endpoint!r}: the ranks of a multi-rank sidecar bind ports only they know; give a fixed tcp "
            f"port (rank r binds port + r) or discover them (sidecar.host=ray)"
        )
    return [rank_endpoint(endpoint, r) for r in range(ranks)]


def _split_tcp(endpoint: str) -> tuple[str, str]:
    rest = endpoint[len("tcp://") :]
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
        path = endpoint[len("ipc://") :]
        if not path:
            raise ValueError(f"{endpoint!r}: empty ipc path")
        if len(path.encode()) > _MAX_SOCKET_PATH + 7:
            raise ValueError(
                f"{endpoint!r}: ipc path longer than a socket name may be; use default_endpoint()"
            )
        return
    if endpoint.startswith("tcp://"):
        host, _ = _split_tcp(endpoint)
        if key is None:
            raise ValueError(
                f"{endpoint!r}: tcp needs an HMAC key (wire.key_file, ${KEY_ENV} or run_dir/wire.key)"
            )
        if not allow_remote and not _is_loopback(host):
            raise ValueError(
                f"{endpoint!r}: tcp must use 127.0.0.1, localhost or ::1 unless wire.allow_remote"
            )
        return
    raise ValueError(f"{endpoint!r}: only ipc:// and tcp:// endpoints are supported")


def _prepare_bind(endpoint: str) -> None:
    """For ipc: create the socket's folder (mode 0700 whatever the umask, when this creates it) and remove
    a stale socket file (never a regular file)."""
    if not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint[len("ipc://") :])
    if not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a socket; refusing to replace it")
    path.unlink(missing_ok=True)
