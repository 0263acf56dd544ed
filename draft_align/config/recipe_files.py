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
from draft_align.config.sections import MOVED_KEYS


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


def _schema_key(schema: type, dotted: str) -> tuple[bool, bool]:
    """``(is a key of schema, is a section)`` for the dotted key ``dotted``."""
    hint: Any = schema
    for part in dotted.split("."):
        hints = typing.get_type_hints(hint) if dataclasses.is_dataclass(hint) else {}
        if part not in hints:
            return False, False
        hint = hints[part]
    return True, dataclasses.is_dataclass(hint)


def _moved(schema: type, key: str, plain: bool) -> str | None:
    """``"sidecar.lr moved to sidecar.train.objective.lr"`` for a dotted key that moved (or sits under a key that
    moved: sections.MOVED_KEYS) and is no key of ``schema`` (or names one of its sections but is given a
    ``plain`` value: ``rl.engine: vllm``), when the new key is one of ``schema``'s; else None.  A key valid in
    the schema is never flagged."""
    parts = key.split(".")
    old = next((k for n in range(len(parts), 0, -1) if (k := ".".join(parts[:n])) in MOVED_KEYS), None)
    if old is None:
        return None
    is_key, is_section = _schema_key(schema, key)
    if (is_key and not (is_section and plain)) or not _schema_key(schema, MOVED_KEYS[old])[0]:
        return None
    return f"{key} moved to {MOVED_KEYS[old]}{key[len(old) :]}"


def _moved_in_file(schema: type, node: Any, prefix: str = "") -> list[str]:
    """:func:`_moved`'s line for each moved key of a loaded YAML mapping (``node``: plain dicts), outermost
    first; nothing under a moved key is looked at again."""
    out: list[str] = []
    for k, v in node.items():
        key = f"{prefix}{k}"
        line = _moved(schema, key, plain=not isinstance(v, dict))
        if line is not None:
            out.append(line)
        elif isinstance(v, dict):
            out += _moved_in_file(schema, v, f"{key}.")
    return out


def _refuse_moved(moved: list[str], where: str) -> None:
    """One line naming each moved key's new home, before OmegaConf would call it merely unknown."""
    if moved:
        raise RecipeError(f"{where}: {'; '.join(moved)}")


def _moved_in_overrides(schema: type, overrides: list[str]) -> list[str]:
    """:func:`_moved`'s line for each moved key among ``key=value`` overrides (a value not in braces is plain)."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        line = _moved(schema, key.strip(), plain=not value.strip().startswith("{"))
        if line is not None:
            out.append(line)
    return out


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
            plain = OmegaConf.to_container(raw, resolve=False) if OmegaConf.is_dict(raw) else {}
            _refuse_moved(_moved_in_file(schema, plain), where)
            merged = OmegaConf.merge(merged, raw)
        if overrides:
            where = f"overrides {list(overrides)}"
            _refuse_moved(_moved_in_overrides(schema, list(overrides)), where)
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
