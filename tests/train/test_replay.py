"""draft_align.train.replay: refusal, eviction, hold-out, recency-weighted sampling, token bound."""

import math

import pytest
import torch

from draft_align.train.records import Record, TappedRecord, collate
from draft_align.train.replay import ReplayBuffer, ReplayError

AUX_W, H = 6, 2


def tapped(t: int, version: int = 0, prompt: int = 2, tag: int = 0, step: int = 0, **kw) -> TappedRecord:
    """A t-token record whose tokens after ``prompt`` are response; ``tag`` marks its ids (ids = tag)."""
    mask = torch.zeros(t, dtype=torch.bool)
    mask[prompt:] = True
    rec = Record(
        torch.full((t,), tag, dtype=torch.long),
        mask,
        torch.full((t, AUX_W), float(tag), dtype=torch.bfloat16),
        torch.full((t, H), float(tag), dtype=torch.bfloat16),
    )
    return TappedRecord(rec, policy_version=version, step=step, **kw)


def test_buffer_settings_are_checked():
    for kw, msg in (
        (dict(max_tokens=1), "max_tokens"),
        (dict(half_life=0.0), "half_life"),
        (dict(half_life=math.nan), "half_life"),
        (dict(holdout_records=-1), "holdout_records"),
    ):
        args = dict(max_tokens=100, half_life=1.0, holdout_records=0, seed=0) | kw
        with pytest.raises(ReplayError, match=msg):
            ReplayBuffer(**args)
    buf = ReplayBuffer(100, 1.0, 0, 0)
    buf.add(tapped(5))
    with pytest.raises(ReplayError, match="batch_tokens"):
        buf.sample_records(0)


def test_refuses_records_without_response_and_too_long():
    buf = ReplayBuffer(max_tokens=20, half_life=1.0, holdout_records=0, seed=0)
    assert buf.add(tapped(6, prompt=6)) is None  # all prompt
    assert buf.add(tapped(21)) is None  # can never fit
    assert len(buf) == 0 and buf.sample_records(100) == []
    s = buf.stats()
    assert s["refused_no_response"] == 1 and s["refused_too_long"] == 1
    assert s["records"] == 0 and s["version_min"] is None and s["fill"] == 0.0
    assert buf.add(tapped(20)) is not None  # exactly max_tokens fits
    assert buf.stats()["tokens"] == 20


def test_arrival_and_widths_checked():
    buf = ReplayBuffer(100, 1.0, 0, 0)
    a = buf.add(tapped(4))
    b = buf.add(tapped(4))
    assert (a.arrival, b.arrival) == (0, 1)
    c = buf.add(tapped(4, arrival=10))
    assert c.arrival == 10 and buf.add(tapped(4)).arrival == 11
    with pytest.raises(ReplayError, match="arrival 5"):
        buf.add(tapped(4, arrival=5))
    other = tapped(4)
    wide = Record(
        other.record.input_ids, other.record.loss_mask, torch.zeros(4, AUX_W + 3), other.record.final
    )
    with pytest.raises(ReplayError, match="widths"):
        buf.add(TappedRecord(wide, 0, 0))
    assert len(buf) == 4  # the refused ones changed nothing


def test_eviction_oldest_first_and_holdout_rotation():
    buf = ReplayBuffer(max_tokens=30, half_life=1.0, holdout_records=2, seed=0)
    sizes = [10, 8, 6, 9, 7]
    for i, t in enumerate(sizes):
        buf.add(tapped(t, version=i, tag=i))
    # 10+8+6+9 = 33 > 30 after the 4th: record 0 evicted; +7 → 30 (fits)
    assert [r.record.input_ids[0].item() for r in buf.trainable()] == [1, 2]
    assert [r.record.input_ids[0].item() for r in buf.holdout()] == [3, 4]  # arrival order
    s = buf.stats()
    want = {
        "tokens": 30,
        "records": 4,
        "trainable_tokens": 14,
        "trainable_records": 2,
        "holdout_tokens": 16,
        "holdout_records": 2,
        "evicted_records": 1,
        "evicted_tokens": 10,
        "version_min": 1,
        "version_max": 4,
        "fill": 1.0,
    }
    assert {key: s[key] for key in want} == want
    # a newer record: the oldest held-out one (3) becomes trainable; 30+5 → evict 1 (8) → 27
    buf.add(tapped(5, version=5, tag=5))
    assert [r.record.input_ids[0].item() for r in buf.trainable()] == [2, 3]
    assert [r.record.input_ids[0].item() for r in buf.holdout()] == [4, 5]
    assert buf.stats()["evicted_records"] == 2 and buf.num_tokens == 27
    # sampling never returns held-out records
    for _ in range(50):
        got = {r.record.input_ids[0].item() for r in buf.sample_records(1000)}
        assert got == {2, 3}


