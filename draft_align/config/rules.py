"""The rules a recipe's values must keep beyond their types: the helpers the recipes' ``validate()`` use, and
:class:`RecipeError`, the one error every recipe problem is raised as."""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from typing import Any

from draft_align.config.choices import CHOICE_NAMES, AdaptChoice, choice_type
from draft_align.config.sections import LoraAdaptConfig, SidecarConfig, TrainConfig
from draft_align.conventions import check_loss


class RecipeError(ValueError):
    """A recipe that does not match the schema."""


def check_lora(where: str, adapt: AdaptChoice, lora: LoraAdaptConfig) -> None:
    """The LoRA section's rules, when ``adapt`` is ``lora``."""
    if adapt == "lora":
        if lora.rank < 1 or not lora.alpha > 0 or not lora.target_modules:
            raise RecipeError(f"{where}.lora: rank must be ≥ 1, alpha > 0 and target_modules non-empty")
        if not 0.0 <= lora.dropout < 1.0 or not lora.lr > 0:
            raise RecipeError(f"{where}.lora: dropout must be in [0, 1) and lr > 0")


def check_loss_section(where: str, section: TrainConfig | SidecarConfig) -> None:
    """The objective's rule (conventions.check_loss) on a ``train`` or ``sidecar`` section."""
    try:
        check_loss(section.loss, section.accept_mode, section.soft_ce_weight, section.surrogate_tau)
    except ValueError as e:
        raise RecipeError(f"{where}.{e}") from e


def _get(recipe: Any, dotted: str) -> Any:
    obj = recipe
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_positive(recipe: Any, rules: list[tuple[str, int]]) -> None:
    """RecipeError unless each ``(key, least)`` integer field is ≥ least."""
    for key, least in rules:
        value = _get(recipe, key)
        if value < least:
            raise RecipeError(f"{key} must be ≥ {least}, got {value}")


def check_above_zero(recipe: Any, keys: tuple[str, ...]) -> None:
    """RecipeError unless each float field is > 0 (NaN fails too)."""
    for key in keys:
        value = _get(recipe, key)
        if not value > 0:
            raise RecipeError(f"{key} must be > 0, got {value}")


def check_choices(obj: Any, prefix: str) -> None:
    """RecipeError unless every choice field of the dataclass ``obj`` (and of its sections) holds one of its
    values (loading checks that already; this is for a recipe built in code)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, choice, key = getattr(obj, f.name), choice_type(hints[f.name]), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{key}.")
        elif choice is not None:
            items = (
                [(f"{key}[{i}]", v) for i, v in enumerate(value)]
                if isinstance(value, list)
                else [(key, value)]
            )
            for k, v in items:
                if v is not None and v not in {m.value for m in choice}:  # None: an optional choice unset
                    raise choice_error(k, v, choice)


def choice_error(key: str, value: Any, choice: type[Enum]) -> RecipeError:
    """One line naming the key, the bad value and the allowed ones."""
    return RecipeError(
        f"{key}: unknown {CHOICE_NAMES[choice]} {str(value)!r}; expected one of "
        f"{' | '.join(m.value for m in choice)}"
    )
