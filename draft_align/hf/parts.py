"""Introspection of HF causal LMs (Llama/Qwen/Mistral layout): the parts every side needs by name.

The policy-side Taps, the warm-start loop, the heads that attach to a target and the estimators all
read the same four parts of a decoder-only model; this module is their one home.
"""

from __future__ import annotations

import torch
from torch import nn


class ModelLayoutError(ValueError):
    """The model is not a decoder-only HF LM with the expected parts."""


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module, nn.Module]:
    """(embed_tokens, layers, final norm, lm_head) of an HF causal LM (Llama/Qwen/Mistral layout)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise ModelLayoutError(
            f"{type(model).__name__}: expected .model.layers and .model.norm (a decoder-only HF LM)"
        )
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise ModelLayoutError(f"{type(model).__name__} has no output embedding (lm_head)")
    return inner.embed_tokens, inner.layers, inner.norm, lm_head


def head_rows(model: nn.Module, draft_to_target: torch.Tensor) -> torch.Tensor:
    """[draft_vocab, H] rows of the target's lm_head for the draft vocabulary (what HeadSync ships)."""
    _, _, _, lm_head = decoder_parts(model)
    return lm_head.weight.detach()[draft_to_target]


def frozen_embedding(model: nn.Module) -> nn.Embedding:
    """A frozen copy of the model's input embedding (the draft shares it, never trains it)."""
    emb, _, _, _ = decoder_parts(model)
    return nn.Embedding.from_pretrained(emb.weight.detach().clone(), freeze=True)
