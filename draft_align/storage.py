"""Writing tensors to disk: :func:`save_tensors`, safetensors' ``save_file`` with its I/O failures as ``OSError``.

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

import torch

_OS_ERROR = re.compile(r"os error (\d+)")


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
