"""Warm-start and sidecar with an MTP head (draft.head=llama_block_mtp) and with LoRA adapters (adapt=lora), on the
tiny target: train a few steps, publish, reload; the sidecar ingests, trains, gates and publishes."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from draft_align import warmstart
from draft_align.config import CotrainRecipe, load_recipe
from draft_align.heads.lora import is_lora
from draft_align.heads.mtp import MTPDraft
from draft_align.publish import load_draft
from draft_align.publish.folder import read_manifest
from draft_align.publish.lora_delta import load_adapter
from draft_align.publish.versions import read_latest

pytestmark = pytest.mark.usefixtures("tiny_env")
FAST = {"eval.enabled": "false", "train.max_steps": 4, "train.checkpoint_every": 2}


def test_warmstart_mtp_publishes_a_loadable_mtp_draft(tiny_world, tmp_path):
    over = tiny_world.overrides(
        "mtp", out=tmp_path, **FAST, **{"draft.head": "llama_block_mtp", "draft.mtp_depth": 2}
    )
    over = [o for o in over if not o.startswith(("draft.aux_layer_ids", "draft.draft_vocab_size"))]
    recipe = load_recipe(None, over)
    summary = warmstart.run(recipe)
    out = Path(summary["draft"])
    man = read_manifest(out)
    assert man["format"] == "draft_align.mtp" and man["layout"] == "deepseek_v3"
    assert man["mtp_config"]["depth"] == 2 and summary["metrics"]["aux_layer_ids"] == [6]  # HF index L
    draft, _ = load_draft(out)
    assert isinstance(draft, MTPDraft)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_world.model, dtype=torch.float32)
    # the shared head stayed the target's (bf16 in the file); the block moved away from its init
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight.bfloat16().float())
    fresh = MTPDraft.attach(target, depth=2)
    assert not torch.allclose(draft.layers[0].eh_proj.weight, fresh.layers[0].eh_proj.weight, atol=1e-3)
    rows = [json.loads(x) for x in (recipe.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert any("acc_0" in r for r in rows) and losses and all(math.isfinite(x) for x in losses)
    assert min(losses[-3:]) < losses[0], losses  # the MTP block learned (soft CE on its own data)


def test_warmstart_lora_over_a_published_draft(tiny_run, tmp_path):
    over = tiny_run.world.overrides(
        "lora",
        out=tmp_path,
        **FAST,
        **{
            "draft.adapt": "lora",
            "draft.init_from": str(tiny_run.run_dir),
            "draft.lora.rank": 2,
            "draft.lora.lr": 5e-3,
            "draft.lora.warmup_steps": 1,
        },
    )
    recipe = load_recipe(None, over)
    summary = warmstart.run(recipe)
    out = Path(summary["draft"])
    merged, _ = load_draft(out)
    assert not is_lora(merged)
    base, _ = load_draft(read_latest(tiny_run.run_dir))
    # only adapted Linear weights changed (merged): norms, d2t and the lm_head are the base's
    for k, v in base.engine_state_dict().items():
        same = torch.equal(v, merged.engine_state_dict()[k])
        assert same == (not k.endswith(("_proj.weight",))), k
    delta = recipe.run_dir / "adapters" / out.name
    rebuilt, man = load_adapter(delta, read_latest(tiny_run.run_dir))
    assert man["merged_sha256"] == read_manifest(out)["files"]["model.safetensors"]["sha256"]
    assert (delta / "adapter.safetensors").stat().st_size < (out / "model.safetensors").stat().st_size / 4


# ---------------------------------------------------------------- sidecar
def _publish_mtp_start(tiny_world, root: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draft_align.publish import export_draft
    from draft_align.publish.compat import tokenizer_fingerprint
    from draft_align.publish.versions import version_dir, write_latest

    target = AutoModelForCausalLM.from_pretrained(tiny_world.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_world.model)
    out = export_draft(
        MTPDraft.attach(target),
        version_dir(root, 1),
        target_config=target.config,
        target_name=str(tiny_world.model),
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint=tokenizer_fingerprint(tok),
    )
    write_latest(root, out)
    return root


def _feed(recipe, sc, n_steps: int) -> None:
    """Two RL steps of the tiny target's own continuations through a real HFPolicyTap and TapSender."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draft_align import data
    from draft_align.hf.generate import generate_responses
    from draft_align.rl.policy import Sequences
    from draft_align.tap.hf import HFPolicyTap
    from draft_align.wire import channel
    from draft_align.wire.messages import StepReport

    model = AutoModelForCausalLM.from_pretrained(recipe.target.model, dtype=torch.float32).eval()
    key = channel.resolve_key(None, recipe.run_dir, create=True)
    sender = channel.TapSender(channel.default_endpoint(recipe.run_dir, "tap"), key, send_timeout_s=0.5)
    tap = HFPolicyTap(model, sc.aux_ids, sender, run_id=recipe.run, tokens_per_step=2000)
    tok = AutoTokenizer.from_pretrained(recipe.target.model)
    prompts = [data.encode_prompt(tok, c) for c in data.load_conversations(recipe.data.source)]
    try:
        for step in range(n_steps):
            tap.head_sync(step, sc.frozen.draft_to_target)
            ps = prompts[step * 8 : step * 8 + 8]
            resp = generate_responses(
                model, ps, max_new_tokens=24, temperature=1.0, eos_ids={2}, pad_id=2, batch_size=8, seed=step
            )
            seqs = Sequences.pack(
                [(p, r) for p, r in zip(ps, resp, strict=True) if r is not None and r.numel()], pad_id=2
            )
            with torch.no_grad(), tap.capturing():
                logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
                tap.submit(
                    input_ids=seqs.input_ids,
                    attention_mask=seqs.attention_mask,
                    loss_mask=seqs.loss_mask,
                    logits=logits,
                    policy_version=step,
                    step=step,
                    temperature=1.0,
                )
            tap.end_step()
            sender.offer(StepReport(run_id=recipe.run, step=step, policy_version=step, metrics={}))
        end = time.monotonic() + 20
        while sc.state.monitor_rows < n_steps and time.monotonic() < end:
            sc.drain(0.1, 100)
    finally:
        sender.close()


