"""Every package's ``__init__`` docstring is its map: each module and subpackage of it is named there (as
``name.py``, ``name/``, ````name```` or a ``:mod:`` reference), so the map a newcomer opens first stays current."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "draft_align"
PACKAGES = sorted(p.parent for p in PKG.rglob("__init__.py"))


def named(name: str, doc: str) -> bool:
    n = re.escape(name)
    forms = (rf"(?<![\w.]){n}\.py\b", rf"(?<![\w.]){n}/", rf"``{n}``", rf"\.{n}`", rf":mod:`{n}`")
    return any(re.search(f, doc) for f in forms)


def members(pkg: Path) -> list[str]:
    mods = [p.stem for p in pkg.glob("*.py") if not p.stem.startswith("__")]
    subs = [p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()]
    return sorted(mods + subs)


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: str(p.relative_to(PKG.parent)))
def test_init_docstring_names_every_module(pkg: Path) -> None:
    doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
    missing = [m for m in members(pkg) if not named(m, doc)]
    assert not missing, f"{pkg.relative_to(PKG.parent)}/__init__.py docstring does not name: {missing}"


def test_named_forms() -> None:
    assert named("loop", "- ``loop.py``: the loop") and named("vllm", "``vllm/``: vLLM")
    assert named("start", ":mod:`.start`: start") and named("gate", ":mod:`~draft_align.sidecar.gate`: g")
    assert named("codec", "(``codec``)")
    assert not named("loop", "the loop runs") and not named("loop", "warmstart_loop.py")
