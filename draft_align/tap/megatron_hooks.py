"""Forward hooks on a megatron-core ``GPTModel`` pipeline stage (the megatron counterpart of
:mod:`draft_align.hf.capture`), with HF ``hidden_states`` indexing kept exactly: index 0 is the embedding
output, index i (1 ≤ i < L) the output of the decoder layer whose megatron ``layer_number`` is i (the
residual stream, before any norm), index L the output of ``decoder.final_layernorm``.  The model is used
through its module attributes only (megatron-core itself is not imported here).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from draft_align.hf.capture import TapError


@dataclass(frozen=True)
class GPTParts:
    """The modules of one megatron ``GPTModel`` (pipeline stage) a Tap hooks; None where this stage lacks it."""

    embedding: nn.Module | None  # pre_process stage only; output [s, b, h] (sequence-sharded under SP)
    layers: tuple[nn.Module, ...]  # this stage's TransformerLayers; each has a global 1-based .layer_number
    final_norm: nn.Module | None  # post_process stage only
    output_weight: torch.Tensor | None  # [V_padded/tp, H] (the shared embedding when tied); post_process only
    config: Any  # the TransformerConfig
    vocab_size: int  # the model's (possibly padded) vocabulary


def gpt_parts(model: nn.Module) -> GPTParts:
    """Unwrap DDP / Float16Module (``.module``) and return the parts of a megatron ``GPTModel``."""
    inner = model
    for _ in range(8):
        if hasattr(inner, "decoder") and hasattr(inner, "config"):
            break
        inner = getattr(inner, "module", None)
        if inner is None:
            break
    if inner is None or not hasattr(inner, "decoder") or not hasattr(inner, "config"):
        raise TapError(
            f"{type(model).__name__}: expected a megatron GPTModel (.decoder, .config), possibly "
            "wrapped in .module"
        )
    decoder = inner.decoder
    layers = tuple(getattr(decoder, "layers", ()))
    for layer in layers:
        if not isinstance(getattr(layer, "layer_number", None), int):
            raise TapError(
                f"{type(layer).__name__} has no integer layer_number (not a megatron TransformerLayer)"
            )
    post = bool(getattr(inner, "post_process", False))
    final_norm = getattr(decoder, "final_layernorm", None) if post else None
    weight = None
    if post:
        if getattr(inner, "share_embeddings_and_output_weights", False):
            weight = inner.shared_embedding_or_output_weight()
        else:
            weight = inner.output_layer.weight
    embedding = getattr(inner, "embedding", None) if getattr(inner, "pre_process", False) else None
    return GPTParts(embedding, layers, final_norm, weight, inner.config, int(inner.vocab_size))


class MegatronTap:
    """Forward hooks on a megatron GPTModel stage capturing HF ``hidden_states`` indices ``owned`` (the
    subset of ``aux_layer_ids`` this stage holds) and, optionally, the final post-norm hidden state.

    Each forward pass that fires every hook once becomes one capture, queued first-in first-out; values
    stay [s, b, h] (sequence-first, as megatron produced them)."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int], capture_final: bool = True) -> None:
        parts = gpt_parts(model)
        n_layers = int(parts.config.num_layers)
        ids = tuple(int(i) for i in aux_layer_ids)
        if not ids or len(set(ids)) != len(ids) or list(ids) != sorted(ids):
            raise TapError(f"aux_layer_ids {ids} must be non-empty, distinct and ascending")
        if ids[0] < 0 or ids[-1] > n_layers:
            raise TapError(f"aux_layer_ids {ids} outside hidden_states indices 0..{n_layers} of this model")
        points: dict[int, nn.Module] = {}
        by_number = {int(layer.layer_number): layer for layer in parts.layers}
        for i in ids:
            if i == 0 and parts.embedding is not None:
                points[i] = parts.embedding
            elif i == n_layers and parts.final_norm is not None:
                points[i] = parts.final_norm
            elif 0 < i < n_layers and i in by_number:
                points[i] = by_number[i]
        self.aux_layer_ids = ids
        self.owned = tuple(sorted(points))  # the aux indices this stage captures
        self.capture_final = bool(capture_final) and parts.final_norm is not None
        self._points = points
        self._final_norm = parts.final_norm
        self._handles: list[Any] = []
        self._current: dict[Any, torch.Tensor] = {}
        self._queue: collections.deque[dict[Any, torch.Tensor]] = collections.deque()
        self._expect = len(points) + (1 if self.capture_final else 0)
        self.broken = 0  # forward passes whose hooks fired out of pattern (e.g. activation recompute)

    def _store(self, key: Any, out: Any) -> None:
        x = (out[0] if isinstance(out, tuple) else out).detach()
        if key in self._current:
            self.broken += 1
            self._current = {}
        self._current[key] = x
        if len(self._current) == self._expect:
            self._queue.append(self._current)
            self._current = {}

    def attach(self) -> MegatronTap:
        if self._handles:
            return self
        for i, mod in self._points.items():
            self._handles.append(mod.register_forward_hook(lambda _m, _i, out, i=i: self._store(i, out)))
        if self.capture_final:
            self._handles.append(
                self._final_norm.register_forward_hook(lambda _m, _i, out: self._store("final", out))
            )
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._current = {}
        self._queue.clear()

    def pending(self) -> int:
        """Captured forward passes not popped yet."""
        return len(self._queue)

    def pop(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The oldest captured forward: ([s, b, h] per owned index, ascending; final [s, b, h] or None)."""
        if self._expect == 0:
            return [], None  # a stage that owns nothing still takes part (its TapPart carries ids and masks)
        if not self._queue:
            raise TapError("no forward pass captured; is the Tap attached?")
        got = self._queue.popleft()
        return [got[i] for i in self.owned], got.get("final")
