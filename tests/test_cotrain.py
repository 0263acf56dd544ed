"""draft_align.cotrain end to end on the tiny target: GRPO job in-process, sidecar as a child process over
ZeroMQ, monitoring rows, the report; and the RL job's steps when the sidecar dies mid-run."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import time

import pytest

from draft_align.config import CotrainRecipe, load_recipe


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _printed_table(text: str) -> dict[int, dict[str, str]]:
    """The live table cotrain printed: step → {column title: cell} (cells right-aligned to the titles)."""
    from draft_align.monitor.live import COLUMNS, HEADER

    lines = text.splitlines()
    assert lines[0] == HEADER
    rows = {}
    for line in lines[1:]:
        cells, pos = {}, 0
        for c in COLUMNS:
            cells[c.title] = line[pos : pos + c.width].strip()
            pos += c.width + 1
        rows[int(cells["step"])] = cells
    return rows


SIDECAR_COLUMNS = ("est.ad", "est.fr", "buf", "drops", "rej", "train tok/s")


def _report_table(path) -> dict[int, dict[str, str]]:
    """report.md's step table: step → {column title: cell}."""
    steps = path.read_text().split("## Steps")[1].split("\n## ")[0]  # later sections (advice) have tables too
    lines = [x for x in steps.splitlines() if x.startswith("|")]
    titles = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(titles, (c.strip() for c in x.strip("|").split("|")), strict=True)) for x in lines[2:]]
    return {int(r["step"]): r for r in rows}


def test_cotrain_runs_rl_with_a_live_sidecar_and_reports(tiny_run, tiny_env, tmp_path):
    from draft_align.cotrain import run_cotrain

    recipe = load_recipe(
        None, tiny_run.cotrain_overrides(tmp_path, run="e2e", **{"rl.steps": 3}), CotrainRecipe
    )
    out = io.StringIO()
    summary = run_cotrain(recipe, out=out, sidecar_exit_timeout_s=120)
    assert summary["sidecar_rc"] == 0
    table = out.getvalue().splitlines()
    assert len(table) == 1 + 3 and table[0].split()[0] == "step"
    run = recipe.run_dir
    steps = _rows(run / "rl" / "steps.jsonl")
    assert [int(r["step"]) for r in steps] == [0, 1, 2]
    assert [int(r["policy_version"]) for r in steps] == [1, 2, 3]
    assert steps[-1]["kl_to_initial"] > 0
    assert all(r["tap_tokens_accepted"] > 0 for r in steps)  # the sidecar was up before the first step
    # the sidecar merged each step's report with its own estimates of both drafts on that step's taps
    mon = _rows(run / "sidecar" / "monitor.jsonl")
    assert [r["step"] for r in mon] == [0, 1, 2]
    table = _report_table(run / "report.md")
    assert sorted(table) == [0, 1, 2]
    for r in mon:
        step = next(s for s in steps if s["step"] == r["step"])
        assert r["est_records"] > 0
        assert math.isfinite(r["accept_est_adapted"]) and math.isfinite(r["accept_est_frozen"])
        if (
            r["sidecar_draft_version"] == 0
        ):  # nothing published yet: the sidecar's adapted draft is the frozen one
            assert r["accept_est_adapted"] == r["accept_est_frozen"]
        for key in ("accept_measured_adapted", "accept_measured_frozen", "draft_version", "reward_mean"):
            assert r[key] == step[key], key
        # report.md shows exactly these values
        cells = table[r["step"]]
        assert cells["est.ad"] == f"{r['accept_est_adapted']:.3f}"
        assert cells["est.fr"] == f"{r['accept_est_frozen']:.3f}"
        assert cells["acc.ad"] == f"{step['accept_measured_adapted']:.3f}"
        assert cells["acc.fr"] == f"{step['accept_measured_frozen']:.3f}"
        assert cells["drf.v"] == str(int(step["draft_version"]))
    # the live table printed while it ran holds the sidecar's columns too: the same cells as report.md
    printed = _printed_table(out.getvalue())
    assert sorted(printed) == [0, 1, 2]
    for step, cells in printed.items():
        for title in ("step", "pol.v", "drf.v", "acc.ad", "acc.fr", "reward", *SIDECAR_COLUMNS):
            assert cells[title] == table[step][title].replace("–", "-"), (step, title)
        for title in ("est.ad", "est.fr", "buf", "drops", "rej"):
            assert cells[title] != "-", (step, title, cells)
    assert cells["train tok/s"] != "-"  # the sidecar had trained by the last step
    assert [printed[r["step"]]["drops"] for r in steps] == [str(int(r["wire_dropped"])) for r in steps]
    assert (run / "report.png").stat().st_size > 10_000
    assert summary["report"]["steps"] == 3
    # the sidecar's per-position estimates (sidecar.gate.k = 2) and advise's section at the end of report.md
    assert all(0 <= r["accept_est_r1_adapted"] <= r["accept_est_r0_adapted"] <= 1 for r in mon)
    advice = (run / "report.md").read_text().split("## Speculative decoding: profile, projection, advice")[1]
    assert "### Stage profile of the RL step (measured" in advice and "### Advice" in advice
    # every policy version is saved (adapters) and the final one merged
    assert sorted(p.name for p in (run / "policy").iterdir()) == ["v0001", "v0002", "v0003"]
    assert (run / "policy_merged" / "v0003" / "config.json").is_file()
    # the sidecar published at least its final gated draft, complete and verified
    from draft_align.publish.folder import read_manifest
    from draft_align.publish.versions import read_latest

    latest = read_latest(run)
    assert latest is not None
    manifest = read_manifest(latest, verify=True)
    published = _rows(run / "sidecar" / "publish.jsonl")
    assert published and manifest["draft_version"] == published[-1]["draft_version"] >= 1
    # a step served by a published draft names one the sidecar published
    assert {int(s["draft_version"]) for s in steps} <= {0} | {int(p["draft_version"]) for p in published}
    # a second run starts from the initial policy again; the first one's folder is kept aside, not mixed in
    again = load_recipe(
        None, tiny_run.cotrain_overrides(tmp_path, run="e2e", **{"rl.steps": 1}), CotrainRecipe
    )
    assert run_cotrain(again, out=io.StringIO(), sidecar_exit_timeout_s=120)["sidecar_rc"] == 0
    assert len(_rows(run / "rl" / "steps.jsonl")) == 1
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("e2e.")]
    assert len(aside) == 1 and len(_rows(aside[0] / "rl" / "steps.jsonl")) == 3


