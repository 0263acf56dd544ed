"""tap.logit_stats: the per-token policy statistics a Tap ships (no model needed: random logits)."""

import torch

from draft_align.tap.logit_stats import logit_stats


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
