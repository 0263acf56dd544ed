"""storage.save_tensors: safetensors' I/O failures (a full disk, a file-size limit) arrive as OSError."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draft_align.storage import save_tensors

_FSIZE_CHILD = r"""
import resource, signal, sys, torch
from draft_align.storage import save_tensors
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    save_tensors({"a": torch.zeros(1 << 16)}, sys.argv[1])
except OSError as e:
    print("OSError", e.errno)
else:
    print("no error")
"""


def test_a_real_write_failure_is_an_oserror(tmp_path: Path):
    """A real I/O failure inside safetensors' writer (a 4 KiB file-size limit, no root needed)."""
    out = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(tmp_path / "x.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.split() == ["OSError", str(errno.EFBIG)], out.stdout + out.stderr[-2000:]


def test_the_message_of_a_full_disk_keeps_its_errno(tmp_path: Path, monkeypatch):
    """The exact error safetensors raised on a full tmpfs in benchmarks/soak.py."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError) as e:
        save_tensors({"a": torch.zeros(3)}, tmp_path / "x.safetensors")
    assert e.value.errno == errno.ENOSPC


def test_other_errors_pass_through(tmp_path: Path):
    with pytest.raises(Exception) as e:
        save_tensors({"a": torch.zeros(3), "b": None}, tmp_path / "x.safetensors")  # type: ignore[dict-item]
    assert not isinstance(e.value, OSError)
    save_tensors({"a": torch.arange(3)}, tmp_path / "ok.safetensors")
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "ok.safetensors")["a"], torch.arange(3))
