"""Typed recipe schemas.  Recipes are OmegaConf YAML merged onto these structured dataclasses, so a
mistyped or unknown key is an error rather than a silently ignored setting, and a field with a fixed set of
values is typed by a ``StrEnum`` that OmegaConf checks on load (``validate()`` adds the cross-field rules).
Its members are strings: ``recipe.draft.head == "eagle3"`` and ``f"{mode}"`` work as with plain strings.

``draft_align.config`` is the recipe API the loops, the CLI and the examples import (the two schemas, loading and
saving, :class:`RecipeError`); its rooms: ``choices.py`` (the choice fields), ``sections.py`` (one dataclass per
recipe section), ``recipes.py`` (the two schemas and their cross-field rules), ``rules.py`` (the rule helpers,
:class:`RecipeError`), ``recipe_files.py`` (files and overrides), ``reference.py`` (docs/config.md generated from the schemas)."""

from draft_align.config.recipe_files import (
    RESOLVED_RECIPE,
    load_recipe,
    recipe_kind,
    recipe_to_dict,
    save_recipe,
)
from draft_align.config.recipes import SCHEMAS, CotrainRecipe, Recipe, WarmstartRecipe
from draft_align.config.rules import RecipeError
from draft_align.config.sections import (
    ObjectiveConfig,
    PolicyLoraConfig,
    RLConfig,
    RLEngineConfig,
    RLGuardConfig,
    RLPolicyConfig,
    RLTaskConfig,
    step_decay,
)

__all__ = [
    "RESOLVED_RECIPE",
    "SCHEMAS",
    "CotrainRecipe",
    "ObjectiveConfig",
    "PolicyLoraConfig",
    "RLConfig",
    "RLEngineConfig",
    "RLGuardConfig",
    "RLPolicyConfig",
    "RLTaskConfig",
    "Recipe",
    "RecipeError",
    "WarmstartRecipe",
    "load_recipe",
    "recipe_kind",
    "recipe_to_dict",
    "save_recipe",
    "step_decay",
]
