"""tap.shipping: what both policy taps share — the capture session, the step's sample, message chunks
and their shipping, the topk check and the HeadSync message (no model needed: fake hooks and hand-made sequences)."""

import pytest
import torch

from draft_align.hf.capture import TapError
from draft_align.tap.budget import generator_for
from draft_align.tap.protocol import PolicyTapError
from draft_align.tap.shipping import (
    CaptureSession,
    KeptSequence,
    StepSample,
    TapCounters,
    check_topk,
    head_sync_message,
    ship,
)
from draft_align.wire.schema import WireError
from tests.helpers import ListSink


class FakeHooks:
    """Hooks that record attach/detach and hand out queued captures."""

    def __init__(self) -> None:
        self.attached = 0
        self.detached = 0
        self.queue: list[str] = []

    def attach(self) -> "FakeHooks":
        self.attached += 1
        return self

    def detach(self) -> None:
        self.detached += 1
        self.queue.clear()

    def pop(self) -> str:
        if not self.queue:
            raise TapError("nothing captured")
        return self.queue.pop(0)


def seq(n: int, version: int = 0, step: int = 0, temperature: float = 1.0) -> KeptSequence:
    return KeptSequence(step, version, temperature, n, {"input_ids": torch.arange(n)})


def test_capture_session_attaches_only_inside_and_hands_out_captures():
    hooks = FakeHooks()
    cap = CaptureSession(hooks)
    with pytest.raises(PolicyTapError, match="inside `with tap.capturing"):
        cap.take()
    with cap.capturing():
        assert cap.active and hooks.attached == 1
        with pytest.raises(PolicyTapError, match="without a captured forward pass"):
            cap.take()
        hooks.queue += ["a", "b"]
        assert (cap.take(), cap.take()) == ("a", "b")  # first in, first out
        with pytest.raises(PolicyTapError, match="reentrant"), cap.capturing():
            pass
        assert hooks.attached == 1  # the refused re-entry attached nothing
    assert not cap.active and hooks.detached == 1
    with pytest.raises(RuntimeError, match="boom"), cap.capturing():
        raise RuntimeError("boom")
    assert not cap.active and (hooks.attached, hooks.detached) == (2, 2)  # removed on an exception too


def test_step_sample_counts_rows_and_chunks_by_version_step_and_size():
    sample = StepSample(100, generator_for(0, 0), max_seq_tokens=100)
    valid = torch.tensor(
        [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool
    )
    response = torch.tensor(
        [[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.bool
    )
    lengths, kept = sample.admit(valid, response)
    assert lengths == [3, 1, 4, 0, 2]
    assert [b for b, _ in kept] == [0, 4]  # row 1 too short, row 2 has no response, row 3 empty
    c = sample.counters
    assert (c.sequences_seen, c.tokens_seen, c.too_short, c.no_response) == (4, 10, 1, 1)
    for (b, h), version in zip(kept, (1, 2), strict=True):
        sample.keep(h, seq(lengths[b], version=version))
    more = [
        sample.admit(torch.ones(1, n, dtype=torch.bool), torch.ones(1, n, dtype=torch.bool))
        for n in (4, 3, 5)
    ]
    for lens, ks in more:
        ((_, h),) = ks
        sample.keep(h, seq(lens[0], version=1))
    chunks = sample.end_step(max_tokens=8)
    # version 1: 3 + 4 | 3 + 5 (a chunk never exceeds 8 tokens); version 2: 2 — in admission order
    assert [[s.n_tokens for s in ch] for ch in chunks] == [[3, 4], [3, 5], [2]]
    assert [ch[0].policy_version for ch in chunks] == [1, 1, 2]
    assert (c.sequences_kept, c.tokens_kept) == (5, 17) and sample.pending == {}
    assert sample.end_step(8) == [] and sample.stats()["tokens_kept"] == 17


def test_step_sample_releases_evicted_sequences():
    sample = StepSample(4, generator_for(0, 0), max_seq_tokens=4)
    ones = torch.ones(1, 3, dtype=torch.bool)
    seen = []
    for _ in range(6):
        lengths, kept = sample.admit(ones, ones)
        for b, h in kept:
            sample.keep(h, seq(lengths[b]))
            seen.append(h)
        assert set(sample.pending) == set(sample.sketch.kept())  # evicted copies are dropped at once
    assert len(sample.pending) == 1 and len(seen) >= 1


def test_ship_counts_accepted_refused_and_invalid():
    counters = TapCounters()
    sink = ListSink(capacity=1)
    chunks = [[seq(3)], [seq(2), seq(2)], [seq(5)]]

    def build(chunk):
        if len(chunk) == 2:
            raise WireError("range", "NaN log-probs")
        return sum(s.n_tokens for s in chunk)

    assert ship(chunks, build, sink, counters, "test") == 3
    assert sink.messages == [3]
    assert (counters.messages_offered, counters.tokens_offered) == (1, 3)
    assert (counters.messages_invalid, counters.messages_dropped, counters.tokens_dropped) == (1, 1, 9)


@pytest.mark.parametrize(("topk", "want"), [(0, 0), (3, 3), (10, 10), (3.0, 3), (-1, None), (11, None)])
def test_check_topk_accepts_0_to_the_vocabulary(topk, want):
    if want is None:
        with pytest.raises(PolicyTapError, match=rf"topk must be in 0\.\.10, got {topk}"):
            check_topk(topk, 10)
    else:
        assert check_topk(topk, 10) == want and type(check_topk(topk, 10)) is int


def test_head_sync_message_is_host_copies_in_the_wire_dtypes():
    norm = torch.linspace(0.5, 1.5, 4, dtype=torch.bfloat16)
    rows = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    d2t = torch.tensor([5, 0, 2])
    msg = head_sync_message("run", 7, 4, 6, 1e-5, norm, d2t, rows.detach())
    assert (msg.run_id, msg.policy_version, msg.hidden_size, msg.vocab_size, msg.norm_eps) == (
        "run",
        7,
        4,
        6,
        1e-5,
    )
    assert msg.norm_weight.dtype == torch.float32 and torch.equal(msg.norm_weight, norm.float())
    assert msg.rows.dtype == torch.bfloat16 and torch.equal(msg.rows, rows.detach().to(torch.bfloat16))
    assert torch.equal(msg.draft_to_target, d2t)
    norm.fill_(0)
    d2t.fill_(0)
    assert float(msg.norm_weight.min()) == 0.5 and msg.draft_to_target.tolist() == [5, 0, 2]  # copies
