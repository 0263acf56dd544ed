"""Shared by the benchmark scripts: replace one script's section of benchmarks/RESULTS.md, keep the others."""

from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, head: str, body: str) -> None:
    """Put ``body`` (which starts with the line ``head``) in place of the section under ``head``, or append it."""
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    if head in text:
        before, _, rest = text.partition(head)
        nxt = rest.find("\n## ")
        text = before + body + (rest[nxt + 1 :] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text)
