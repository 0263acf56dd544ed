"""draft_align.train.losses: soft / hard cross-entropy per TTT step, masks, agreement counts."""

import math

import pytest
import torch

from draft_align.train.losses import hard_ce_step, soft_ce_reference, soft_ce_step, step_weights


def log_softmax_list(xs: list[float]) -> list[float]:
    z = math.log(sum(math.exp(x) for x in xs))
    return [x - z for x in xs]


def soft(q_logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor):
    """soft_ce_step from a target distribution p [..., Vd]: it takes Σ_x p(x) z(x) and argmax p."""
    return soft_ce_step(q_logits, (p * q_logits).sum(-1), p.argmax(-1), mask)


def test_soft_ce_is_minus_sum_p_log_q_by_hand():
    q = [[0.0, 1.0, 2.0], [3.0, 0.5, -1.0]]
    p = [[0.2, 0.3, 0.5], [0.6, 0.4, 0.0]]
    q_logits = torch.tensor([q])  # [1, 2, 3]
    ce, agree, n = soft(q_logits, torch.tensor([p]), torch.tensor([[True, True]]))
    by_hand = []
    for qr, pr in zip(q, p, strict=True):
        by_hand.append(-sum(pi * lq for pi, lq in zip(pr, log_softmax_list(qr), strict=True)))
    assert ce.item() == pytest.approx(sum(by_hand), rel=1e-6)
    ref = soft_ce_reference(q_logits, torch.log(torch.tensor([p])))  # log 0 = -inf is harmless there
    assert ref[0].tolist() == pytest.approx(by_hand, rel=1e-6)
    # argmax q: (2, 0); argmax p: (2, 0) → both agree
    assert agree.item() == 2.0 and n.item() == 2.0


def test_soft_ce_mask_drops_rows_and_counts():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, generator=g)
    p = torch.softmax(torch.randn(2, 3, 5, generator=g), -1)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    ce, agree, n = soft(q, p, mask)
    per = -(p * torch.log_softmax(q, -1)).sum(-1)
    assert ce.item() == pytest.approx(per[mask].sum().item(), rel=1e-5)
    assert n.item() == 3.0
    want_agree = (q.argmax(-1) == p.argmax(-1))[mask].sum().item()
    assert agree.item() == want_agree
    # changing a masked-out row changes nothing
    q2 = q.clone()
    q2[0, 1] = 100.0
    assert soft(q2, p, mask)[0].item() == pytest.approx(ce.item(), rel=1e-6)


def test_soft_equals_hard_for_one_hot_targets():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 6, generator=g)
    tgt = torch.tensor([[0, 5, 2, 2], [1, 3, 4, 0]])
    p = torch.nn.functional.one_hot(tgt, 6).float()
    mask = torch.tensor([[True, True, False, True], [True, False, True, True]])
    s = soft(q, p, mask)
    hard = hard_ce_step(q, tgt, mask)
    for a, b in zip(s, hard, strict=True):
        assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert s[2].item() == 6.0


def test_hard_ce_by_hand_and_out_of_vocab_targets_masked():
    q = torch.tensor([[[1.0, 2.0, 0.0], [0.0, 0.0, 5.0], [2.0, 1.0, 0.0]]])
    ids = torch.tensor([[1, -1, 2]])  # -1: outside the draft vocab, never scored
    ce, agree, n = hard_ce_step(q, ids, torch.ones(1, 3, dtype=torch.bool))
    want = -log_softmax_list([1.0, 2.0, 0.0])[1] - log_softmax_list([2.0, 1.0, 0.0])[2]
    assert ce.item() == pytest.approx(want, rel=1e-6)
    assert n.item() == 2.0
    assert agree.item() == 1.0  # row 0: argmax 1 == 1; row 2: argmax 0 != 2


def test_all_masked_gives_zero_sums():
    q = torch.randn(1, 2, 4)
    ce, agree, n = soft(q, torch.softmax(q, -1), torch.zeros(1, 2, dtype=torch.bool))
    assert ce.item() == 0.0 and agree.item() == 0.0 and n.item() == 0.0


def test_step_weights():
    assert step_weights(4, 0.8) == pytest.approx([1.0, 0.8, 0.64, 0.512])
    assert step_weights(1, 0.5) == [1.0]
