"""The README stays a front door: at most 8 KiB (everything else lives in docs/)."""

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_is_at_most_8_kib() -> None:
    size = len(README.read_bytes())
    assert size <= 8192, f"README.md is {size} bytes: move detail to docs/ (the limit is 8192)"
