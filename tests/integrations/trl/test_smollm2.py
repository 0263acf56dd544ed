"""examples/trl_grpo.py end to end on SmolLM2-135M (slow, ~3.5 min here): TRL's GRPOTrainer, 4 optimizer steps
on CPU, the callback and the rollout_func on draft_align's vLLM engine, the sidecar as a child process."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch

from draft_align import assets, warmstart
from draft_align.config import load_recipe
from draft_align.engines.vllm.start import vllm_available

REPO = Path(__file__).resolve().parents[3]
pytest.importorskip("trl")


def _example():
    spec = importlib.util.spec_from_file_location("trl_grpo_example", REPO / "examples" / "trl_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_trl_grpo_example_on_smollm2_with_vllm(tmp_path, monkeypatch):
    model = assets.fetch_smollm2()
    with open(assets.fetch_sharegpt(), encoding="utf-8") as f:
        head = list(itertools.islice(f, 100))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(head), encoding="utf-8")
    monkeypatch.setenv("DRAFT_ALIGN_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(REPO)
    # a starting draft in seconds: 6 TTT steps on 8 conversations as they are (no self-distillation)
    ws = load_recipe(
        REPO / "recipes" / "smollm2_demo.yaml",
        [
            f"output_dir={tmp_path / 'ck'}",
            f"target.model={model}",
            "target.dtype=float32",
            f"data.source={chats}",
            "data.max_conversations=8",
            "data.heldout=4",
            "data.regenerate=false",
            "draft.draft_vocab_size=2048",
            "train.max_steps=6",
            "train.objective.ttt_steps=2",
            "train.batch_tokens=1024",
            "train.time_budget_s=null",
            "train.objective.warmup_steps=1",
            "eval.enabled=false",
            "logging.wandb=false",
            "logging.progress_bar=false",
        ],
    )
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = warmstart.run(ws)["draft"]
        out = _example().main(
            [
                "--steps",
                "4",
                "--prompts",
                "16",
                "--output-dir",
                str(tmp_path / "trl"),
                f"output_dir={tmp_path / 'ck'}",
                f"target.model={model}",
                f"draft={start}",
                "rl.engine.kind=vllm",
                "logging.trl_metrics=full",  # every draft_align key in TRL's log (the default is a handful)
                "sidecar.buffer.min_tokens=0",
                "sidecar.publish.min_train_steps=1",
                "sidecar.publish.every_s=0",
                "sidecar.gate.tolerance=64",
                "sidecar.train.objective.ttt_steps=2",
                "sidecar.train.checkpoint_every_s=5",
                # the plumbing is under test (a published draft reaches the engine), not the drafts' quality: a draft
                # trained on four steps of taps may probe worse than the 6-step start, and the probe guard (tested in
                # tests/engines/vllm) would roll it back
                "rl.guard.probe_prompts=0",
            ]
        )
    finally:
        torch.set_num_threads(n_threads)
    logs = [h for h in out["log_history"] if "loss" in h]
    assert len(logs) == 4
    for h in logs:  # TRL's own logging keeps its form; draft_align's keys beside it
        assert {"loss", "reward", "reward_std", "completions/mean_length", "step_time"} <= set(h)
        assert h["draft_align/engine_vllm"] == 1.0
        assert (
            h["draft_align/accept_measured_frozen"] >= 1.0 and h["draft_align/accept_measured_adapted"] >= 1.0
        )
        assert h["draft_align/tap_tokens_accepted"] > 0
    run = Path(out["run_dir"])
    published = [
        json.loads(x) for x in (run / "sidecar" / "publish.jsonl").read_text().splitlines() if x.strip()
    ]
    assert published, "the sidecar published no draft"
    assert max(h["draft_align/draft_version"] for h in logs) >= 1  # the engine served a published draft
    mon = [json.loads(x) for x in (run / "sidecar" / "monitor.jsonl").read_text().splitlines() if x.strip()]
    assert {r["step"] for r in mon} >= {0, 1, 2}
    assert any(
        "draft_align/accept_est_adapted" in h for h in logs
    )  # the sidecar's estimates reached TRL's logs
