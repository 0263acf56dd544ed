"""Writing to disk: :func:`save_tensors` (safetensors' ``save_file`` with its I/O failures as ``OSError``) and
the file modes of what engines read (docs/engines.md, "File modes").

Modes.  What an engine or another job loads from a run folder (published draft and adapter versions,
``latest``, a merged policy) is group-readable and nothing more, whatever the process's umask: folders
``SHARED_DIR_MODE`` (0750), files ``SHARED_FILE_MODE`` (0640).  An engine running as another user reads them
as a member of the run folder's group.  Secrets and raw tapped data (the wire key, ipc sockets, wire
recordings) are ``PRIVATE_MODE`` (0600), owner only.

safetensors reports a failed write (a full disk, a read-only folder) as ``SafetensorError("... I/O error: No
space left on device (os error 28)")``, not as an ``OSError``, so code that handles a full disk by catching
``OSError`` (the sidecar keeps serving and retries; the warm-start stops with one line) would see a traceback
instead.  Every safetensors write goes through here.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

_OS_ERROR = re.compile(r"os error (\d+)")

SHARED_DIR_MODE = 0o750
SHARED_FILE_MODE = 0o640
PRIVATE_MODE = 0o600


def make_shared_dirs(path: str | os.PathLike[str]) -> None:
    """``mkdir -p path``; each folder this creates gets SHARED_DIR_MODE (mkdir's own mode is masked by the
    umask), existing ones are left as they are."""
    path = Path(path)
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for p in reversed(missing):
        try:
            p.mkdir()
        except FileExistsError:  # made meanwhile by another process: theirs
            continue
        os.chmod(p, SHARED_DIR_MODE)


def share_tree(path: str | os.PathLike[str]) -> None:
    """Give the folder ``path`` and everything in it the shared modes (folders 0750, files 0640); links are
    left alone."""
    os.chmod(path, SHARED_DIR_MODE)
    for root, dirs, files in os.walk(path):
        for d in dirs:
            if not os.path.islink(os.path.join(root, d)):
                os.chmod(os.path.join(root, d), SHARED_DIR_MODE)
        for f in files:
            if not os.path.islink(os.path.join(root, f)):
                os.chmod(os.path.join(root, f), SHARED_FILE_MODE)


def save_tensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """``safetensors.torch.save_file``; an I/O failure raises ``OSError`` with its errno (EIO when the
    message names none), anything else (bad tensors) propagates unchanged."""
    import safetensors.torch
    from safetensors import SafetensorError

    try:
        safetensors.torch.save_file(dict(tensors), str(path), metadata=dict(metadata) if metadata else None)
    except SafetensorError as e:
        text = str(e)
        if "I/O error" not in text:
            raise
        m = _OS_ERROR.search(text)
        code = int(m.group(1)) if m else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from e
