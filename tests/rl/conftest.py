"""Tiny policy and drafts for the RL tests: the session's tiny target (tests/conftest.py) plus random
EAGLE-3 drafts exported in engine format, so ``load_draft`` (and the DraftSource) can read them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.publish import export_draft
from draft_align.publish.versions import version_dir, write_latest

AUX = (1, 3, 4)  # TINY_AUX of tests/conftest.py
DRAFT_VOCAB = 48


def make_draft(target_config, seed: int = 0, aux=AUX, vocab: torch.Tensor | None = None) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = Eagle3Config.from_target(
        target_config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=aux, torch_dtype="float32"
    )
    d = Eagle3Draft(cfg)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    d.set_vocab(vocab if vocab is not None else torch.arange(3, 3 + DRAFT_VOCAB))
    return d.eval()


def publish(
    draft: Eagle3Draft, run_dir: Path, target_config, draft_version: int, policy_version: int
) -> Path:
    """Export ``draft`` as ``run_dir/drafts/v{draft_version:04d}`` (float32) and point ``latest`` at it."""
    out = export_draft(
        draft,
        version_dir(run_dir, draft_version),
        target_config=target_config,
        target_name="tiny",
        metrics={"acc": 1.0},
        draft_version=draft_version,
        policy_version=policy_version,
        tokenizer_fingerprint="0" * 16,
        dtype=torch.float32,
    )
    write_latest(run_dir, out)
    return out


@pytest.fixture
def target_config(tiny_world):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_world.model)


@pytest.fixture
def frozen_dir(tmp_path, target_config) -> Path:
    """A warm-start run folder with one published draft (v0001, policy version 0)."""
    publish(make_draft(target_config, seed=1), tmp_path / "warm", target_config, 1, 0)
    return tmp_path / "warm" / "drafts" / "v0001"


class DraftKit:
    """Helpers handed to tests as a fixture (test modules here are not a package)."""

    make = staticmethod(make_draft)
    publish = staticmethod(publish)


@pytest.fixture
def kit() -> type[DraftKit]:
    return DraftKit
