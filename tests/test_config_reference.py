"""docs/config.md is generated from the recipe schemas (draft_align/config/reference.py) and kept current."""

from __future__ import annotations

import dataclasses
import typing

from draft_align.config import SCHEMAS
from draft_align.config.reference import DOC, field_comments, main, render


def test_docs_config_md_is_the_generated_reference():
    assert DOC.read_text() == render(), (
        "docs/config.md is out of date with the schemas: run python -m draft_align.config.reference"
    )


def _keys(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def test_every_recipe_key_has_a_row():
    text = render()
    for schema in SCHEMAS.values():
        for key in _keys(schema):
            assert f"| `{key}` |" in text, key


@dataclasses.dataclass
class _Example:
    # above, first line
    # above, second line
    a: int = 1  # after a
    b: float = 2.0
    c: int = 3  # inside the parentheses


def test_field_comments_take_the_lines_above_and_on_the_field():
    assert field_comments(_Example) == {
        "a": "above, first line above, second line after a",
        "b": "",
        "c": "inside the parentheses",
    }


def test_check_mode_fails_on_a_stale_file(tmp_path, capsys):
    out = tmp_path / "config.md"
    assert main(["--check", "--out", str(out)]) == 1  # missing
    assert main(["--out", str(out)]) == 0
    assert main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("| `train.objective.lr` |", "| `train.learning_rate` |"))
    assert main(["--check", "--out", str(out)]) == 1
    assert "out of date" in capsys.readouterr().err


@dataclasses.dataclass
class _Derived(_Example):
    b: float = 3.0  # the derived class's own word
    d: int = 4


def test_field_comments_of_a_derived_schema_keep_the_base_comments():
    assert field_comments(_Derived) == {
        "a": "above, first line above, second line after a",
        "b": "the derived class's own word",
        "c": "inside the parentheses",
        "d": "",
    }
