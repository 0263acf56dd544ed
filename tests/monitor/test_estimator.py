import math

import pytest
import torch

from draft_align.acceptance import acceptance_prob, round_walk_tally
from draft_align.engines.reference.specdec import SpecDecoder
from draft_align.hf.capture import HFTap
from draft_align.hf.parts import decoder_parts
from draft_align.monitor.estimator import alpha_table, estimate, observed_alpha_table

PROMPTS = [[5, 17, 33], [1, 9, 40, 22, 7, 63], [12, 0, 31, 31, 8, 50, 2, 19, 44]]


def test_alpha_table_layout(target, draft_good48):
    ids = torch.tensor([3, 9, 27, 5, 11, 40, 2, 8, 60, 1])  # T = 10
    alpha, valid = alpha_table(target, draft_good48, ids, 4, 3, "greedy_draft", 1.0)
    assert alpha.shape == valid.shape == (6, 3)  # starts 3..8
    expect = torch.tensor([[s + 2 + j <= 9 for j in range(3)] for s in range(3, 9)])
    assert torch.equal(valid, expect)
    assert not valid[-1].any()
    # row 0, step 0: the draft at the last prompt token (s = 3) is scored against the target at position 4
    with torch.no_grad(), HFTap(target, draft_good48.cfg.aux_layer_ids, capture_final=False) as tap:
        logits = target(ids[None]).logits[0]
        aux = tap.pop().aux[0]
    embed = decoder_parts(target)[0]
    q0, _ = draft_good48.step(draft_good48.new_cache(), aux[:4], embed(ids[1:5]), torch.arange(4), True)
    ref = acceptance_prob(logits[4:5], q0[-1:], draft_good48.draft_to_target, "greedy_draft", 1.0)
    assert alpha[0, 0].item() == pytest.approx(ref.item(), abs=1e-5)
    # a caller-owned tap gives the same table; a tap on other layers is refused
    with HFTap(target, draft_good48.cfg.aux_layer_ids, capture_final=False) as tap:
        again, _ = alpha_table(target, draft_good48, ids, 4, 3, "greedy_draft", 1.0, tap)
    torch.testing.assert_close(again, alpha)
    with HFTap(target, (1, 2, 3)) as tap, pytest.raises(ValueError, match="tap captures"):
        alpha_table(target, draft_good48, ids, 4, 3, "greedy", 0.0, tap)
    with pytest.raises(ValueError, match="prompt_len"):
        alpha_table(target, draft_good48, ids, 10, 3, "greedy", 0.0)


@pytest.mark.parametrize("draft_name", ["draft_good48", "draft_random48"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_round_walk_equals_measured_at_t0(request, target, draft_name, k):
    """At T = 0 acceptance is deterministic: the round walk of the teacher-forced unroll on the
    target's greedy output must reproduce the KV-cached decoder's counters exactly."""
    draft = request.getfixturevalue(draft_name)
    n = 30
    dec = SpecDecoder(target, draft, k, "greedy", 0.0)
    for prompt in PROMPTS:
        p = torch.tensor(prompt)
        out, measured = dec.generate(p, n)
        longer, _ = dec.generate(p, n + k + 1)  # what the last round drafted past the limit
        assert longer[:n].tolist() == out.tolist()
        ids = torch.cat([p, longer])
        alpha, valid = alpha_table(target, draft, ids, len(prompt), k, "greedy", 0.0)
        walk = round_walk_tally(alpha[: n - 1], valid[: n - 1])  # rounds start at rows 0..n-2
        assert walk.rounds == measured.rounds
        assert walk.accepted_per_pos == measured.accepted_per_pos
        observed, _ = observed_alpha_table(target, draft, ids, len(prompt), k)
        assert torch.equal(observed, alpha)
        # on the cut output itself only the last round can lose accepted drafts
        est = estimate(target, draft, [(p, out)], k, "greedy", 0.0)
        assert est["rounds_est"] == measured.rounds
        lost = measured.num_accepted - sum(est["per_position_est"]) * measured.rounds
        assert -1e-9 < lost <= k
        if draft_name == "draft_good48" and prompt == PROMPTS[1] and k == 3:
            assert measured.mean_length() > 2.0  # not a trivial agreement


@pytest.mark.parametrize("k", [2, 4])
def test_observed_round_walk_equals_measured_greedy_draft_t1(target, draft_good48, k):
    """At T > 0 a greedy-draft engine accepts d iff it emits d, so its counters can be rebuilt from its
    outputs: the observed table's round walk equals the decoder's tally exactly."""
    n = 30
    dec = SpecDecoder(target, draft_good48, k, "greedy_draft", 1.0)
    total = 0.0
    for seed, prompt in enumerate(PROMPTS):
        p = torch.tensor(prompt)
        out, measured = dec.generate(p, n, set(), torch.Generator().manual_seed(seed))
        longer, _ = dec.generate(p, n + k + 1, set(), torch.Generator().manual_seed(seed))
        assert longer[:n].tolist() == out.tolist()  # same draws in the same order
        observed, valid = observed_alpha_table(target, draft_good48, torch.cat([p, longer]), len(prompt), k)
        walk = round_walk_tally(observed[: n - 1], valid[: n - 1])
        assert (walk.rounds, walk.accepted_per_pos) == (measured.rounds, measured.accepted_per_pos)
        total += measured.num_accepted
    assert total > 10


def test_greedy_draft_alpha_is_the_acceptance_probability(target, draft_good48, target_samples):
    """On target samples 1[x == d] − p(d) has mean zero given the past (a martingale difference), so
    Σ 1[x == d] − Σ p(d) over step-0 rows is a sum with variance Σ p(d)(1 − p(d))."""
    seqs = [(row[:4], row[4:]) for row in target_samples]
    hits = expect = var = 0.0
    with HFTap(target, draft_good48.cfg.aux_layer_ids, capture_final=False) as tap:
        for prompt, response in seqs:
            ids = torch.cat([prompt, response])
            alpha, valid = alpha_table(target, draft_good48, ids, 4, 1, "greedy_draft", 1.0, tap)
            obs, _ = observed_alpha_table(target, draft_good48, ids, 4, 1, tap)
            rows = valid[:, 0]
            hits += obs[rows, 0].sum().item()
            expect += alpha[rows, 0].sum().item()
            var += (alpha[rows, 0] * (1 - alpha[rows, 0])).sum().item()
    z = (hits - expect) / math.sqrt(var)
    assert abs(z) < 3.29
    assert 0.2 < expect / (64 * 35) < 0.9


def test_estimate_dict(target, draft_good48, target_samples):
    seqs = [(row[:4], row[4:]) for row in target_samples[:16]] + [
        (torch.tensor([1, 2]), torch.tensor([], dtype=torch.long))
    ]
    res = estimate(target, draft_good48, seqs, 3, "probabilistic", 1.0)
    assert res["num_tokens"] == 16 * 36 and res["num_sequences"] == 17 and res["num_starts"] == 16 * 35
    assert res["acceptance_length_observed"] is None
    r = res["per_position_est"]
    assert 0 < r[2] <= r[1] <= r[0] < 1
    assert res["acceptance_length_est"] == pytest.approx(1 + sum(r))
    assert res["acceptance_length_all_starts"] == pytest.approx(1 + sum(res["per_position_all_starts"]))
    greedy = estimate(target, draft_good48, seqs, 3, "greedy_draft", 1.0)
    assert greedy["acceptance_length_observed"] > 1.0
