"""The decoder layers of an HF causal LM that carry peft LoRA modules, merged per tensor (W + scale·B·A).

What a rollout engine reloads to serve the current policy without a restart: every decoder layer that holds
an adapter, whole, under its plain HF checkpoint names.  The embedding and lm_head are never part of it (the
EAGLE-3 draft shares the embedding), so a LoRA on either is refused.
"""

from __future__ import annotations

import torch
from torch import nn

LAYERS_PREFIX = "model.layers."


class LoraLayoutError(ValueError):
    """A LoRA module outside the decoder layers: it cannot be synced by reloading decoder layers."""


def decoder_layer_of(name: str) -> str | None:
    """``model.layers.7.self_attn.q_proj.weight`` → ``model.layers.7``; None outside the decoder layers."""
    if not name.startswith(LAYERS_PREFIX):
        return None
    index = name[len(LAYERS_PREFIX) :].split(".", 1)[0]
    return LAYERS_PREFIX + index if index.isdigit() else None


@torch.no_grad()
def merged_layer_weights(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF checkpoint names → merged tensors of every decoder layer of ``model`` that holds a LoRA module.

    ``model``: the LoRA-injected HF model (a peft model's ``base_model.model``).  A LoRA-wrapped linear
    contributes ``base + Σ_active get_delta_weight(adapter)`` under its plain name (no ``.base_layer``); the
    layer's other tensors are sent as they are, because an engine reloads a layer whole.  The live model is
    not modified.  ``dtype``: the engine's dtype (default: each tensor's own).
    """
    from peft.tuners.lora import LoraLayer

    lora_modules = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    layers = set()
    for name in lora_modules:
        layer = decoder_layer_of(name + ".")
        if layer is None:
            raise LoraLayoutError(
                f"LoRA module {name} lies outside the decoder layers: the engine sync reloads decoder layers only "
                f"(the embedding is shared with the draft); drop it from rl.policy.lora.target_modules"
            )
        layers.add(layer)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if "lora_" in name or decoder_layer_of(name) not in layers:
            continue
        if ".base_layer." in name:
            owner_name = name.split(".base_layer.", 1)[0]
            owner = lora_modules[owner_name]
            value = param.detach().clone()
            if name.endswith(".weight"):
                for adapter in owner.active_adapters:
                    if adapter in owner.lora_A:
                        value += owner.get_delta_weight(adapter).to(value.dtype)
            name = name.replace(".base_layer.", ".")
        else:
            value = param.detach()
        out[name] = value.to(dtype) if dtype is not None else value
    for name, buf in model.named_buffers():
        if decoder_layer_of(name) in layers and not name.endswith("inv_freq"):
            out.setdefault(name, buf.detach())
    return out


def policy_layer_weights(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """What an engine reloads to serve ``model``'s current weights: :func:`merged_layer_weights` when it holds
    LoRA modules; for a fully fine-tuned model (no LoRA), every decoder layer's tensors.

    Full fine-tuning must leave the embedding, the final norm and the lm_head frozen: they are not reloaded
    (the EAGLE-3 draft shares the embedding), so a trainable one raises LoraLayoutError instead of serving a
    policy the engine does not hold.
    """
    from peft.tuners.lora import LoraLayer

    if any(isinstance(m, LoraLayer) for m in model.modules()):
        return merged_layer_weights(model, dtype)
    outside = [n for n, p in model.named_parameters() if p.requires_grad and decoder_layer_of(n) is None]
    if outside:
        raise LoraLayoutError(
            f"full fine-tuning trains {outside[:3]} outside the decoder layers: the engine sync reloads decoder "
            f"layers only; freeze them (requires_grad_(False)) or train a LoRA"
        )
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if decoder_layer_of(name) is not None:
            out[name] = param.detach().to(dtype) if dtype is not None else param.detach()
    for name, buf in model.named_buffers():
        if decoder_layer_of(name) is not None and not name.endswith("inv_freq"):
            out.setdefault(name, buf.detach())
    return out
