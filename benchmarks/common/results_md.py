"""Shared by the benchmark scripts: replace one script's section of benchmarks/RESULTS.md, keep the others."""

from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, head: str, body: str) -> None:
    """Put ``body`` (which starts with the line ``head``) in place of the section under ``head``, or append it."""
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    if head in text:
        before, _, rest = text.partition(head)
        nxt = rest.find("\n## ")
        text = before + (body.rstrip("\n") + "\n\n" + rest[nxt + 1 :] if nxt >= 0 else body)
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text)


ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is benchmarks/common/…)


def repo_relative(path: str | Path) -> str:
    """``path`` relative to the repository when it lies inside it (committed JSON never records this machine's
    absolute paths); other paths are returned unchanged."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
