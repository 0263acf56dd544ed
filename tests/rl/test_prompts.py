"""RL prompts (chat template, length filter) and the fixed KL sequences of the initial policy."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draft_align import data
from draft_align.rl.loss import GRPOError
from draft_align.rl.policy import Policy
from draft_align.rl.prompts import build_prompts, make_kl_sequences

EOS = {2}


# ---------------------------------------------------------------- prompts and KL sequences
def test_build_prompts_filters_by_length(tiny_world):
    tok = AutoTokenizer.from_pretrained(tiny_world.model)
    convs = data.load_conversations(str(tiny_world.data))
    every = [data.encode_prompt(tok, c) for c in convs[:10]]
    limit = sorted(len(p) for p in every)[5]
    got = build_prompts(tok, convs[:10], n=100, max_prompt_tokens=limit)
    assert [p.tolist() for p in got] == [p.tolist() for p in every if len(p) <= limit]
    assert len(build_prompts(tok, convs, n=3, max_prompt_tokens=500)) == 3
    with pytest.raises(GRPOError, match="must be ≥ 1"):
        build_prompts(tok, convs, n=0, max_prompt_tokens=10)


def test_kl_sequences_come_from_the_initial_policy(tiny_world, tiny_env):
    model = AutoModelForCausalLM.from_pretrained(tiny_world.model, dtype=torch.float32)
    prompts = [torch.tensor([1, 40, 41, 42]), torch.tensor([1, 50])]
    ref = make_kl_sequences(
        Policy(model, lora_r=4, lora_alpha=8, target_modules=["q_proj"]), prompts, 5, EOS, 0
    )
    # greedy continuation of the base model, cut at eos
    base = AutoModelForCausalLM.from_pretrained(tiny_world.model, dtype=torch.float32)
    for row, p in enumerate(prompts):
        want = base.generate(p[None], max_new_tokens=5, do_sample=False, pad_token_id=2)[0]
        n = int(ref.attention_mask[row].sum())
        assert ref.input_ids[row, :n].tolist() == want[:n].tolist()
        assert ref.loss_mask[row].nonzero().flatten().tolist() == list(range(len(p), n))
    policy = Policy(
        AutoModelForCausalLM.from_pretrained(tiny_world.model),
        lora_r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
    )
    for p in policy.trainable_parameters():
        torch.nn.init.normal_(p, std=0.5)  # far from the initial policy
    again = make_kl_sequences(policy, prompts, 5, EOS, 0)
    assert torch.equal(again.input_ids, ref.input_ids)
