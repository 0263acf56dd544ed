"""benchmarks/common/results_md.py: one script's RESULTS.md section is replaced, the others kept, sections stay apart."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.common.results_md import replace_section


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


def test_repo_relative_paths_are_relative_to_the_repository_root() -> None:
    from benchmarks.common import arms, results_md

    root = Path(__file__).resolve().parents[1]
    assert results_md.ROOT == root and arms.ROOT == root
    assert results_md.repo_relative(root / "benchmarks" / "RESULTS.md") == "benchmarks/RESULTS.md"
    assert results_md.repo_relative("/elsewhere/x.json") == "/elsewhere/x.json"


def _results_and_makefile() -> tuple[str, str]:
    root = Path(__file__).resolve().parents[1]
    return (root / "benchmarks" / "RESULTS.md").read_text(), (root / "Makefile").read_text()


def _bench_recipes(makefile: str) -> dict[str, list[str]]:
    """``bench-NAME`` of ``BENCH_TARGETS`` (what ``make bench`` runs) → the command lines of its recipe."""
    listed = re.search(r"^BENCH_TARGETS := (.*?)\n(?!\t)", makefile, re.M | re.S)
    assert listed, "Makefile: no BENCH_TARGETS list"
    names = set(listed.group(1).replace("\\", " ").split())
    out: dict[str, list[str]] = {}
    name = None
    for line in makefile.splitlines():
        m = re.match(r"^(bench-[a-z0-9-]+):", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif line.startswith("\t") and name:
            out[name].append(line.strip())
        elif not line.startswith("\t"):
            name = None
    assert names <= set(out), f"Makefile: BENCH_TARGETS without a rule: {sorted(names - set(out))}"
    return {k: v for k, v in out.items() if k in names}


def test_every_results_section_is_indexed_and_every_script_section_has_a_make_target() -> None:
    results, makefile = _results_and_makefile()
    preamble = results.partition("\n## ")[0]
    heads = re.findall(r"^## (.+)$", results, re.M)
    targets = set(_bench_recipes(makefile))
    for head in heads:
        entry = next((ln for ln in preamble.splitlines() if f"[{head}](#" in ln), None)
        assert entry is not None, f"RESULTS.md index lacks {head!r}"
        if "observations" not in head:
            m = re.search(r"`make (bench-[a-z0-9-]+)`", entry)
            assert m and m.group(1) in targets, (
                f"{head!r}: no make target in the index, or not in the Makefile"
            )


def test_make_bench_runs_the_commands_results_md_records() -> None:
    results, makefile = _results_and_makefile()

    def norm(s: str) -> str:
        return " ".join(s.replace('""', "").replace("`", " ").split())

    flat = norm(results)
    recipes = _bench_recipes(makefile)
    assert len(recipes) >= 20
    for target, lines in recipes.items():
        cmds = [ln for ln in lines if ln.startswith("$(PY) benchmarks/")]
        assert cmds, f"{target}: runs no benchmark script"
        for cmd in cmds:
            recorded = norm(cmd.removeprefix("$(PY) "))
            assert recorded in flat, f"{target}: {recorded!r} is not a command RESULTS.md records"


def test_every_bench_target_is_in_the_index_make_help_reads() -> None:
    """`make help` lists the benchmarks by the topics of RESULTS.md's index: each of BENCH_TARGETS must be there."""
    results, makefile = _results_and_makefile()
    preamble = results.partition("\n## ")[0]
    indexed = set(re.findall(r"`make (bench-[a-z0-9-]+)`", preamble))
    missing = sorted(set(_bench_recipes(makefile)) - indexed)
    assert not missing, f"BENCH_TARGETS not in RESULTS.md's index (so not in `make help`): {missing}"
