"""The asset cache under :func:`home`: an entry is built in a temporary sibling and renamed into place, so a
reader never sees a half-written asset; :class:`AssetError`, the one error an asset fails with."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HOME_ENV = "DRAFT_ALIGN_HOME"
COMPLETE_MARKER = ".complete"


class AssetError(RuntimeError):
    """An embedded asset or target model could not be obtained or loaded."""


def home() -> Path:
    """Cache root: ``$DRAFT_ALIGN_HOME`` or ``~/.cache/draft_align``."""
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "draft_align"


def build_dir_atomically(dest: Path, build: Callable[[Path], None], force: bool) -> Path:
    """Return ``dest``, running ``build(tmp)`` and renaming ``tmp`` to ``dest`` unless already complete.

    A directory counts as complete only when it holds ``COMPLETE_MARKER``, which is written after
    ``build`` returns; a directory without it (an interrupted build) is rebuilt.
    """
    if not force and (dest / COMPLETE_MARKER).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        build(tmp)
        _make_readable(tmp)
        (tmp / COMPLETE_MARKER).write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z") + "\n")
        if not force and (dest / COMPLETE_MARKER).is_file():
            return dest  # another process finished first; keep its copy
        if dest.exists():
            # rename() cannot replace a non-empty directory: move the old one aside first.
            trash = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old-"))
            os.replace(dest, trash / dest.name)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _make_readable(root: Path) -> None:
    """Undo mkdtemp/mkstemp's owner-only modes so a shared cache is readable by everyone."""
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def write_file_atomically(dest: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on a temporary sibling of ``dest`` and rename it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.tmp-")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o644)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
