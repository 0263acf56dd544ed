"""GRPO objective: table-driven advantages, clipped surrogate, k3 KL and token log-probs."""

import math

import pytest
import torch

from draft_align.rl.loss import GRPOError, clipped_surrogate, group_advantages, k3_kl, token_logprobs


# ---------------------------------------------------------------- math, table-driven
@pytest.mark.parametrize(
    ("rewards", "expected"),
    [
        ([[1.0, 0.0]], [[0.5 / (0.5**0.5 + 1e-4), -0.5 / (0.5**0.5 + 1e-4)]]),  # std with Bessel: √0.5
        ([[0.5, 0.5, 0.5]], [[0.0, 0.0, 0.0]]),  # no signal in a constant group
        (
            [[0.0, 0.0, 3.0], [2.0, 4.0, 6.0]],  # stds √3 and 2
            [
                [-1 / (3**0.5 + 1e-4), -1 / (3**0.5 + 1e-4), 2 / (3**0.5 + 1e-4)],
                [-2 / 2.0001, 0.0, 2 / 2.0001],
            ],
        ),
    ],
)
def test_group_advantages(rewards, expected):
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64))
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_group_advantages_needs_groups_of_two():
    with pytest.raises(GRPOError, match="group_size ≥ 2"):
        group_advantages(torch.ones(3, 1))


@pytest.mark.parametrize(
    ("logp", "old", "adv", "expected"),
    [
        (0.0, 0.0, 1.0, -1.0),  # ratio 1
        (math.log(1.5), 0.0, 1.0, -1.2),  # ratio 1.5 clipped to 1.2 for a positive advantage
        (math.log(1.5), 0.0, -1.0, 1.5),  # ... but not for a negative one (pessimistic bound)
        (math.log(0.5), 0.0, -2.0, 1.6),  # ratio 0.5 clipped to 0.8 for a negative advantage
        (math.log(0.5), 0.0, 2.0, -1.0),  # ... not for a positive one
        (-1.0, -1.0, 0.0, 0.0),
    ],
)
def test_clipped_surrogate_table(logp, old, adv, expected):
    got = clipped_surrogate(torch.tensor([logp]), torch.tensor([old]), torch.tensor([adv]), 0.2)
    assert float(got) == pytest.approx(expected, abs=1e-6)


def test_k3_kl_and_token_logprobs():
    assert torch.equal(k3_kl(torch.tensor([-1.0]), torch.tensor([-1.0])), torch.zeros(1))
    d = torch.tensor([0.3, -0.7])
    torch.testing.assert_close(k3_kl(torch.zeros(2), d), d.exp() - d - 1)
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert float(token_logprobs(logits, torch.tensor([1]), 1.0)) == pytest.approx(math.log(0.75))
    # at T = 2 the logits are halved: p = √3 / (1 + √3)
    assert float(token_logprobs(logits, torch.tensor([1]), 2.0)) == pytest.approx(
        math.log(3**0.5 / (1 + 3**0.5))
    )
