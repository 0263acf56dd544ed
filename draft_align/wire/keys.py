"""The wire's HMAC key (docs/wire.md, "Keys"): ``wire.key_file``, ``$DRAFT_ALIGN_WIRE_KEY`` or a random key in
the run folder, created atomically; key files others may read are refused."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

KEY_ENV = "DRAFT_ALIGN_WIRE_KEY"
KEY_FILE_NAME = "wire.key"
MIN_KEY_BYTES = 16
KEY_BYTES = 32


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
    """The key in ``path``: refused (ValueError) when it is not a regular file or others may read or write
    it (``chmod 600``); group access is allowed with a warning (a shared service group)."""
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"wire key {path} is not a regular file")
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ValueError(
            f"wire key {path} is readable or writable by others (mode {stat.S_IMODE(mode):o}): "
            f"run chmod 600 {path}"
        )
    if mode & stat.S_IRWXG:
        logger.warning("wire key %s is accessible by its group (mode %o)", path, stat.S_IMODE(mode))
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
