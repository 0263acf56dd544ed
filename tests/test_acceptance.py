import math

import pytest
import torch

from draft_align.acceptance import (
    AcceptanceTally,
    acceptance_length_all_starts,
    acceptance_length_round_walk,
    acceptance_prob,
    draft_probs_on_target,
    length_stderr,
    round_walk_tally,
)

D2T = torch.tensor([0, 2, 3])  # draft ids 0, 1, 2 → target ids 0, 2, 3 (target vocab 4)
P_A, Q_A = [0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.3]  # argmax q → target 2, argmax p = 0
P_B, Q_B = [0.1, 0.1, 0.7, 0.1], [0.2, 0.7, 0.1]  # argmax q → target 2 = argmax p
# T = 0.5 squares then renormalises: p_T = [1, 1, 49, 1]/52, q_T = [4, 49, 1]/54 → target [4, 0, 49, 1]/54

CASES = [
    # (p, q, mode, T, expected α)
    (P_A, Q_A, "greedy", 0.0, 0.0),
    (P_A, Q_A, "greedy", 1.0, 0.0),
    (P_A, Q_A, "greedy_draft", 1.0, 0.2),
    (P_A, Q_A, "greedy_draft", 0.0, 0.0),
    (P_A, Q_A, "probabilistic", 1.0, 0.1 + 0.0 + 0.2 + 0.1),
    (P_A, Q_A, "probabilistic", 0.0, 0.0),
    (P_B, Q_B, "greedy", 0.0, 1.0),
    (P_B, Q_B, "greedy", 0.7, 1.0),
    (P_B, Q_B, "greedy_draft", 1.0, 0.7),
    (P_B, Q_B, "greedy_draft", 0.0, 1.0),
    (P_B, Q_B, "probabilistic", 1.0, 0.1 + 0.0 + 0.7 + 0.1),
    (P_B, Q_B, "probabilistic", 0.0, 1.0),
    (P_B, Q_B, "greedy_draft", 0.5, 49 / 52),
    (P_B, Q_B, "probabilistic", 0.5, 1 / 52 + 49 / 54 + 1 / 54),
]


@pytest.mark.parametrize(("p", "q", "mode", "temp", "expected"), CASES)
def test_acceptance_prob_table(p, q, mode, temp, expected):
    p_logits = torch.tensor([p]).log() + 3.0  # logits up to a constant
    q_logits = torch.tensor([q]).log() - 1.0
    alpha = acceptance_prob(p_logits, q_logits, D2T, mode, temp)
    assert alpha.shape == (1,)
    assert alpha.item() == pytest.approx(expected, abs=1e-6)


def test_acceptance_prob_rows_are_independent():
    p = torch.tensor([P_A, P_B]).log()
    q = torch.tensor([Q_A, Q_B]).log()
    assert acceptance_prob(p, q, D2T, "probabilistic", 1.0).tolist() == pytest.approx([0.4, 0.9], abs=1e-6)
    assert acceptance_prob(p, q, D2T, "greedy", 0.0).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="unknown verify mode"):
        acceptance_prob(p, q, D2T, "typical", 1.0)


def test_draft_probs_on_target():
    out = draft_probs_on_target(torch.tensor([[0.1, 0.6, 0.3]]), D2T, 4)
    assert out[0].tolist() == pytest.approx([0.1, 0.0, 0.6, 0.3])


# S = 10 rows, k = 3, valid iff s + j ≤ S − 2 (the estimator's convention: the last row drafts nothing)
ALPHA_DET = torch.tensor(
    [
        [1, 1, 0],  # round 1: 2 accepted → row 3
        [0, 0, 0],
        [1, 1, 1],
        [0, 1, 1],  # round 2: 0 accepted → row 4
        [1, 1, 1],  # round 3: 3 accepted → row 8
        [1, 0, 1],
        [0, 0, 0],
        [1, 1, 1],  # step 2 invalid
        [1, 1, 1],  # round 4: only step 0 valid → 1 accepted → row 10: end
        [1, 1, 1],  # no valid step
    ],
    dtype=torch.float32,
)
VALID_DET = torch.arange(10).view(-1, 1) + torch.arange(3).view(1, -1) <= 8


