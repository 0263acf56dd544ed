"""bf16 autocast only where the device computes it natively (train/precision.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_align.train import precision


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ("fpu sse2 avx2 fma", False),  # AVX2-only EPYC: bf16 is emulated
        ("fpu avx2 avx512f avx512_bf16", True),
        ("fpu avx2 amx_bf16 amx_tile", True),
    ],
)
def test_cpu_flags_decide(tmp_path: Path, flags: str, native: bool, monkeypatch):
    monkeypatch.setattr(precision.platform, "system", lambda: "Linux")
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert precision.cpu_has_native_bf16.__wrapped__(str(info)) is native


def test_unreadable_cpuinfo_means_fp32(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(precision.platform, "system", lambda: "Linux")
    assert precision.cpu_has_native_bf16.__wrapped__(str(tmp_path / "missing")) is False


def test_explicit_setting_wins_and_none_follows_the_device(monkeypatch):
    cpu = torch.device("cpu")
    assert precision.resolve_autocast(True, cpu) is True
    assert precision.resolve_autocast(False, cpu) is False
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert precision.resolve_autocast(None, cpu) is True
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert precision.resolve_autocast(None, cpu) is False


def test_recipes_default_to_automatic():
    from draft_align.config import CotrainRecipe, WarmstartRecipe, load_recipe

    assert load_recipe(None, [], WarmstartRecipe).train.objective.autocast_bf16 is None
    assert load_recipe(None, [], CotrainRecipe).sidecar.train.objective.autocast_bf16 is None
    assert (
        load_recipe(
            None, ["train.objective.autocast_bf16=false"], WarmstartRecipe
        ).train.objective.autocast_bf16
        is False
    )
