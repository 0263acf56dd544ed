"""``draft: {head: native_mtp, mtp_impl: megatron}`` end to end, in-process, on a tiny MiMo checkpoint: the
warm-start builds the head as megatron-core's own MTP layer from the checkpoint's MTP tensors (in a process that
initialised megatron's model-parallel state, TP = PP = 1: the one-rank world of tests/tap/test_megatron.py),
trains it and publishes it under MiMo's names, a folder the transformers-built head loads; without that state it
stops in one line."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from benchmarks.common.mtp_checkpoints import mtp_names, save_checkpoint
from draft_align.config import load_recipe
from draft_align.heads.native_mtp import NativeMTPConfig, from_checkpoint, to_checkpoint
from tests.conftest import make_chat_tokenizer, tiny_overrides
from tests.helpers import run_warmstart

pytest.importorskip("megatron.core")

from tests.tap.test_megatron import megatron_world  # noqa: E402, F401

MEGATRON = {
    "draft.head": "native_mtp",
    "draft.mtp_impl": "megatron",
    "draft.aux_layer_ids": "null",
    "train.objective.autocast_bf16": "false",  # megatron's linear layers refuse autocast's bf16 gradients (config rule)
    "train.objective.ttt_steps": 2,
    "train.max_steps": 4,
    "eval.prompts": 1,
    "eval.max_new_tokens": 4,
    "eval.temperatures": "[0.0]",
}


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo_megatron")
    cfg, tensors = save_checkpoint("mimo", root / "mimo", logit_scale=15.0)
    make_chat_tokenizer().save_pretrained(root / "mimo")
    return root, cfg, tensors


def test_refused_in_one_line_without_megatrons_parallel_state(mimo, tiny_world):
    from draft_align.warmstart.preparation import WarmstartError, native_head

    root, cfg, _ = mimo
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        pytest.skip("another module's megatron world is still up in this process")
    recipe = load_recipe(
        None, tiny_overrides(root / "mimo", tiny_world.data, root / "no", run="no", **MEGATRON)
    )
    with pytest.raises(WarmstartError, match="model-parallel state is not initialised") as e:
        native_head(recipe, cfg)
    assert "\n" not in str(e.value)


@pytest.mark.usefixtures("megatron_world")
def test_warmstart_trains_megatrons_block_and_publishes_mimos_names(mimo, tiny_world):
    from draft_align.publish import load_draft

    root, cfg, tensors = mimo
    recipe = load_recipe(
        None, tiny_overrides(root / "mimo", tiny_world.data, root / "ckpt", run="mg", **MEGATRON)
    )
    summary, _ = run_warmstart(recipe, root / "home")
    folder = recipe.run_dir / "drafts" / "v0001"
    written = safetensors.torch.load_file(str(folder / "model.safetensors"))
    assert set(written) == mtp_names("mimo", tensors) | {"model.embed_tokens.weight", "lm_head.weight"}
    draft, manifest = load_draft(folder)  # the transformers-built head reads the megatron-trained folder
    assert manifest["format"] == "draft_align.native_mtp" and draft.kind == "native_mtp"
    start = to_checkpoint(from_checkpoint(NativeMTPConfig.from_target(cfg), tensors))
    bf = torch.bfloat16  # the publish dtype
    assert torch.equal(written["lm_head.weight"], tensors["lm_head.weight"].to(bf))
    assert not torch.equal(
        written["model.mtp_layers.0.input_proj.weight"], start["model.mtp_layers.0.input_proj.weight"].to(bf)
    )
    assert summary["metrics"]["steps"] == 4
