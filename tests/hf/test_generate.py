import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draft_align.hf.generate import cut_at_eos, generate_responses


@pytest.fixture(scope="module")
def peaked_lm():
    torch.manual_seed(0)
    m = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=40,
        )
    ).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return m


@pytest.mark.parametrize("eos", [{1, 2}, {16, 4}])
def test_batched_greedy_equals_hf_generate(peaked_lm, eos):
    """Left padding, per-row positions and dropping finished rows from the batch change nothing."""
    ps = [torch.randint(3, 40, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 7, 5, 9, 4)]
    out = generate_responses(
        peaked_lm, ps, max_new_tokens=12, temperature=0.0, eos_ids=eos, pad_id=0, batch_size=3, seed=0
    )
    lens = []
    for p, x in zip(ps, out, strict=True):
        ref = peaked_lm.generate(
            p[None], max_new_tokens=12, do_sample=False, eos_token_id=sorted(eos), pad_token_id=0
        )[0, len(p) :]
        ref = cut_at_eos(ref, eos)
        assert x.tolist() == ref.tolist()
        lens.append(len(x))
    if eos == {16, 4}:
        assert min(lens) < 12  # some rows finished early: the compaction path ran


def test_sampling_is_seeded_and_deadline_skips(peaked_lm):
    ps = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    a = generate_responses(
        peaked_lm, ps, max_new_tokens=6, temperature=1.0, eos_ids={1}, pad_id=0, batch_size=2, seed=3
    )
    b = generate_responses(
        peaked_lm, ps, max_new_tokens=6, temperature=1.0, eos_ids={1}, pad_id=0, batch_size=2, seed=3
    )
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    none = generate_responses(
        peaked_lm,
        ps,
        max_new_tokens=6,
        temperature=0.0,
        eos_ids={1},
        pad_id=0,
        batch_size=1,
        seed=0,
        deadline=0.0,
    )
    assert none == [None, None]
