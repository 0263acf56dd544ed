"""``draft-align advise``: a run folder → stage profile, acceptance, round cost, projection, advice lines.

A run folder built here with hand-computed expectations, the recorded fixture (``fixtures/advise_run``: a real
SmolLM2-135M co-training run on vLLM with its calibration), the report.md section, and bad input as one-line
errors.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from draft_align import cli
from draft_align.config import (
    RESOLVED_RECIPE,
    CotrainRecipe,
    RLConfig,
    RLEngineConfig,
    RLTaskConfig,
    save_recipe,
)
from draft_align.monitor.advise import SECTION_HEAD, AdviseError, advise_run
from draft_align.monitor.advise_text import add_to_report, format_advice
from draft_align.monitor.round_cost import ROUND_COST_FILE, RoundCostError, RoundCostTable, StepTiming

FIXTURE = Path(__file__).parent / "fixtures" / "advise_run"

# every step but the first (warm-up, left out of the profile): the stages sum to step_s = 10
STEP = {
    "step_s": 10.0,
    "rollout_s": 6.5,
    "generate_s_adapted": 3.0,
    "generate_s_frozen": 3.0,
    "draft_swap_s": 0.5,
    "logprob_s": 1.5,
    "tap_s": 0.5,
    "update_s": 1.0,
    "policy_sync_s": 0.4,
    "draft_poll_s": 0.05,
    "draft_offer_s": 0.05,
    "save_s": 0.2,
    "kl_s": 0.3,
    "engine_steps_adapted": 100.0,
    "engine_steps_frozen": 100.0,
}
COUNTERS = {
    "engine_vllm": 1.0,
    "rollouts_adapted": 6,
    "rollouts_frozen": 6,
    "accept_r0_adapted": 0.5,
    "accept_r1_adapted": 0.25,
    "accept_rounds_adapted": 100.0,
    "accept_r0_frozen": 0.4,
    "accept_r1_frozen": 0.16,
    "accept_rounds_frozen": 100.0,
    "accept_est_r0_adapted_prob": 0.6,
    "accept_est_r1_adapted_prob": 0.36,
}
# batch 6: c(1) = 1.6, c(2) = 2.1 → c(k) = 1.1 + 0.5 k; batch 1: c(1) = 1.1, c(2) = 1.2
TIMINGS = (
    StepTiming(6, 0, 0.02, 50),
    StepTiming(6, 1, 0.032, 50),
    StepTiming(6, 2, 0.042, 50),
    StepTiming(1, 0, 0.01, 50),
    StepTiming(1, 1, 0.011, 50),
    StepTiming(1, 2, 0.012, 50),
)


def write_run(run: Path, *, counters: bool = True, cost: bool = True, steps: int = 4) -> Path:
    (run / "rl").mkdir(parents=True)
    rows = []
    for s in range(steps):
        row = {"step": s, "policy_version": s + 1, **STEP, **(COUNTERS if counters else {})}
        if s == 0:
            row["step_s"] = 30.0  # warm-up: not in the profile
        rows.append(row)
    (run / "rl" / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_recipe(
        CotrainRecipe(
            rl=RLConfig(
                engine=RLEngineConfig(spec_k=2, verify_mode="greedy_draft"),
                task=RLTaskConfig(temperature=1.0),
            )
        ),
        run / RESOLVED_RECIPE,
    )
    if cost:
        RoundCostTable(TIMINGS, "test calibration").save(run / ROUND_COST_FILE)
    return run


def test_profile_acceptance_and_projection_hand_computed(tmp_path):
    a = advise_run(write_run(tmp_path / "run"))
    p = a.profile
    assert p.steps == (1, 2, 3) and p.step_s == pytest.approx(10.0)
    got = {s.name: s.seconds for s in p.stages}
    # a log without stage_* keys: the stages derived from its raw timers (its data stage untimed: in other)
    assert got == pytest.approx(
        {
            "data (prompts, rewards, advantages)": 0.0,
            "weight sync (policy → engine)": 0.4,
            "generation": 6.0,
            "log-prob (old, reference, KL probe)": 1.3,
            "train (forward, backward, optimizer)": 1.0,
            "draft refresh (pick-up, load, swaps, guard)": 0.6,
            "Tap": 0.5,
            "checkpoint": 0.2,
            "other (untimed)": 0.0,
        }
    )
    assert a.settings.k == 2 and a.settings.batch_size == 6 and a.settings.engine == "vllm"
    assert a.serving.draft == "adapted" and a.serving.rates == pytest.approx((0.5, 0.25))
    assert a.serving.acceptance_rate == pytest.approx(0.375)
    assert a.run_spec_step_s == pytest.approx(6.0 / 200)
    assert (a.costs.a, a.costs.b) == pytest.approx((1.1, 0.5))
    serving = a.projections[0]
    assert [r.speedup.value for r in serving.rows[:3]] == pytest.approx([1.5 / 1.6, 1.75 / 2.1, 1.875 / 2.6])
    assert serving.best.k == 1
    # T_plain = 3 s · E_adapted(2) / c(2) + 3 s · E_frozen(2) / c(2); Amdahl with the 4 s rest of the step
    plain = 3 * 1.75 / 2.1 + 3 * 1.56 / 2.1
    assert a.plain_generation_s.value == pytest.approx(plain)
    assert serving.step_speedup[1].value == pytest.approx((4 + plain) / (4 + plain / (1.5 / 1.6)))
    # the tap estimate of the other verify mode gets its own projection
    prob = a.projections[1]
    assert prob.series.verify_mode == "probabilistic" and prob.series.source == "estimator on taps"
    assert prob.rows[1].speedup.value == pytest.approx(1.96 / 2.1)
    # batch 1: c(k) = 1 + 0.1 k → k=2: 1.75 / 1.2 = 1.458 is best there
    assert a.other_batches[1].k == 2 and a.other_batches[1].speedup.value == pytest.approx(1.75 / 1.2)


def test_advice_lines_follow_the_rules(tmp_path):
    lines = advise_run(write_run(tmp_path / "run")).lines
    assert any(
        "acceptance rate 38% measured" in x and "below 60%" in x and "larger or in-domain draft" in x
        for x in lines
    )
    assert any("rl.engine.spec_k=2 is beyond the best k=1 at batch size 6" in x for x in lines)
    slower = [x for x in lines if "projected slower than plain decoding at batch size 6" in x]
    assert (
        slower
        and "without a draft" in slower[0]
        and "it pays at batch size 1 (k=2: 1.46× projected)" in slower[0]
    )
    assert any(x.startswith("generation is 60% of the step (measured)") for x in lines)


def test_without_a_calibration_it_projects_tokens_and_says_how_to_measure_the_cost(tmp_path):
    a = advise_run(write_run(tmp_path / "run", cost=False))
    assert a.costs is None and all(r.speedup is None for r in a.projections[0].rows)
    assert a.projections[0].rows[1].tokens_per_round.value == pytest.approx(1.75)
    assert any("--calibrate" in x for x in a.lines)
    assert "Not measured for this run" in format_advice(a)


def _number_cells(text: str) -> list[str]:
    """The numeric cells of the markdown tables (stage profile, acceptance, projections)."""
    cells = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells += [c.strip() for c in line.strip("|").split("|")[1:]]
    return [c for c in cells if re.match(r"^\**-?\d", c)]


def test_every_printed_number_is_labelled(tmp_path):
    text = format_advice(advise_run(write_run(tmp_path / "run")))
    for head in (
        "Stage profile",
        "Acceptance",
        "Round cost",
        "Projection: adapted draft, greedy_draft",
        "Projection: adapted draft, probabilistic",
        "Advice",
    ):
        assert head in text
    cells = _number_cells(text)
    unlabelled = [c for c in cells if not re.search(r"measured|projected|%$", c)]
    # shares (x%) sit beside a labelled seconds cell; the only other bare numbers are the P_i lists of a
    # measured row, whose own row ends in labelled cells
    assert all("," in c for c in unlabelled if not c.endswith("%")), unlabelled
    assert sum("projected" in c for c in cells) >= 7 * 3 and sum("measured" in c for c in cells) >= 8


def test_advise_on_the_recorded_run_prints_the_labelled_table_and_advice(capsys):
    assert (FIXTURE / "rl" / "steps.jsonl").is_file() and (FIXTURE / ROUND_COST_FILE).is_file()
    assert cli.main(["advise", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "### Stage profile of the RL step (measured" in out and "| generation |" in out
    table = out.split("### Projection: adapted draft")[1].split("###")[0]
    rows = [r for r in table.splitlines() if re.match(r"^\| [1-7] \|", r)]
    assert len(rows) == 7 and all("projected" in r for r in rows)
    assert any("measured" in r for r in rows)  # the run's own k: measured tokens per round and round cost
    advice = out.split("### Advice")[1]
    assert "acceptance rate" in advice and "best k=" in advice or "beyond the best k" in advice
    assert re.search(r"- speculative decoding is projected slower|- best k=\d", advice)


def test_report_gets_the_section_once(tmp_path):
    from draft_align.monitor.report import write_report

    run = write_run(tmp_path / "run")
    write_report(run)
    add_to_report(run)
    add_to_report(run)
    text = (run / "report.md").read_text()
    assert text.count(SECTION_HEAD) == 1 and "## Steps" in text and "beyond the best k=1" in text
    bare = write_run(tmp_path / "bare", counters=False)
    write_report(bare)
    add_to_report(bare)
    assert "Not available: " in (bare / "report.md").read_text()


def test_bad_run_folders_are_one_line_errors(tmp_path, caplog):
    with pytest.raises(AdviseError, match="does not exist"):
        advise_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no step log"):
        advise_run(tmp_path / "empty")
    with pytest.raises(AdviseError, match="no engine acceptance counters"):
        advise_run(write_run(tmp_path / "plain", counters=False))
    blank = tmp_path / "blank"
    (blank / "rl").mkdir(parents=True)
    (blank / "rl" / "steps.jsonl").write_text("")
    with pytest.raises(AdviseError, match="holds no step records"):
        advise_run(blank)
    bad_cost = write_run(tmp_path / "badcost")
    (bad_cost / ROUND_COST_FILE).write_text('{"source": "x"}')
    with pytest.raises(RoundCostError, match="missing"):
        advise_run(bad_cost)
    for run, text in (
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "no step log"),
        (tmp_path / "plain", "no engine acceptance counters"),
    ):
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="draft_align"):
            assert cli.main(["advise", str(run)]) == 2
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and text in errors[0].getMessage() and "\n" not in errors[0].getMessage()
        assert not errors[0].exc_info


def test_the_fixture_is_a_copyable_run_folder(tmp_path):
    """The recorded fixture reads the same from anywhere (no absolute paths needed)."""
    dst = tmp_path / "copy"
    shutil.copytree(FIXTURE, dst)
    a, b = advise_run(FIXTURE), advise_run(dst)
    assert a.serving.rates == b.serving.rates and a.lines == b.lines


def test_one_calibrated_k_gives_no_k_advice(tmp_path):
    run = write_run(tmp_path / "run", cost=False)
    RoundCostTable((StepTiming(6, 0, 0.02, 50), StepTiming(6, 2, 0.042, 50)), "one k").save(
        run / ROUND_COST_FILE
    )
    a = advise_run(run)
    assert [r.k for r in a.projections[0].rows if r.speedup is not None] == [2]
    assert any("only k=2 has a measured round cost" in x for x in a.lines)
    assert not any("beyond the best" in x or "a larger k" in x for x in a.lines)
    assert any("projected slower" in x for x in a.lines)


def test_run_settings_of_an_auto_verify_run_read_the_mode_that_served(tmp_path):
    from draft_align.monitor.advise import run_settings

    save_recipe(
        CotrainRecipe(
            rl=RLConfig(
                engine=RLEngineConfig(kind="vllm", verify_mode="auto"), task=RLTaskConfig(temperature=1.0)
            )
        ),
        tmp_path / RESOLVED_RECIPE,
    )
    served = [
        {"engine_vllm": 1.0, "verify_probabilistic": 0.0},
        {"engine_vllm": 1.0, "verify_probabilistic": 1.0},
    ]
    assert run_settings(tmp_path, served, 3).verify_mode == "probabilistic"  # the latest step's
    assert run_settings(tmp_path, served[:1], 3).verify_mode == "greedy_draft"
    assert (
        run_settings(tmp_path, [{"engine_vllm": 1.0}], 3).verify_mode == "auto"
    )  # no step said: left as it is


def test_bad_log_lines_are_skipped_counted_and_reported_once_by_report_advise_and_monitor(
    tmp_path, caplog, capsys
):
    """One line whose step is a 400-digit integer (and other damage: not JSON, a 5,000-digit number, a 1.1 MiB
    line, a negative step) killed report, advise and monitor --once with a traceback; now each skips those
    lines, counts them and says so in one warning, and works on the good ones."""
    run = write_run(tmp_path / "run", steps=6)
    good = (run / "rl" / "steps.jsonl").read_text().splitlines()
    bad = [
        json.dumps({"step": 10**400, "accept_measured_adapted": 2.0}),
        "not json",
        '{"step": 3, "x": ' + "9" * 5000 + "}",
        json.dumps({"step": 2, "pad": "y" * (1 << 20)}),
        json.dumps({"step": -4}),
    ]
    log = good[:2] + bad + good[2:]
    (run / "sidecar").mkdir()
    (run / "sidecar" / "monitor.jsonl").write_text("\n".join(log) + "\n")
    from draft_align.monitor import live

    for argv in (["report", str(run)], ["advise", str(run)], ["monitor", str(run), "--once"]):
        live._SAID.clear()  # each command is its own process: a warning is said once per process
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="draft_align"):
            assert cli.main(argv) == 0, argv
        warned = [r.getMessage() for r in caplog.records if "bad line" in r.getMessage()]
        assert len(warned) == 1 and "skipped 5 bad line(s)" in warned[0], (argv, warned)
        assert "monitor.jsonl:3: step 1000" in warned[0]  # the first one, by line
    rows = capsys.readouterr().out
    assert all(f"\n{s:>6} " in rows for s in range(6))  # monitor --once printed every good step


def test_low_acceptance_advice_gives_the_in_domain_command_and_its_recipe_exists():
    from pathlib import Path

    from draft_align.cotrain import save_prompts
    from draft_align.data import Conversation, Message, load_conversations
    from draft_align.monitor.advise import PROMPTS_FILE, in_domain_command

    line = in_domain_command()
    assert f"data.source=RUN/{PROMPTS_FILE}" in line and "draft-align warmstart" in line
    recipe = line.split("draft-align warmstart ")[1].split()[0]
    assert (Path(__file__).resolve().parents[2] / recipe).is_file()
    # what the command reads: the prompts a co-training run saved, a chat source warmstart loads
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        conv = Conversation((Message("system", "s"), Message("user", "q"), Message("assistant", "a")))
        path = save_prompts(Path(d), [conv])
        (loaded,) = load_conversations(str(path))
        assert [m.role for m in loaded.messages] == ["system", "user"]


def test_advise_recommends_the_measured_cadence(tmp_path):
    """With a cadence table in the run folder the advice names the cadence it chose and why; without one it says
    how to measure it; a broken table is one line, not a crash."""
    from draft_align.monitor.cadence import CADENCE_FILE, CadenceArm, save_table

    dst = tmp_path / "run"
    shutil.copytree(FIXTURE, dst)
    assert any("update cadence not measured" in line for line in advise_run(dst).lines)
    save_table(
        dst,
        [
            CadenceArm("every1", "every step", 0.5, 0.02, 400.0, 420.0, 30),
            CadenceArm("drift", "on drift", 0.47, 0.03, 100.0, 120.0, 8),
            CadenceArm("never", "never", 0.0, None, 0.0, 20.0, 0),
        ],
    )
    a = advise_run(dst)
    assert a.cadence is not None and a.cadence.arm.name == "drift"
    assert any(line.startswith("update cadence drift (measured") for line in a.lines)
    (dst / CADENCE_FILE).write_text("[]")
    assert any("no 'every1' arm" in line for line in advise_run(dst).lines)
