"""``benchmarks/common/mtp_checkpoints.llama_as_mimo``: a Llama checkpoint (tied or untied head) as a MiMo one
computes the same logits, carries one MTP layer under MiMo's names, and the native MTP head loads from it."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from benchmarks.common.mtp_checkpoints import llama_as_mimo
from draft_align.publish.native_mtp_format import from_target_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("tied", [True, False])
def test_llama_as_mimo_is_the_same_function_with_an_mtp_layer(tmp_path, tied):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "llama")
    out = llama_as_mimo(tmp_path / "llama", tmp_path / "mimo")
    assert json.loads((tmp_path / "mimo" / "config.json").read_text())["architectures"] == ["MiMoForCausalLM"]
    assert out.num_nextn_predict_layers == 1 and not out.tie_word_embeddings
    ids = torch.randint(0, 96, (2, 11))
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "mimo", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(b(ids).logits, a(ids).logits, rtol=0, atol=1e-5)
    written = safetensors.torch.load_file(str(tmp_path / "mimo" / "model.safetensors"))
    mtp = {k for k in written if k.startswith("model.mtp_layers.0.")}
    assert {"model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.self_attn.q_proj.bias"} <= mtp
    assert torch.equal(written["lm_head.weight"], a.lm_head.weight.detach())
    head = from_target_checkpoint(tmp_path / "mimo", AutoConfig.from_pretrained(tmp_path / "mimo"))
    assert head.cfg.spec.name == "mimo" and head.cfg.depth == 1
