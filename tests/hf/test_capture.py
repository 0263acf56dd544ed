import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draft_align.heads.vocab import draft_logits
from draft_align.hf.capture import HFTap, TapError
from draft_align.hf.parts import head_rows


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    c = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(c).eval()


@pytest.mark.parametrize("ids", [(2, 3, 4), (0, 1, 6), (1, 5)])
def test_tap_equals_hf_hidden_states(tiny_lm, ids):
    x = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        ref = tiny_lm(x, output_hidden_states=True)
        with HFTap(tiny_lm, ids) as tap:
            out = tiny_lm(x)
            cap = tap.pop()
    expect = torch.cat([ref.hidden_states[i] for i in ids], dim=-1)
    torch.testing.assert_close(cap.aux, expect)
    torch.testing.assert_close(cap.final, ref.hidden_states[-1])
    # restricted logits equal the full logits' columns
    sel = torch.tensor([1, 4, 9, 33])
    torch.testing.assert_close(
        draft_logits(cap.final, head_rows(tiny_lm, sel)), out.logits[..., sel], atol=1e-5, rtol=1e-5
    )


def test_tap_detach_and_errors(tiny_lm):
    tap = HFTap(tiny_lm, (1, 2, 3))
    with pytest.raises(TapError, match="no forward pass"):
        tap.pop()
    with tap:
        tiny_lm(torch.zeros(1, 3, dtype=torch.long))
    assert not tap._handles
    with pytest.raises(TapError, match="distinct"):
        HFTap(tiny_lm, (2, 2, 3))
    with pytest.raises(TapError, match="outside"):
        HFTap(tiny_lm, (1, 2, 7))
