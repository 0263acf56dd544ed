"""tap.logit_stats: the per-token policy statistics a Tap ships (no model needed: random logits)."""

import pytest
import torch

from draft_align.tap.logit_stats import head_logit_stats, logit_stats, logprob_stats
from draft_align.tap.protocol import PolicyTapError


def test_logit_stats_chunked_equals_direct():
    torch.manual_seed(3)
    logits = torch.randn(9, 17) * 4
    ids = torch.randint(0, 17, (9,))
    full = logit_stats(logits, ids, 4)
    chunked = logit_stats(logits, ids, 4, max_elements=17 * 2)  # 2 tokens per chunk
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(full[0][:-1], lp[torch.arange(8), ids[1:]])
    torch.testing.assert_close(full[1], torch.logsumexp(logits, -1))
    for a, b in zip(full, chunked, strict=True):
        torch.testing.assert_close(a, b)
    assert logit_stats(logits, ids, 0)[2] is None


def test_logprob_stats_equal_the_head_statistics():
    """logit_lse from the job's log-probs and one head row per position = the whole head's logsumexp."""
    torch.manual_seed(4)
    final, w, bias = torch.randn(7, 5, dtype=torch.float64), torch.randn(13, 5, dtype=torch.float64) * 3, None
    ids = torch.randint(0, 13, (7,))
    for bias in (None, torch.randn(13, dtype=torch.float64)):
        nxt, lse, _, _ = head_logit_stats(final, w, bias, ids, 0)
        job = nxt.clone()
        job[-1] = float("nan")  # no next token: never read
        got = logprob_stats(final, w, bias, ids, job)
        assert got[2] is None and got[3] is None and got[0][-1] == 0
        torch.testing.assert_close(got[0], nxt)
        torch.testing.assert_close(got[1], lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(PolicyTapError, match="next_logprob must be"):
        logprob_stats(final, w, None, ids, job[:3])
    with pytest.raises(PolicyTapError, match="do not multiply"):
        logprob_stats(final, w[:, :4], None, ids, job)