def engine_rounds(alpha, valid):
    """Plain round walk of deterministic α: the list of accepted counts per round."""
    s, out = 0, []
    while s < alpha.shape[0] and valid[s, 0]:
        n = 0
        while n < alpha.shape[1] and valid[s, n] and alpha[s, n] == 1:
            n += 1
        out.append(n)
        s += n + 1
    return out


def test_round_walk_deterministic_is_the_engine():
    assert engine_rounds(ALPHA_DET, VALID_DET) == [2, 0, 3, 1]
    tally = round_walk_tally(ALPHA_DET, VALID_DET)
    assert tally.rounds == 4
    assert tally.accepted_per_pos == [3, 2, 1]
    mean, per = acceptance_length_round_walk(ALPHA_DET, VALID_DET)
    assert mean == pytest.approx(1 + 6 / 4)
    assert per.tolist() == pytest.approx([0.75, 0.5, 0.25])


def test_all_starts_deterministic():
    mean, per = acceptance_length_all_starts(ALPHA_DET, VALID_DET)
    # 9 chain starts (row 9 drafts nothing); rows 7 and 8 lose their invalid steps
    assert per.tolist() == pytest.approx([6 / 9, 4 / 9, 2 / 9])
    assert mean == pytest.approx(1 + 12 / 9)


def test_all_starts_averages_products_not_factors():
    alpha = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    mean, per = acceptance_length_all_starts(alpha, torch.ones(2, 2, dtype=torch.bool))
    assert per.tolist() == [0.5, 0.5]  # a product of averages would give r2 = 0.25
    assert mean == 2.0


def test_round_walk_trivial_cases():
    empty = round_walk_tally(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool))
    assert empty.rounds == 0 and math.isnan(empty.mean_length())
    ones = round_walk_tally(torch.ones(7, 2), torch.ones(7, 2, dtype=torch.bool))
    assert ones.rounds == 3  # rows 0, 3, 6 (then row 9 ≥ S)
    assert ones.accepted_per_pos == [3, 3]


def test_round_walk_fractional_matches_monte_carlo():
    g = torch.Generator().manual_seed(0)
    s_rows, k = 14, 3
    alpha = torch.rand(s_rows, k, generator=g)
    valid = torch.arange(s_rows).view(-1, 1) + torch.arange(k).view(1, -1) <= s_rows - 2
    tally = round_walk_tally(alpha, valid)
    runs = 20000
    a = (alpha * valid).tolist()
    u = torch.rand(runs, s_rows, k, generator=g).tolist()
    rounds, acc = [], []
    for r in range(runs):
        s, n_rounds, counts = 0, 0, [0] * k
        while s < s_rows and valid[s, 0]:
            n = 0
            while n < k and u[r][s][n] < a[s][n]:
                n += 1
            n_rounds += 1
            for i in range(n):
                counts[i] += 1
            s += n + 1
        rounds.append(n_rounds)
        acc.append(counts)
    rounds_t, acc_t = torch.tensor(rounds, dtype=torch.float64), torch.tensor(acc, dtype=torch.float64)
    assert abs(tally.rounds - rounds_t.mean().item()) < 4 * rounds_t.std().item() / math.sqrt(runs)
    for i in range(k):
        col = acc_t[:, i]
        assert abs(tally.accepted_per_pos[i] - col.mean().item()) < 4 * col.std().item() / math.sqrt(runs)
    mc_mean = 1 + acc_t.sum().item() / rounds_t.sum().item()
    assert tally.mean_length() == pytest.approx(mc_mean, abs=0.02)


