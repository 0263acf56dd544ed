"""One sidecar per run folder: an exclusive ``flock`` on ``<run>/sidecar/lock`` (rank r > 0 of a torchrun
sidecar: ``lock-rank<r>``), held from setup to close.

A second sidecar on the same run would bind the same sockets (the first then receives nothing) and write the
same folder; it is refused at start with one line naming the holder's pid.  The kernel drops the lock when its
holder exits or is killed, so a killed sidecar never leaves a stale lock behind (on network filesystems
without ``flock`` support the lock is only as good as the filesystem's).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


class RunInUseError(RuntimeError):
    """Another live sidecar holds the run folder's lock."""


class RunLock:
    """The held lock (:meth:`acquire`); :meth:`release` (or process exit) gives it back.  The file keeps the
    holder's pid for the refusal message; it is never deleted (deleting it would let two holders coexist)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, path: Path) -> RunLock:
        """Take the lock at ``path`` or raise :class:`RunInUseError` (one line: the holder's pid and a way out).
        A symlink at ``path`` is refused (OSError)."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunInUseError(
                f"run folder {path.parent.parent} is in use by another sidecar (pid {holder}, lock {path}): "
                f"stop that one first, or give this one another `run` name"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:  # a full disk: the lock holds all the same, only the pid goes unnamed
            pass
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the lock back (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"
