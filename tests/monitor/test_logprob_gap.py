import math

import pytest
import torch

from draft_align.monitor.logprob_gap import logprob_gap


def test_logprob_gap_statistics():
    g = logprob_gap(torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -2.0, -0.25]))
    assert g["engine_logprob_gap_mean"] == pytest.approx((0.5 + 0.0 - 0.25) / 3)
    assert g["engine_logprob_gap_abs_mean"] == pytest.approx(0.75 / 3)
    assert g["engine_logprob_gap_abs_max"] == pytest.approx(0.5)
    assert math.isnan(logprob_gap(torch.zeros(0), torch.zeros(0))["engine_logprob_gap_mean"])
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_gap(torch.zeros(2), torch.zeros(3))
