"""DraftAlign beside a real TRL GRPOTrainer on the tiny target (reference rollouts, sidecar as a child
process): taps reach the sidecar, acceptance lands in TRL's logs (a handful of keys by default, every one with
``logging.trl_metrics: full``), a killed sidecar does not stop TRL, configurations that cannot work fail at
start, and a missing starting draft is warm-started first."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
from transformers import TrainerCallback

from draft_align.config import CotrainRecipe, load_recipe
from draft_align.integrations.trl import DraftAlign, TRLConfigError
from draft_align.integrations.trl.session import BRIEF_METRICS

pytestmark = pytest.mark.usefixtures("one_thread")


def _session(tiny_run, tmp_path, run, **extra):
    recipe = load_recipe(None, tiny_run.cotrain_overrides(tmp_path, run=run, **extra), CotrainRecipe)
    return DraftAlign(recipe, ready_timeout_s=120)


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_trl_run_taps_reports_and_logs_acceptance(tiny_run, tiny_env, tmp_path, make_trainer):
    da = _session(tiny_run, tmp_path, "trl", **{"logging.trl_metrics": "full"})
    trainer = make_trainer(rollout_func=da.rollout_func, max_steps=3)
    cb = da.callback(trainer)
    trainer.add_callback(cb)
    trainer.train()
    assert cb.sidecar_rc == 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for h in logs:  # TRL's own logging, in its own form, plus draft_align's keys
        assert {"loss", "reward", "reward_std", "completions/mean_length"} <= set(h)
        assert (
            h["draft_align/accept_measured_frozen"] >= 1.0 and h["draft_align/accept_measured_adapted"] >= 1.0
        )
        assert h["draft_align/tap_tokens_accepted"] > 0  # the sidecar was up before the first step
        assert h["draft_align/callback_s"] >= 0
    mon = _rows(da.run_dir / "sidecar" / "monitor.jsonl")
    assert [r["step"] for r in mon[:3]] == [0, 1, 2]
    assert all(r["est_records"] > 0 for r in mon[:3])
    assert mon[0]["reward_mean"] == pytest.approx(logs[0]["reward"])
    assert (
        da.run_dir / "latest"
    ).exists()  # the sidecar published a draft (gate tolerance 64 here: every candidate)

    # the stage profile of each TRL step: timed apart, never past the step, other = the rest; in the monitor
    # rows, report.md and advise
    from draft_align.monitor.advise import advise_run
    from draft_align.monitor.advise_text import format_advice
    from draft_align.monitor.report import write_report
    from draft_align.monitor.step_profile import LABELS, OTHER, STAGES, StepProfile

    for r in mon[:3]:
        p = StepProfile.from_metrics(r)
        assert p is not None and p.step_s == r["stage_step_s"] > 0
        assert p.timed_s <= p.step_s and p.timed_s + p.other_s == pytest.approx(p.step_s)
        for stage in ("data", "generation", "train", "draft_refresh", "tap"):
            assert r[f"stage_{stage}_s"] > 0, stage
        assert r["stage_other_s"] < 0.5 * r["stage_step_s"]  # the hooks cover most of TRL's step
        assert r["stage_generation_s"] <= r["rollout_s"]
    for h in logs:
        assert h["draft_align/stage_train_share"] > 0 and h["draft_align/stage_step_s"] > 0
    write_report(da.run_dir)
    report = (da.run_dir / "report.md").read_text()
    assert "## Step profile" in report and all(LABELS[s] in report for s in (*STAGES, OTHER))
    text = format_advice(advise_run(da.run_dir))
    assert f"| {LABELS['train']} |" in text and f"| {LABELS['generation']} |" in text


def test_trl_continues_when_the_sidecar_is_killed(tiny_run, tiny_env, tmp_path, make_trainer, caplog):
    da = _session(tiny_run, tmp_path, "trl-k9")
    trainer = make_trainer(rollout_func=da.rollout_func, max_steps=4)
    trainer.add_callback(da.callback(trainer))

    class Kill(TrainerCallback):
        in_use = None

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                end = time.monotonic() + 30
                while time.monotonic() < end and not (da.run_dir / "latest").exists():
                    time.sleep(0.2)
                os.kill(da.proc.pid, signal.SIGKILL)
                da.proc.wait()
                Kill.in_use = da.drafts.current_version

    trainer.add_callback(Kill())
    with caplog.at_level("ERROR", logger="draft_align.integrations.trl.session"):
        trainer.train()  # no error: TRL's steps 3 and 4 ran without the sidecar
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4
    for h in logs:  # logging.trl_metrics: brief (the default): the handful of keys, no more
        assert {k for k in h if k.startswith("draft_align/")} == {f"draft_align/{k}" for k in BRIEF_METRICS}
    # the death is noticed: TRL's logs say so from the step it happened, and one ERROR line names the exit code
    assert [h["draft_align/sidecar_alive"] for h in logs] == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]  # killed after step 2 was logged
    died = [r.getMessage() for r in caplog.records if "sidecar died" in r.getMessage()]
    assert len(died) == 1 and "exit code -9" in died[0] and "sidecar.log" in died[0], died
    assert da.sidecar_exit == -signal.SIGKILL
    assert da.drafts.current_version >= Kill.in_use and da.drafts.failures == 0
    assert logs[-1]["draft_align/draft_version"] == da.drafts.current_version  # the last draft stays in use
    assert logs[-1]["draft_align/wire_dropped"] > logs[1]["draft_align/wire_dropped"]
    # the StepReports the sidecar got before it died were whole (the brief set is only TRL's log)
    mon = _rows(da.run_dir / "sidecar" / "monitor.jsonl")
    assert any("tap_tokens_accepted" in r and "wire_sent" in r for r in mon)


def test_a_missing_starting_draft_is_warm_started_first(tiny_run, tmp_path, monkeypatch):
    """No draft named and the warm-start recipe's draft not published: a single process runs the warm-start
    (``warmstart.run_in_process``, here a stand-in that publishes the tiny run's draft) and starts from its draft,
    as ``draft-align cotrain`` does; once published it is reused; a multi-process run stops with what to run."""
    from draft_align import warmstart
    from draft_align.config import save_recipe
    from draft_align.publish.versions import resolve_draft_dir
    from draft_align.sidecar.launch import SidecarError

    ws = load_recipe(None, tiny_run.world.overrides(run="ws", out=tmp_path))
    ws_file = save_recipe(ws, tmp_path / "ws.yaml")
    ran = []

    def warm_start(ws):
        ran.append(ws.run_dir)
        shutil.copytree(tiny_run.run_dir, ws.run_dir)

    monkeypatch.setattr(warmstart, "run_in_process", warm_start)
    over = {"draft": "null", "warmstart_recipe": str(ws_file)}
    recipe = load_recipe(None, tiny_run.cotrain_overrides(tmp_path, run="trl-ws", **over), CotrainRecipe)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SidecarError, match="run the warm-start first"):
        DraftAlign(recipe)
    assert ran == []
    monkeypatch.delenv("WORLD_SIZE")
    da = DraftAlign(recipe)
    assert ran == [tmp_path / "ws"] and da.start_draft == resolve_draft_dir(tmp_path / "ws")
    assert DraftAlign(recipe).start_draft == da.start_draft and len(ran) == 1  # published: reused


@pytest.mark.parametrize("case", ["lora_lm_head", "sleep_mode", "temperature", "top_p", "layout"])
def test_configs_that_cannot_work_fail_at_start(
    tiny_run, tiny_env, tmp_path, make_trainer, case, monkeypatch
):
    da = _session(
        tiny_run, tmp_path, "trl-bad", **({"rl.task.temperature": 0.7} if case == "temperature" else {})
    )
    over = {
        "lora_lm_head": {},
        "sleep_mode": {},
        "temperature": {},
        "top_p": dict(top_p=0.9),
        "layout": dict(gradient_accumulation_steps=2, steps_per_generation=3),
    }[case]
    trainer = make_trainer(rollout_func=da.rollout_func, **over)
    if case == "lora_lm_head":  # TRL 1.16 refuses target_modules=["lm_head"] itself; a model adapted before
        from peft import LoraConfig, inject_adapter_in_model

        from draft_align.integrations.trl.tap import policy_model

        inject_adapter_in_model(LoraConfig(r=2, target_modules=["lm_head"]), policy_model(trainer), "other")
    if case == "sleep_mode":  # what TRL would run with use_vllm=True, vllm_enable_sleep_mode=True (GPU)
        monkeypatch.setattr(trainer, "use_vllm", True)
        monkeypatch.setattr(trainer.args, "vllm_enable_sleep_mode", True)
    match = {
        "lora_lm_head": "lm_head is in the policy's LoRA",
        "sleep_mode": "wipes the EAGLE-3 draft",
        "temperature": "rl.task.temperature",
        "top_p": "top_p",
        "layout": "neither divides the other",
    }[case]
    with pytest.raises(TRLConfigError, match=match):
        da.callback(trainer)


def test_rollout_func_without_its_callback_is_a_clear_error(tiny_run, tiny_env, tmp_path, make_trainer):
    da = _session(tiny_run, tmp_path, "trl-nocb")
    trainer = make_trainer(rollout_func=da.rollout_func)
    with pytest.raises(TRLConfigError, match="needs its callback"):
        trainer.train()