def test_rl_steps_continue_when_the_sidecar_is_killed(tiny_run, tiny_env, tmp_path):
    """kill -9 of the sidecar between steps: the next steps run with no error, the last published draft
    stays in use, and the tap's sends are counted as dropped instead of blocking."""
    from draft_align.cotrain import (
        build_job,
        spawn_sidecar,
        starting_draft,
        stop_sidecar,
        wait_ready,
        write_resolved,
    )
    from draft_align.engines.rollout_types import DraftVersion
    from draft_align.publish.versions import read_latest
    from draft_align.wire import channel

    recipe = load_recipe(
        None,
        tiny_run.cotrain_overrides(
            tmp_path,
            run="k9",
            # the silent-zero guard may roll a random tiny draft back (tested elsewhere): this test is the kill
            **{"rl.steps": 4, "rl.guard.kind": "none"},
        ),
        CotrainRecipe,
    )
    start = starting_draft(recipe)
    proc = spawn_sidecar(write_resolved(recipe), start, recipe.run_dir / "sidecar.log")
    key = channel.resolve_key(None, recipe.run_dir, create=True)
    sender = channel.TapSender(channel.default_endpoint(recipe.run_dir, "tap"), key)
    try:
        job = build_job(recipe, start, sender, sender)
        assert wait_ready(proc, recipe.run_dir, 120)
        before = [job.step() for _ in range(2)]
        # give the sidecar a moment to publish, then kill it hard
        end = time.monotonic() + 30
        while time.monotonic() < end and not (recipe.run_dir / "latest").exists():
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        in_use = job.drafts.current_version
        newest = read_latest(recipe.run_dir)
        newest_version = DraftVersion.read(newest).version if newest is not None else 0
        end = time.monotonic() + 60  # the verifier thread may still be hashing the last publish
        while time.monotonic() < end and job.drafts.verified_version < newest_version:
            time.sleep(0.1)
        after = [job.step() for _ in range(2)]
        assert [int(m["step"]) for m in after] == [2, 3]
        assert job.drafts.current_version >= in_use and job.drafts.failures == 0
        # the last published draft stays in use: every step after the kill serves it
        assert [m["draft_version"] for m in after] == [newest_version] * 2
        assert after[-1]["wire_dropped_peer"] > before[-1].get("wire_dropped_peer", 0)
    finally:
        sender.close()
        if proc.poll() is None:
            stop_sidecar(proc, 1)


@pytest.mark.parametrize(
    "bad", ["rl.task.group_size=1", "rl.engine.frozen_fraction=1.5", "sidecar.buffer.max_replay_ratio=0"]
)
def test_bad_cotrain_settings_fail_early(bad):
    from draft_align.config import RecipeError

    with pytest.raises(RecipeError):
        load_recipe(None, [bad], CotrainRecipe)
