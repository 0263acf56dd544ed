"""Fixtures of the draft-head tests: a tiny random-weight HF Llama target."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory: ``tiny_llama(layers, vocab, hidden)`` → a random LlamaForCausalLM (seed 0; 4 heads, 2 kv heads,
    head_dim 8, intermediate 64, 128 positions, untied lm_head), in eval mode."""

    def build(layers: int, vocab: int, hidden: int) -> LlamaForCausalLM:
        torch.manual_seed(0)
        cfg = LlamaConfig(
            hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=vocab, max_position_embeddings=128,
            tie_word_embeddings=False,
        )  # fmt: skip
        return LlamaForCausalLM(cfg).eval()

    return build