def test_nothing_trainable_while_only_holdout():
    buf = ReplayBuffer(100, 1.0, holdout_records=3, seed=0)
    for i in range(3):
        buf.add(tapped(5, tag=i))
    assert buf.sample_records(100) == [] and buf.trainable() == []
    buf.add(tapped(5, tag=3))
    (rec,) = buf.sample_records(100)  # the oldest left the hold-out
    assert rec.num_tokens == 5 and rec.record.input_ids[0].item() == 0


@pytest.mark.parametrize("half_life", [1.0, 2.5])
def test_recency_weighting_matches_half_life(half_life):
    """Single-record batches: P(version v) ∝ count_v · 0.5 ** ((v_max − v) / half_life)."""
    buf = ReplayBuffer(max_tokens=10_000, half_life=half_life, holdout_records=0, seed=123)
    versions = [0, 1, 2, 3]
    for v in versions:
        for i in range(5):
            buf.add(tapped(6, version=v, tag=10 * v + i))
    w = torch.tensor([0.5 ** ((3 - v) / half_life) for v in versions])
    torch.testing.assert_close(buf.weights(), w.double().repeat_interleave(5))
    expect = w / w.sum()
    n = 4000
    counts = torch.zeros(4)
    for _ in range(n):
        (r,) = buf.sample_records(6)  # one 6-token record per batch
        counts[r.policy_version] += 1
    freq = counts / n
    assert torch.allclose(freq, expect, atol=0.025), (freq, expect)
    # the newest-vs-oldest ratio, which is what half_life controls
    assert counts[3] / counts[0] == pytest.approx(2 ** (3 / half_life), rel=0.15)


def test_draws_without_replacement_and_uniform_with_infinite_half_life():
    buf = ReplayBuffer(10_000, math.inf, 0, seed=1)
    for v in range(4):
        buf.add(tapped(4, version=v, tag=v))
    assert torch.equal(buf.weights(), torch.ones(4, dtype=torch.float64))
    firsts = torch.zeros(4)
    for _ in range(2000):
        recs = buf.sample_records(10_000)
        assert sorted(r.arrival for r in recs) == [0, 1, 2, 3]  # everything fits, nothing twice
        firsts[recs[0].policy_version] += 1
    assert torch.allclose(firsts / 2000, torch.full((4,), 0.25), atol=0.04)


def test_very_old_versions_do_not_underflow():
    buf = ReplayBuffer(10_000, half_life=1.0, holdout_records=0, seed=2)
    buf.add(tapped(4, version=0, tag=0))  # weight 2 ** -5000: 0.0 in float64
    buf.add(tapped(4, version=5000, tag=1))
    for _ in range(20):
        recs = buf.sample_records(8)
        assert [r.policy_version for r in recs] == [5000, 0]  # still drawn, always second


