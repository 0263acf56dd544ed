"""benchmarks/results_md.py: one script's RESULTS.md section is replaced, the others kept, sections stay apart."""

from __future__ import annotations

from benchmarks.results_md import replace_section


def test_replace_middle_section_keeps_the_others_and_a_blank_line(tmp_path) -> None:
    p = tmp_path / "RESULTS.md"
    p.write_text("# Benchmark results\n\n## A\n\nold a\n\n## B\n\nb stays\n")
    replace_section(p, "## A", "## A\n\nnew a\n- last line without a blank")
    assert (
        p.read_text()
        == "# Benchmark results\n\n## A\n\nnew a\n- last line without a blank\n\n## B\n\nb stays\n"
    )


def test_replace_last_section_and_append_a_new_one(tmp_path) -> None:
    p = tmp_path / "RESULTS.md"
    p.write_text("# Benchmark results\n\n## A\n\nold a\n")
    replace_section(p, "## A", "## A\n\nnew a\n")
    replace_section(p, "## C", "## C\n\nc\n")
    assert p.read_text() == "# Benchmark results\n\n## A\n\nnew a\n\n## C\n\nc\n"
    replace_section(p, "## C", "## C\n\nc\n")  # re-running a script changes nothing
    assert p.read_text() == "# Benchmark results\n\n## A\n\nnew a\n\n## C\n\nc\n"