@pytest.mark.parametrize("variant", ["mtp", "lora", "mtp_lora"])
def test_sidecar_trains_and_publishes(tiny_run, tmp_path, variant):
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar

    extra: dict = {}
    if "mtp" in variant:
        extra["draft"] = str(_publish_mtp_start(tiny_run.world, tmp_path / "mtp_start"))
    if "lora" in variant:
        extra.update(
            {
                "sidecar.train.adapt": "lora",
                "sidecar.train.lora.rank": 2,
                "sidecar.train.lora.lr": 5e-3,
                "sidecar.train.lora.publish_delta": "true",
            }
        )
    recipe = load_recipe(None, tiny_run.cotrain_overrides(tmp_path, **extra), CotrainRecipe)
    sc = Sidecar(recipe, starting_draft(recipe)).setup()
    try:
        if "mtp" in variant:
            assert isinstance(sc.trainer.draft, MTPDraft) and sc.aux_ids == (6,)
            assert sc.trainer.loss_settings.step_decay == 0.6
        assert is_lora(sc.trainer.draft) == ("lora" in variant)
        _feed(recipe, sc, 2)
        assert sc.has_head and sc.state.monitor_rows == 2 and sc.state.mismatched_messages == 0
        head0 = sc.trainer.draft.lm_head.weight.clone()
        for _ in range(3):
            assert sc.train_one()
        if "mtp" in variant:  # the shared head follows HeadSync, never the optimizer
            assert torch.equal(sc.trainer.draft.lm_head.weight, head0)
        assert sc.maybe_publish(force=True)
        v1 = recipe.run_dir / "drafts" / "v0001"
        pub, man = load_draft(v1)
        assert type(pub) is type(sc.gate.published) and not is_lora(pub)
        assert man["format"] == ("draft_align.mtp" if "mtp" in variant else "draft_align.eagle3")
        if "lora" in variant:
            delta = recipe.run_dir / "adapters" / "v0001"
            _, dman = load_adapter(delta, Path(sc.state.lora_base_dir))
            assert dman["merged_sha256"] == man["files"]["model.safetensors"]["sha256"]
    finally:
        sc.close()


def test_cotrain_serves_an_mtp_draft_with_the_reference_decoder(tiny_run, tmp_path):
    from draft_align.engines.rollout_types import DraftVersion
    from draft_align.engines.vllm.start import vllm_available
    from draft_align.rl.build import start_rollout_engine

    start = DraftVersion.read(_publish_mtp_start(tiny_run.world, tmp_path / "mtp_start"))
    if not vllm_available():
        pytest.skip("vLLM is not installed: auto picks the reference decoder anyway")

    def engine(kind: str):
        r = load_recipe(None, tiny_run.cotrain_overrides(tmp_path, **{"rl.engine.kind": kind}), CotrainRecipe)
        return start_rollout_engine(
            r.rl.engine,
            r.rl.guard,
            r.target,
            start,
            [],
            run_dir=r.run_dir,
            seed=r.seed,
            key_file=r.wire.key_file,
            push=r.push,
        )

    assert engine("auto") is None
    with pytest.raises(ValueError, match=r"MTP draft needs rl\.engine\.kind=reference"):
        engine("vllm")
