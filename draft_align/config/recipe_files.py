"""Recipe files: schema defaults ← YAML file ← ``key=value`` overrides, merged and validated
(:func:`load_recipe`); a recipe written back as YAML (:func:`save_recipe`) or as plain values."""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any, overload

from draft_align.config.choices import choice_type
from draft_align.config.recipes import KIND_NAMES, SCHEMAS, R, Recipe, WarmstartRecipe
from draft_align.config.rules import RecipeError, choice_error
from draft_align.config.sections import SIDECAR_MOVED


def _recipe_error(schema: type, e: Exception, where: str) -> RecipeError:
    """An OmegaConf error as a RecipeError; for a value outside a field's choices, one line."""
    from omegaconf.errors import ValidationError

    if isinstance(e, ValidationError):
        key = str(e.full_key)
        hint: Any = schema
        for name in re.sub(r"\[\d+\]", "", key).split("."):  # eval.modes[1] → the hint of eval.modes
            hint = typing.get_type_hints(hint).get(name) if dataclasses.is_dataclass(hint) else None
        if (choice := choice_type(hint)) is not None:
            return RecipeError(f"{where}: {choice_error(key, e.value, choice)}")
    return RecipeError(f"{where}: {e}")


def _moved(key: str) -> str | None:
    """``"sidecar.lr moved to sidecar.train.lr"`` for a dotted key under a flat ``sidecar.*`` key that moved
    into a section (sections.SIDECAR_MOVED), else None."""
    section, _, rest = key.partition(".")
    name, _, tail = rest.partition(".")
    if section != "sidecar" or name not in SIDECAR_MOVED:
        return None
    new = f"sidecar.{SIDECAR_MOVED[name]}" + (f".{tail}" if tail else "")
    return f"{key} moved to {new}"


def _refuse_moved(keys: list[str], where: str) -> None:
    """One line naming each moved key's new home, before OmegaConf would call it merely unknown."""
    moved = [m for k in keys if (m := _moved(k)) is not None]
    if moved:
        raise RecipeError(f"{where}: {'; '.join(moved)}")


def _declared_kind(raw: Any) -> str:
    """The ``kind:`` a loaded recipe file declares (``warmstart`` when absent)."""
    return str(raw.get("kind", "warmstart")) if hasattr(raw, "get") else "warmstart"


@overload
def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> WarmstartRecipe: ...
@overload
def load_recipe(path: str | Path | None, overrides: list[str] | None, schema: type[R]) -> R: ...
@overload
def load_recipe(path: str | Path | None, overrides: list[str] | None = None, *, schema: type[R]) -> R: ...
def load_recipe(
    path: str | Path | None, overrides: list[str] | None = None, schema: type[Recipe] = WarmstartRecipe
) -> Recipe:
    """Schema defaults ← YAML file ← ``key=value`` overrides (dotted keys), validated.  Unknown keys, values
    of the wrong type and values outside a field's choices fail with a RecipeError naming where they came
    from (the file or the overrides) and the key."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = OmegaConf.structured(schema)
    # merged one source at a time so an error names where the bad key or value came from
    where = "recipe defaults"
    try:
        if path is not None:
            p = Path(path)
            if not p.exists():
                raise RecipeError(f"recipe {p} does not exist")
            where = f"recipe {p}"
            if p.is_dir():
                raise RecipeError(f"recipe {p} is a directory: expected a YAML file")
            try:
                raw = OmegaConf.load(p)
            except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
                raise RecipeError(f"recipe {p} is not valid YAML: {' '.join(str(e).split())}") from e
            kind, want = _declared_kind(raw), schema.kind
            if kind != want:
                raise RecipeError(
                    f"recipe {p} is a {KIND_NAMES.get(kind, kind)} recipe (kind: {kind}); this command needs a "
                    f"{KIND_NAMES[want]} recipe (kind: {want})"
                )
            sidecar = raw.get("sidecar") if hasattr(raw, "get") else None
            if hasattr(sidecar, "keys"):
                _refuse_moved([f"sidecar.{k}" for k in sidecar.keys()], where)
            merged = OmegaConf.merge(merged, raw)
        if overrides:
            where = f"overrides {list(overrides)}"
            _refuse_moved([o.split("=", 1)[0].strip() for o in overrides], where)
            try:
                dotlist = OmegaConf.from_dotlist(list(overrides))
            except yaml.YAMLError as e:  # e.g. a list past OmegaConf's node limit
                raise RecipeError(
                    f"{where[:200]}: not valid YAML values: {' '.join(str(e).split())[:300]}"
                ) from e
            merged = OmegaConf.merge(merged, dotlist)
        recipe: Recipe = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise _recipe_error(schema, e, where) from e
    recipe.validate()
    return recipe


def recipe_kind(path: str | Path) -> str:
    """The ``kind:`` a recipe file declares (``warmstart`` when absent): the key of its schema in SCHEMAS."""
    from omegaconf import OmegaConf

    kind = _declared_kind(OmegaConf.load(Path(path)))
    if kind not in SCHEMAS:
        raise RecipeError(f"recipe {path}: unknown kind {kind!r}; expected one of {sorted(SCHEMAS)}")
    return kind


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """Every field of ``recipe`` as plain YAML/JSON values (a choice as its string)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(  # type: ignore[return-value]
        OmegaConf.structured(recipe), resolve=True, enum_to_str=True
    )


RESOLVED_RECIPE = (
    "cotrain_recipe.yaml"  # a co-training run folder's resolved recipe: the sidecar and advise read it
)


def save_recipe(recipe: Recipe, path: str | Path) -> Path:
    """Write every field of ``recipe`` as YAML to ``path`` (atomically: a reader never sees half a file);
    :func:`load_recipe` with the same schema reads back an equal recipe.  Returns ``path``."""
    from omegaconf import OmegaConf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(recipe_to_dict(recipe))))
    os.replace(tmp, path)
    return path
