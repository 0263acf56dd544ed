"""The merged LoRA decoder layers a rollout engine reloads: equal to peft's own merge, the live model left
untouched, a LoRA outside the decoder layers refused."""

import copy

import pytest
import torch

from draft_align.hf.lora_layers import LoraLayoutError, decoder_layer_of, merged_layer_weights
from tests.helpers import drift, lora_policy


def test_decoder_layer_of():
    assert decoder_layer_of("model.layers.7.self_attn.q_proj.weight") == "model.layers.7"
    assert decoder_layer_of("model.layers.12.") == "model.layers.12"
    assert (
        decoder_layer_of("model.embed_tokens.weight") is None and decoder_layer_of("lm_head.weight") is None
    )
    assert decoder_layer_of("model.layers.x.weight") is None


def test_merged_layer_weights_equal_peft_merge(tiny_world):
    policy = lora_policy(tiny_world.model)
    drift(policy, 0.1)
    merged = merged_layer_weights(policy.hf_model)

    reference = copy.deepcopy(policy.peft_model).merge_and_unload().state_dict()
    assert merged and all(name.startswith("model.layers.") for name in merged)
    assert not any("lora_" in n or "base_layer" in n for n in merged)
    n_layers = policy.hf_model.config.num_hidden_layers
    assert {n.split(".")[2] for n in merged} == {str(i) for i in range(n_layers)}
    changed = 0
    for name, t in merged.items():
        assert torch.allclose(t, reference[name], atol=1e-6), name
        base = dict(policy.hf_model.named_parameters()).get(name.replace(".weight", ".base_layer.weight"))
        changed += base is not None and not torch.allclose(base, t)
    assert changed == 3 * n_layers  # q, v, down of every layer moved; the rest is sent unchanged
    # the live model is untouched: the adapter still computes the drifted policy on top of the base weights
    q = policy.hf_model.model.layers[0].self_attn.q_proj
    assert not torch.allclose(q.base_layer.weight, merged["model.layers.0.self_attn.q_proj.weight"])
    half = merged_layer_weights(policy.hf_model, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())


def test_lora_outside_decoder_layers_is_refused(tiny_world):
    policy = lora_policy(tiny_world.model, targets=("q_proj", "lm_head"))
    with pytest.raises(LoraLayoutError, match="outside the decoder layers"):
        merged_layer_weights(policy.hf_model)


def test_policy_layer_weights_full_fine_tuning(tiny_llama):
    """No LoRA: every decoder layer's tensors, as they are; a trainable embedding/lm_head is refused."""
    from draft_align.hf.lora_layers import policy_layer_weights

    model = tiny_llama(2, 40, 32)
    model.requires_grad_(False)
    for p in model.model.layers.parameters():
        p.requires_grad_(True)
    weights = policy_layer_weights(model, torch.bfloat16)
    names = {n for n, _ in model.named_parameters() if n.startswith("model.layers.")}
    assert set(weights) == names and all(t.dtype == torch.bfloat16 for t in weights.values())
    assert torch.equal(
        weights["model.layers.1.mlp.up_proj.weight"],
        model.model.layers[1].mlp.up_proj.weight.to(torch.bfloat16),
    )
    model.lm_head.weight.requires_grad_(True)
    with pytest.raises(LoraLayoutError, match="outside the decoder layers"):
        policy_layer_weights(model)
