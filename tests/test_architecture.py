"""The import rules of docs/architecture.md, checked on the source (every import, function-level ones included).

Data flows one way — policy process (tap) → wire → sidecar → train → publish → engine — and monitoring reads.
Each part may import only the parts listed for it in ALLOWED; no module imports another in a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "draft_align"

# part → the parts it may import (besides itself).  "face" modules (CLI, launcher) may import anything.
ALLOWED: dict[str, set[str]] = {
    "conventions": set(),
    "acceptance": {"conventions"},
    "storage": set(),
    "assets": set(),
    "data": {"assets"},
    "config": {"conventions"},
    "heads": {"conventions", "hf"},
    "hf": {"conventions"},
    "wire": {"conventions"},
    "tap": {"conventions", "hf", "wire"},
    "train": {"conventions", "heads", "hf", "storage"},
    "publish": {"conventions", "heads", "hf", "storage"},
    "monitor": {"conventions", "acceptance", "config", "heads", "hf", "train", "wire"},
    "engines": {
        "conventions",
        "acceptance",
        "heads",
        "hf",
        "publish",
        "monitor",
        "wire",
        "assets",
        "storage",
    },
    "rl": {
        "conventions",
        "acceptance",
        "storage",
        "config",
        "assets",
        "data",
        "heads",
        "hf",
        "tap",
        "wire",
        "publish",
        "monitor",
        "engines",
    },
    "sidecar": {
        "conventions",
        "acceptance",
        "config",
        "assets",
        "heads",
        "hf",
        "wire",
        "train",
        "publish",
        "monitor",
    },
    "warmstart": {
        "conventions",
        "acceptance",
        "config",
        "assets",
        "data",
        "heads",
        "hf",
        "tap",
        "train",
        "publish",
        "monitor",
        "storage",
        "engines",
    },
    "push": {"conventions", "acceptance", "config", "wire", "publish", "monitor", "engines"},
    "integrations": {
        "conventions",
        "acceptance",
        "config",
        "data",
        "heads",
        "hf",
        "tap",
        "wire",
        "publish",
        "monitor",
        "engines",
        "rl",
        "sidecar",
        "warmstart",  # TRL's session runs the warm-start when no starting draft is published, as cotrain does
    },
}
FACE = {"cli", "cotrain", "__main__", "__init__"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every draft_align module this file imports (resolved to the deepest module that exists)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "draft_align":
                out.add(name)
    return {_resolve(n) for n in out} - {None, me}  # type: ignore[operator]


def _resolve(name: str) -> str | None:
    parts = name.split(".")
    while parts:
        p = PKG.parent.joinpath(*parts)
        if p.with_suffix(".py").is_file() or (p / "__init__.py").is_file():
            return ".".join(parts)
        parts = parts[:-1]
    return None


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PKG.rglob("*.py"))}


def test_every_part_is_known() -> None:
    parts = {_part(m) for m in _graph()}
    unknown = parts - set(ALLOWED) - FACE
    assert not unknown, (
        f"parts without an import rule (add them to ALLOWED and docs/architecture.md): {unknown}"
    )


def test_imports_follow_the_data_flow() -> None:
    bad = []
    for module, deps in _graph().items():
        part = _part(module)
        if part in FACE:
            continue
        for dep in deps:
            dep_part = _part(dep)
            if dep_part == "__init__" and dep == "draft_align":
                continue
            if dep_part != part and dep_part not in ALLOWED[part]:
                bad.append(f"{module} → {dep}")
    assert not bad, "imports against docs/architecture.md:\n" + "\n".join(sorted(bad))


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            # a package's __init__ re-exporting its own modules is not a cycle of concerns
            if dep == node.rpartition(".")[0]:
                continue
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(" → ".join(c) for c in cycles)


@pytest.mark.parametrize(
    "name", ["acceptance", "tap", "hf", "heads", "wire", "train", "publish", "monitor", "engines"]
)
def test_lower_parts_import_no_loop_or_face(name: str) -> None:
    """The lower parts never reach up into a loop or the CLI (the rule a convenience import usually breaks)."""
    for module, deps in _graph().items():
        if _part(module) != name:
            continue
        up = {d for d in deps if _part(d) in {"sidecar", "warmstart", "rl", "cli", "cotrain", "integrations"}}
        assert not up, f"{module} imports {sorted(up)}"


def _third_party_imports(path: Path) -> set[str]:
    """The top-level names of every non-draft_align module this file imports (function-level ones included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out - {"draft_align"}


def test_ray_is_imported_from_one_place() -> None:
    """Ray is optional (the ``ray`` extra) and never imported at import time: one module imports it, inside a
    function that turns its absence into one line naming the extra (integrations/ray/runtime.py)."""
    home = "draft_align.integrations.ray.runtime"
    users = sorted(_module_name(p) for p in PKG.rglob("*.py") if "ray" in _third_party_imports(p))
    assert users == [home], f"modules importing ray (only {home} may): {users}"
    tree = ast.parse((PKG / "integrations" / "ray" / "runtime.py").read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert not any(
        isinstance(n, ast.Import) and any(a.name.split(".")[0] == "ray" for a in n.names) for n in top
    ), "ray must be imported lazily (inside import_ray), not at module level"
