"""Forward-hook capture of what a draft needs from an HF target's own forward pass (the Tap's core).

HF ``hidden_states`` indexing is kept exactly: index 0 is the embedding output, index i (1 ≤ i < L) is
the output of decoder layer i−1 (pre-norm residual stream), index L is the final post-norm state.  The
hooks add no forward pass and keep no other layer's output, so a Tap can sit on an RL job's log-prob
pass; :meth:`HFTap.pop` hands over references (the caller copies them off the hot path if it must).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from draft_align.hf.parts import ModelLayoutError, decoder_parts


class TapError(ModelLayoutError):
    """The target does not have the layers the Tap was asked to capture."""


@dataclass
class TapCapture:
    """One forward pass worth of captured states."""

    aux: torch.Tensor  # [B, T, n_aux·H] aux states, ascending layer order
    final: torch.Tensor | None  # [B, T, H] final post-norm hidden state


class HFTap:
    """Forward hooks on an HF causal LM that capture aux states (HF ``hidden_states`` indices) and the
    final post-norm hidden state.  Use as a context manager or ``attach()``/``detach()``."""

    def __init__(self, model: nn.Module, aux_layer_ids: tuple[int, ...], capture_final: bool = True) -> None:
        embed, layers, norm, _ = decoder_parts(model)
        n_layers = len(layers)
        ids = tuple(int(i) for i in aux_layer_ids)
        if len(set(ids)) != len(ids) or list(ids) != sorted(ids):
            raise TapError(f"aux_layer_ids {ids} must be distinct and ascending")
        if not ids or ids[0] < 0 or ids[-1] > n_layers:
            raise TapError(f"aux_layer_ids {ids} outside hidden_states indices 0..{n_layers} of this target")
        self.aux_layer_ids = ids
        self.capture_final = capture_final
        self._points: dict[int, nn.Module] = {}
        for i in ids:
            self._points[i] = embed if i == 0 else (norm if i == n_layers else layers[i - 1])
        self._norm = norm
        self._handles: list[Any] = []
        self._aux: dict[int, torch.Tensor] = {}
        self._final: torch.Tensor | None = None

    def _hook(self, index: int):
        def fn(_mod: nn.Module, _inp: Any, out: Any) -> None:
            self._aux[index] = (out[0] if isinstance(out, tuple) else out).detach()

        return fn

    def _final_hook(self, _mod: nn.Module, _inp: Any, out: Any) -> None:
        self._final = out.detach()

    def attach(self) -> HFTap:
        if self._handles:
            return self
        for i, mod in self._points.items():
            self._handles.append(mod.register_forward_hook(self._hook(i)))
        if self.capture_final:
            self._handles.append(self._norm.register_forward_hook(self._final_hook))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._aux.clear()
        self._final = None

    def __enter__(self) -> HFTap:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def pop(self) -> TapCapture:
        """The states of the last forward pass; raises TapError if no pass ran since the last pop."""
        missing = [i for i in self.aux_layer_ids if i not in self._aux]
        if missing or (self.capture_final and self._final is None):
            raise TapError(f"no forward pass captured (missing aux {missing}); is the Tap attached?")
        aux = torch.cat([self._aux[i] for i in self.aux_layer_ids], dim=-1)
        cap = TapCapture(aux=aux, final=self._final)
        self._aux = {}
        self._final = None
        return cap
