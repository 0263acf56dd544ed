"""LoRA adapters (peft) over a frozen draft head (EAGLE-3 or MTP), merging, and the adapter tensors.

``apply_lora`` freezes every weight of a warm-started draft and injects peft LoRA layers in place (the
module keeps its class, so ``unroll``/``step`` and the trainer work unchanged): W x becomes
W x + (α/r)·B A x with A [r, in], B [out, r], B = 0 at start.  Engines load plain weights, so publishing
merges: W' = W + (α/r)·B A (:func:`merged`).  Adapter-only delta folders are written and read by
``publish/lora_delta.py``; nothing here touches files.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from draft_align.conventions import LORA_TARGETS
from draft_align.heads.draft_head import DraftConfigError

DEFAULT_TARGETS = LORA_TARGETS


class AdapterMismatchError(ValueError):
    """An adapter-only delta that does not belong to the given base draft, or does not rebuild exactly."""


@dataclass(frozen=True)
class LoraSettings:
    """Adapter shape: rank r, scale α/r, the Linear module names (last path component) that get adapters."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.rank < 1:
            raise DraftConfigError(f"LoRA rank {self.rank} must be ≥ 1")
        if self.alpha <= 0:
            raise DraftConfigError(f"LoRA alpha {self.alpha} must be > 0")
        if not self.target_modules:
            raise DraftConfigError("LoRA target_modules is empty")
        if not 0.0 <= self.dropout < 1.0:
            raise DraftConfigError(f"LoRA dropout {self.dropout} must be in [0, 1)")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d


def _lora_layer_type() -> type:
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def is_lora(draft: nn.Module) -> bool:
    """Whether ``draft`` carries injected LoRA layers: peft names their parameters ``….lora_A.….weight``
    (read from the module itself; peft is not imported for a plain draft)."""
    return any(".lora_A." in name for name, _ in draft.named_parameters())


def apply_lora(draft: nn.Module, settings: LoraSettings, seed: int = 0) -> nn.Module:
    """Freeze ``draft`` and inject LoRA adapters into its ``settings.target_modules`` (in place; returned).

    A shared, frozen target head (MTP's ``lm_head``) cannot be adapted.  Raises DraftConfigError when a
    target name matches no Linear of the draft.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if is_lora(draft):
        raise DraftConfigError("the draft already carries LoRA adapters")
    if draft.shares_target_head and "lm_head" in settings.target_modules:
        raise DraftConfigError(
            "an MTP head's lm_head is the target's (shared, frozen): it cannot take an adapter"
        )
    linear_names = {name.rsplit(".", 1)[-1] for name, m in draft.named_modules() if isinstance(m, nn.Linear)}
    unknown = sorted(set(settings.target_modules) - linear_names)
    if unknown:
        raise DraftConfigError(
            f"LoRA target_modules {unknown} match no Linear of the draft (has {sorted(linear_names)})"
        )
    for p in draft.parameters():
        p.requires_grad_(False)
    cfg = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=list(settings.target_modules),
        lora_dropout=settings.dropout,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(cfg, draft)
    for name, p in draft.named_parameters():
        p.requires_grad_("lora_" in name)
    draft.lora_settings = settings  # type: ignore[assignment]  # read back by publish.lora_delta.export_adapter
    return draft


def lora_state_dict(draft: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only: ``<module path>.lora_A.weight`` / ``.lora_B.weight`` (float32, detached)."""
    out = {}
    for name, t in draft.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            out[name.replace(".default.", ".")] = t.detach().to("cpu", torch.float32).contiguous()
    return out


def load_lora_state_dict(draft: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (as :func:`lora_state_dict` names them) into ``draft``; names and shapes must
    match exactly (AdapterMismatchError otherwise)."""
    own = lora_state_dict(draft)
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise AdapterMismatchError(
            f"adapter tensors differ from the draft's: missing {missing}, unexpected {unexpected}"
        )
    params = dict(draft.named_parameters())
    with torch.no_grad():
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise AdapterMismatchError(
                    f"{name} is {list(t.shape)}, the draft's adapter is {list(own[name].shape)}"
                )
            a, b = name.rsplit(".lora_", 1)
            p = params[f"{a}.lora_{b.split('.', 1)[0]}.default.{b.split('.', 1)[1]}"]
            p.copy_(t.to(p.device, p.dtype))


def merged(draft: nn.Module) -> nn.Module:
    """A plain copy of ``draft`` with every adapter merged into its base weight: W' = W + (α/r)·B A.

    The copy has the draft's class and no peft modules; ``draft`` itself is left untouched.
    """
    kind = _lora_layer_type()
    out = copy.deepcopy(draft)
    with torch.no_grad():
        for name, mod in list(out.named_modules()):
            if not isinstance(mod, kind):
                continue
            mod.merge()
            base = mod.get_base_layer()
            parent_name, _, child = name.rpartition(".")
            parent = out.get_submodule(parent_name) if parent_name else out
            setattr(parent, child, base)
    if hasattr(out, "lora_settings"):
        del out.lora_settings
    for p in out.parameters():
        p.requires_grad_(True)
    if out.shares_target_head:
        out.lm_head.weight.requires_grad_(False)
    return out


def strip_adapters(draft: nn.Module) -> None:
    """Replace every LoRA layer of ``draft`` by its (unmerged) base layer, in place."""
    kind = _lora_layer_type()
    for name, mod in list(draft.named_modules()):
        if isinstance(mod, kind):
            parent_name, _, child = name.rpartition(".")
            parent = draft.get_submodule(parent_name) if parent_name else draft
            setattr(parent, child, mod.get_base_layer())
    if hasattr(draft, "lora_settings"):
        del draft.lora_settings


def lora_settings(cfg: Any) -> LoraSettings:
    """LoraSettings from a recipe's ``lora`` section (``config.LoraAdaptConfig``)."""
    return LoraSettings(
        rank=int(cfg.rank),
        alpha=float(cfg.alpha),
        target_modules=tuple(cfg.target_modules),
        dropout=float(cfg.dropout),
    )