def test_batch_token_bound_and_collation():
    g = torch.Generator().manual_seed(0)
    buf = ReplayBuffer(100_000, half_life=2.0, holdout_records=3, seed=7)
    for i in range(60):
        t = int(torch.randint(3, 40, (1,), generator=g))
        buf.add(tapped(t, version=i // 10, tag=i, prompt=1))
    lengths = {r.arrival: r.num_tokens for r in buf.trainable()}
    for budget in (16, 64, 200):
        for _ in range(30):
            recs = buf.sample_records(budget)
            longest = max(r.num_tokens for r in recs)
            assert longest * len(recs) <= budget or len(recs) == 1
            assert len({r.arrival for r in recs}) == len(recs)
            assert all(r.arrival in lengths for r in recs)
    batch = collate([r.record for r in buf.sample_records(200)], 3)  # as the sidecar builds its batches
    assert batch.input_ids.numel() <= 200
    # rows are the records themselves, padded: ids carry each record's tag, valid marks its length
    for row in range(batch.input_ids.shape[0]):
        n = int(batch.valid[row].sum())
        tag = batch.input_ids[row, 0].item()
        assert lengths[tag] == n and batch.input_ids[row, :n].eq(tag).all()
        assert batch.aux[row, :n].float().eq(float(tag)).all()
    # a record longer than the budget still forms a batch of one
    assert len(buf.sample_records(2)) == 1


def test_deterministic_given_same_adds():
    def run(seed: int) -> list[list[int]]:
        buf = ReplayBuffer(500, half_life=1.5, holdout_records=2, seed=seed)
        out = []
        for i in range(40):
            buf.add(tapped(5 + i % 7, version=i // 8, tag=i))
            out.append([r.arrival for r in buf.sample_records(30)])
        return out

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_trainable_tokens_property_matches_stats():
    buf = ReplayBuffer(max_tokens=60, half_life=2.0, holdout_records=2, seed=0)
    for i, n in enumerate([5, 7, 9, 11, 13]):
        buf.add(tapped(n, version=i))
        assert buf.trainable_tokens == buf.stats()["trainable_tokens"]
    assert buf.trainable_tokens == 5 + 7 + 9


def test_a_holdout_stride_keeps_each_versions_records_trainable_on_arrival():
    buf = ReplayBuffer(10_000, 2.0, holdout_records=3, seed=0, holdout_every=4)
    for _ in range(8):  # one RL step (policy version 0) of 8 records
        buf.add(tapped(10, version=0))
    # every 4th record held out: 2 of the step's 8, the other 6 trainable at once
    assert [r.arrival for r in buf.holdout()] == [0, 4]
    assert [r.arrival for r in buf.trainable()] == [1, 2, 3, 5, 6, 7]
    for _ in range(8):
        buf.add(tapped(10, version=1))
    # at most 3 held out, the newest candidates: record 0 became trainable, the newest version has 2 held
    assert [r.arrival for r in buf.holdout()] == [4, 8, 12]
    assert buf.stats()["holdout_records"] == 3 and buf.trainable_tokens == 13 * 10
    # stride 1 is the newest-N hold-out
    one = ReplayBuffer(10_000, 2.0, holdout_records=3, seed=0)
    for _ in range(8):
        one.add(tapped(10, version=0))
    assert [r.arrival for r in one.holdout()] == [5, 6, 7]
    with pytest.raises(ReplayError, match="holdout_every"):
        ReplayBuffer(100, 1.0, 0, 0, holdout_every=0)


def test_fresh_first_draws_the_newest_versions_undrawn_records_before_any_other():
    buf = ReplayBuffer(100_000, math.inf, holdout_records=0, seed=3, fresh_first=True)
    for v in range(3):
        for _ in range(6):
            buf.add(tapped(10, version=v))
    first = buf.sample_records(30)  # 3 records per batch
    second = buf.sample_records(30)
    # the six version-2 records, oldest first, before anything older
    assert [r.arrival for r in first + second] == [12, 13, 14, 15, 16, 17]
    third = buf.sample_records(30)  # all drawn once: the weighted draw again (uniform here)
    assert len(third) == 3
    buf.add(tapped(10, version=3))
    assert buf.sample_records(30)[0].arrival == 18  # a new version's record leads the next batch
    # without fresh_first, uniform sampling reaches older versions in the first batches
    plain = ReplayBuffer(100_000, math.inf, holdout_records=0, seed=3)
    for v in range(3):
        for _ in range(6):
            plain.add(tapped(10, version=v))
    drawn = [r.policy_version for _ in range(2) for r in plain.sample_records(30)]
    assert min(drawn) < 2
