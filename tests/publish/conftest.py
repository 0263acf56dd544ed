"""Fixtures of the publish tests: a tiny random EAGLE-3 draft for an 8-layer stand-in target, exported with
fixed provenance (handed over as a fixture: test modules here are not a package)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.publish import export_draft


class Eagle3Kit:
    """A target of L = 8 layers (engine default aux ids (2, 4, 5)), drafts for it, and their export."""

    L = 8
    DEFAULT_IDS = (2, 4, 5)
    CUSTOM_IDS = (1, 2, 3)
    ENGINE_NAMES = {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }

    @classmethod
    def target_cfg(cls, **kw: Any) -> SimpleNamespace:
        base = dict(
            num_hidden_layers=cls.L,
            hidden_size=24,
            vocab_size=50,
            max_position_embeddings=128,
            num_attention_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=1,
            eos_token_id=2,
            architectures=["LlamaForCausalLM"],
        )
        base.update(kw)
        return SimpleNamespace(**base)

    @classmethod
    def make_draft(
        cls, aux: tuple[int, ...] = DEFAULT_IDS, seed: int = 0, vocab: torch.Tensor | None = None, **kw: Any
    ) -> Eagle3Draft:
        """``vocab``: the selected target ids (default: 20 of the 50, odd ids 3..41)."""
        base = dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=50,
            draft_vocab_size=20,
            target_hidden_size=24,
            aux_layer_ids=aux,
            target_num_layers=cls.L,
            max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        base.update(kw)
        torch.manual_seed(seed)
        d = Eagle3Draft(Eagle3Config(**base))
        for p in d.parameters():
            nn.init.normal_(p, std=0.3)
        d.set_vocab(torch.arange(3, 43, 2) if vocab is None else vocab)
        return d

    @classmethod
    def export(cls, draft: Eagle3Draft, out: Path, **kw: Any) -> Path:
        """``export_draft`` with draft v3 / policy v7, metrics {"acc_len": 1.5}, fingerprint 0123456789abcdef."""
        args = dict(
            target_config=cls.target_cfg(),
            target_name="tiny/target",
            metrics={"acc_len": 1.5},
            draft_version=3,
            policy_version=7,
            tokenizer_fingerprint="0123456789abcdef",
        )
        args.update(kw)
        return export_draft(draft, out, **args)

    @staticmethod
    def leftovers(parent: Path) -> list[str]:
        """Hidden entries (temp / swapped-out folders) left in ``parent``."""
        return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def e3() -> type[Eagle3Kit]:
    return Eagle3Kit
