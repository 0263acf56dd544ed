"""``draft.head: native_mtp`` end to end on a tiny MiMo checkpoint (benchmarks/common/mtp_checkpoints.py, with the tiny chat
tokenizer): the warm-start builds the head from the checkpoint's own MTP tensors, trains it and publishes it
under MiMo's names; a sidecar starts from that folder, trains on the Tap's hidden states (full weights, or LoRA
whose merged weights are published under the same names) and publishes a version that loads back.  Bad input
is refused at start in one line."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from benchmarks.common.mtp_checkpoints import mtp_names, save_checkpoint
from draft_align.config import CotrainRecipe, load_recipe
from draft_align.heads.native_mtp import NativeMTPConfig, from_checkpoint, to_checkpoint
from tests.conftest import TinyRun, make_chat_tokenizer, tiny_overrides
from tests.helpers import run_warmstart

NATIVE = {
    "draft.head": "native_mtp",
    "draft.aux_layer_ids": "null",
    "train.objective.ttt_steps": 2,
    "train.max_steps": 4,
    "eval.prompts": 1,
    "eval.max_new_tokens": 4,
    "eval.temperatures": "[0.0]",
}


def _mimo_target(path, **kw):
    cfg, tensors = save_checkpoint("mimo", path, logit_scale=15.0, **kw)
    make_chat_tokenizer().save_pretrained(path)
    return cfg, tensors


@pytest.fixture(scope="module")
def mimo_world(tmp_path_factory, tiny_world):
    """(tiny MiMo folder, its config and tensors, the finished native warm-start's recipe and summary)."""
    root = tmp_path_factory.mktemp("mimo_native")
    cfg, tensors = _mimo_target(root / "mimo")
    recipe = load_recipe(
        None, tiny_overrides(root / "mimo", tiny_world.data, root / "ckpt", run="native", **NATIVE)
    )
    summary, _ = run_warmstart(recipe, _home(root / "mimo"))  # its own caches: never the shared tiny world's
    return root / "mimo", cfg, tensors, recipe, summary


def _home(target):
    """The draft_align home of a tiny MiMo's runs, beside its folder (the shared tiny world's home holds one
    response cache, which tests/warmstart checks)."""
    return target.parent / "home"


def test_warmstart_trains_the_checkpoints_own_layer_and_publishes_it_under_mimos_names(mimo_world):
    from draft_align.publish import load_draft

    target, cfg, tensors, recipe, summary = mimo_world
    folder = recipe.run_dir / "drafts" / "v0001"
    written = safetensors.torch.load_file(str(folder / "model.safetensors"))
    assert set(written) == mtp_names("mimo", tensors) | {"model.embed_tokens.weight", "lm_head.weight"}
    draft, manifest = load_draft(folder)
    assert manifest["format"] == "draft_align.native_mtp" and draft.kind == "native_mtp"
    start = to_checkpoint(from_checkpoint(NativeMTPConfig.from_target(cfg), tensors))
    # it started from the checkpoint's layer (untouched norms of the frozen head stay, trained weights moved)
    bf = torch.bfloat16  # the publish dtype
    assert torch.equal(written["lm_head.weight"], tensors["lm_head.weight"].to(bf))
    assert not torch.equal(
        written["model.mtp_layers.0.input_proj.weight"], start["model.mtp_layers.0.input_proj.weight"].to(bf)
    )
    assert summary["metrics"]["steps"] == 4
    assert summary["eval"] and summary["eval"][0]["acceptance_length_measured"] >= 1.0


@pytest.mark.parametrize("adapt", ["full", "lora"])
def test_sidecar_trains_and_publishes_the_native_head(
    mimo_world, tiny_world, tmp_path, until, adapt, monkeypatch
):
    from draft_align.heads.lora import is_lora
    from draft_align.publish import load_draft
    from draft_align.sidecar.loop import Sidecar
    from tests.sidecar.conftest import Feeder

    target, cfg, tensors, ws, _ = mimo_world
    monkeypatch.setenv("DRAFT_ALIGN_HOME", str(_home(target)))
    start = ws.run_dir / "drafts" / "v0001"
    overrides = TinyRun(tiny_world, None, {}, ws.run_dir, 0.0).cotrain_overrides(
        tmp_path, **{"target.model": str(target), "sidecar.train.adapt": adapt, "sidecar.train.lora.rank": 4}
    )
    recipe = load_recipe(None, overrides, CotrainRecipe)
    sc = Sidecar(recipe, start).setup()
    feeder = Feeder(recipe, sc.frozen.draft_to_target, sc.aux_ids)
    try:
        assert sc.aux_ids == (cfg.num_hidden_layers,)  # the final post-norm hidden
        assert is_lora(sc.trainer.draft) == (adapt == "lora")
        feeder.step(0, 0)
        feeder.step(1, 1)
        assert until(lambda: sc.state.monitor_rows >= 2, 30, every=lambda: sc.drain(0.1, 100))
        assert sc.rejected == {}
        for _ in range(3):
            assert sc.train_one()
        assert sc.maybe_publish(force=True)
    finally:
        feeder.close()
        sc.close()
    v1 = recipe.run_dir / "drafts" / "v0001"
    written = safetensors.torch.load_file(str(v1 / "model.safetensors"))
    # merged weights (LoRA too) under MiMo's own names: what vLLM's MiMoMTP loader reads
    assert set(written) == mtp_names("mimo", tensors) | {"model.embed_tokens.weight", "lm_head.weight"}
    assert not any("lora" in k for k in written)
    before = safetensors.torch.load_file(str(start / "model.safetensors"))
    q = "model.mtp_layers.0.self_attn.q_proj.weight"
    assert not torch.equal(written[q], before[q])  # trained (LoRA: B A merged into the base weight)
    assert torch.equal(written["lm_head.weight"], before["lm_head.weight"])
    back, _ = load_draft(v1)
    assert back.kind == "native_mtp" and not is_lora(back)


def _warmstart_error(tmp_path, tiny_world, target, match, **extra):
    from draft_align.warmstart import WarmstartError

    recipe = load_recipe(
        None, tiny_overrides(target, tiny_world.data, tmp_path / "ckpt", run="bad", **{**NATIVE, **extra})
    )
    with pytest.raises(WarmstartError, match=match) as info:
        run_warmstart(recipe, tmp_path / "home")
    assert "\n" not in str(info.value)
    assert not (recipe.run_dir / "drafts").exists()


def test_bad_targets_are_refused_at_start_in_one_line(tmp_path, tiny_world):
    # a family with no native MTP row (the tiny Llama)
    _warmstart_error(
        tmp_path, tiny_world, tiny_world.model, r"no native MTP family for architecture 'LlamaForCausalLM'"
    )
    # a MiMo checkpoint saved without its MTP tensors
    _mimo_target(tmp_path / "stripped")
    w = safetensors.torch.load_file(str(tmp_path / "stripped" / "model.safetensors"))
    safetensors.torch.save_file(
        {k: v for k, v in w.items() if not k.startswith("model.mtp_layers.")},
        str(tmp_path / "stripped" / "model.safetensors"),
        metadata={"format": "pt"},
    )
    _warmstart_error(tmp_path, tiny_world, tmp_path / "stripped", r"checkpoint has no MTP tensors")
    # MTP tensors whose hidden size is not the config's
    _mimo_target(tmp_path / "wide")
    w = safetensors.torch.load_file(str(tmp_path / "wide" / "model.safetensors"))
    w["model.mtp_layers.0.input_proj.weight"] = torch.zeros(128, 512)
    safetensors.torch.save_file(w, str(tmp_path / "wide" / "model.safetensors"), metadata={"format": "pt"})
    _warmstart_error(
        tmp_path,
        tiny_world,
        tmp_path / "wide",
        r"has shape \(128, 512\), the MiMoForCausalLM config implies \(128, 256\)",
    )


def test_a_native_folder_for_another_target_is_refused(mimo_world, tmp_path):
    """A sidecar (or draft.init_from) checks a native folder against the target: architecture, hidden size,
    vocabulary, depth."""
    from benchmarks.common.mtp_checkpoints import family_config
    from draft_align.publish import checked_manifest
    from draft_align.publish.compat import check_compatible
    from draft_align.publish.folder import ExportError
    from draft_align.publish.tap_spec import read_tap_spec

    _, cfg, _, ws, _ = mimo_world
    manifest = checked_manifest(ws.run_dir / "drafts" / "v0001")
    check_compatible(manifest, cfg, None)
    spec = read_tap_spec(ws.run_dir)  # what the RL job's Tap captures for it: the final hidden, every token
    assert (spec.kind, spec.aux_layer_ids, spec.draft_to_target.numel()) == ("native_mtp", (2,), 256)
    with pytest.raises(ExportError, match="architecture mismatch: the MTP layers are MiMoForCausalLM's"):
        check_compatible(manifest, family_config("glm4_moe"), None)
    other = family_config("mimo")
    other.vocab_size = 512
    with pytest.raises(ExportError, match="vocab size mismatch: MTP layers built for 256, target has 512"):
        check_compatible(manifest, other, None)
