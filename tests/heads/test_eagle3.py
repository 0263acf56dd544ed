import pytest
import torch
from torch import nn

from draft_align.heads.draft_head import DraftConfigError
from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.heads.vocab import check_d2t, d2t_t2d, select_vocab


def tiny_cfg(**kw) -> Eagle3Config:
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=50,
        draft_vocab_size=20,
        target_hidden_size=24,
        aux_layer_ids=(1, 2, 3),
        target_num_layers=4,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    base.update(kw)
    return Eagle3Config(**base)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = tiny_cfg(**kw)
    d = Eagle3Draft(cfg)
    for p in d.parameters():
        nn.init.normal_(p, std=0.3)
    d.set_vocab(torch.arange(0, 40, 2))
    emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    return d, emb


def test_weight_names_match_engines():
    d, _ = make()
    names = set(d.engine_state_dict())
    expected = {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }
    assert names == expected
    sd = d.engine_state_dict()
    assert sd["fc.weight"].shape == (32, 72)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (32, 64)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (16, 64)
    assert sd["lm_head.weight"].shape == (20, 32)


def test_aux_ids_must_be_distinct_and_ascending():
    with pytest.raises(DraftConfigError, match="not distinct"):
        tiny_cfg(aux_layer_ids=(2, 3, 3))
    with pytest.raises(DraftConfigError, match="ascending"):
        tiny_cfg(aux_layer_ids=(3, 2, 1))
    with pytest.raises(DraftConfigError, match="outside"):
        tiny_cfg(aux_layer_ids=(1, 2, 9))


def test_vocab_map_semantics():
    sel = torch.tensor([3, 7, 8, 40])
    d2t, t2d = d2t_t2d(sel, 50)
    assert (d2t + torch.arange(4)).tolist() == [3, 7, 8, 40]
    assert t2d.nonzero().flatten().tolist() == [3, 7, 8, 40]
    check_d2t(d2t, t2d)
    with pytest.raises(ValueError, match="distinct"):
        d2t_t2d(torch.tensor([1, 1]), 50)
    bad = t2d.clone()
    bad[0] = True
    with pytest.raises(ValueError, match="t2d"):
        check_d2t(d2t, bad)


def test_select_vocab_fills_deliberately():
    counts = torch.zeros(20)
    counts[[15, 3, 9]] = torch.tensor([5.0, 9.0, 1.0])
    fill = torch.zeros(20)
    fill[[12, 18]] = torch.tensor([0.5, 0.7])
    sel = select_vocab(counts, 7, fill)
    # seen (3, 15, 9), then the fill scores (18, 12), then the lowest ids (0, 1)
    assert sel.tolist() == sorted([3, 15, 9, 18, 12, 0, 1])
    assert select_vocab(counts, 2).tolist() == [3, 15]


@pytest.mark.parametrize("steps", [1, 3])
def test_unroll_matches_kv_cached_chain(steps):
    """Teacher-forced TTT unroll == running the chain step by step with a KV cache (the engine's view)."""
    d, emb = make(seed=1)
    d.eval()
    t = 12
    torch.manual_seed(2)
    ids = torch.randint(0, 50, (1, t))
    aux = torch.randn(1, t, 72)
    starts = torch.tensor([[0, 4, 7]])
    with torch.no_grad():
        out = d.unroll(
            aux,
            emb,
            ids,
            torch.ones(1, t, dtype=torch.bool),
            starts,
            torch.ones(1, 3, dtype=torch.bool),
            steps,
        )
    for m, s in enumerate(starts[0].tolist()):
        cache = d.new_cache()
        pos = torch.arange(s + 1)
        logits, hid = d.step(cache, aux[0, : s + 1], emb(ids[0, 1 : s + 2]), pos, from_target=True)
        torch.testing.assert_close(logits[-1], out[0][0, m], atol=1e-4, rtol=1e-4)
        h = hid[-1:]
        for j in range(1, steps):
            lg, h = d.step(
                cache, h, emb(ids[0, s + 1 + j : s + 2 + j]), torch.tensor([s + j]), from_target=False
            )
            torch.testing.assert_close(lg[0], out[j][0, m], atol=1e-4, rtol=1e-4)


def test_unroll_padding_does_not_leak():
    """A row's outputs do not depend on padding or on other rows of the batch."""
    d, emb = make(seed=3)
    torch.manual_seed(4)
    ids = torch.randint(0, 50, (2, 10))
    aux = torch.randn(2, 10, 72)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 6:] = False
    starts = torch.tensor([[1, 2, 5], [0, 3, 0]])
    sv = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        full = d.unroll(aux, emb, ids, valid, starts, sv, 2)
        aux2 = aux.clone()
        aux2[1, 6:] = 1e3
        alone = d.unroll(aux2[1:, :6], emb, ids[1:, :6], valid[1:, :6], starts[1:, :2], sv[1:, :2], 2)
    for j in range(2):
        torch.testing.assert_close(full[j][1, :2], alone[j][0], atol=1e-4, rtol=1e-4)
        assert torch.isfinite(full[j]).all()