def test_tally_add_merge_dict():
    t = AcceptanceTally.empty(3)
    for n in (0, 3, 1):
        t.add(n)
    assert t.rounds == 3 and t.accepted_per_pos == [2, 1, 1]
    assert t.mean_length() == pytest.approx(1 + 4 / 3)
    with pytest.raises(ValueError):
        t.add(4)
    other = AcceptanceTally(2.0, [1.0, 0.0, 0.0])
    t.merge(other)
    assert t.rounds == 5 and t.accepted_per_pos == [3, 1, 1]
    assert t.per_position() == pytest.approx([0.6, 0.2, 0.2])
    d = t.to_dict()
    assert d["mean_length"] == pytest.approx(2.0) and d["num_accepted"] == 5
    assert AcceptanceTally.from_dict(d) == t
    with pytest.raises(ValueError, match="merge"):
        t.merge(AcceptanceTally.empty(2))


def test_tally_dummy_round_trips():
    t = AcceptanceTally.make_dummy()
    assert t.mean_length() == 2.5 and t.per_position() == [0.75, 0.5, 0.25]
    assert AcceptanceTally.from_dict(t.to_dict()) == t


def test_length_stderr_is_the_standard_error_over_rounds():
    """From r_i and rounds alone: the same number as the accepted counts' own plug-in standard error."""
    gen = torch.Generator().manual_seed(0)
    for k in (1, 3, 5):
        counts = torch.randint(0, k + 1, (40,), generator=gen).tolist()
        t = AcceptanceTally.empty(k)
        for n in counts:
            t.add(n)
        mean = sum(counts) / len(counts)
        sd = math.sqrt(sum((n - mean) ** 2 for n in counts) / len(counts))
        assert length_stderr(t.rounds, t.per_position()) == pytest.approx(sd / math.sqrt(len(counts)))
    every = AcceptanceTally.empty(3)
    for _ in range(10):
        every.add(3)
    assert length_stderr(every.rounds, every.per_position()) == 0.0  # no spread: no noise
    assert math.isnan(length_stderr(1, [1.0, 0.0]))  # one round: no estimate
    assert math.isnan(length_stderr(10, [math.nan]))


def test_estimate_pool_splits_by_position_in_the_response():
    """Row s drafts response token s + 1 first: a draft that is right for the first 40 response tokens and wrong
    after them measures k + 1 in [0, 32), a mix in [32, 64), 1 (nothing accepted) in [64, 128) and [128, ∞)."""
    from draft_align.acceptance import RESPONSE_POSITION_EDGES, EstimatePool

    k, rows = 3, 200
    alpha = torch.zeros(rows, k)
    for s in range(rows):
        for j in range(k):
            alpha[s, j] = 1.0 if s + 1 + j < 40 else 0.0  # draft j of row s is response token s + 1 + j
    valid = torch.ones(rows, k, dtype=torch.bool)
    valid[-k:] = torch.tril(torch.ones(k, k, dtype=torch.bool)).flip(0)  # the last rows run off the end
    pool = EstimatePool(k)
    pool.add(alpha, alpha, valid)
    res = pool.result("greedy", 0.0)["by_response_position"]
    assert [b["from"] for b in res] == list(RESPONSE_POSITION_EDGES) and res[-1]["to"] is None
    first, mid, late, tail = res
    assert first["starts"] == 31 and first["length"] == pytest.approx(k + 1)  # rows 0..30
    assert late["length"] == pytest.approx(1.0) and tail["length"] == pytest.approx(1.0)
    assert late["starts"] == 64 and tail["starts"] == rows - 127
    # [32, 64): rows 31..62; row s accepts min(k, max(0, 39 − s − 1 + 1)) drafts
    expect = [1 + min(k, max(0, 39 - s)) for s in range(31, 63)]
    assert mid["starts"] == 32 and mid["length"] == pytest.approx(sum(expect) / len(expect))
    # a short sequence leaves the later buckets empty: no length, not a zero
    short = EstimatePool(k)
    short.add(alpha[:20], alpha[:20], torch.ones(20, k, dtype=torch.bool))
    assert [b["length"] for b in short.result("greedy", 0.0)["by_response_position"]][1:] == [
        None,
        None,
        None,
    ]
