"""draft_align.train.records: tapped-record validation, chain starts, collation, token-budgeted batches."""

import pytest
import torch

from draft_align.train.records import Record, RecordError, TappedRecord, chain_starts, collate, make_batches

AUX_W, H = 6, 2


def tapped(t: int, version: int = 0, prompt: int = 2, step: int = 0, **kw) -> TappedRecord:
    """A t-token record whose tokens after ``prompt`` are response."""
    mask = torch.zeros(t, dtype=torch.bool)
    mask[prompt:] = True
    rec = Record(
        torch.zeros(t, dtype=torch.long),
        mask,
        torch.zeros(t, AUX_W, dtype=torch.bfloat16),
        torch.zeros(t, H, dtype=torch.bfloat16),
    )
    return TappedRecord(rec, policy_version=version, step=step, **kw)


def test_tapped_record_properties_and_validation():
    r = tapped(7, prompt=3, logit_lse=torch.zeros(7), topk_ids=torch.zeros(7, 2, dtype=torch.long))
    assert r.num_tokens == 7 and r.prompt_len == 3 and r.has_response
    assert tapped(5, prompt=0).prompt_len == 0
    with pytest.raises(RecordError, match="no response token"):
        _ = tapped(5, prompt=5).prompt_len
    with pytest.raises(RecordError, match="logit_lse"):
        tapped(5, logit_lse=torch.zeros(4))
    with pytest.raises(RecordError, match="topk_ids"):
        tapped(5, topk_ids=torch.zeros(5, dtype=torch.long))
    assert r.stats_from == 0 and tapped(5, stats_from=5).stats_from == 5
    for bad_start in (-1, 6):
        with pytest.raises(RecordError, match=f"stats_from {bad_start} outside"):
            tapped(5, stats_from=bad_start)
    with pytest.raises(RecordError, match="T ≥ 2"):
        tapped(1, prompt=0)
    with pytest.raises(RecordError, match="policy_version"):
        tapped(5, version=-1)
    bad = tapped(5)
    with pytest.raises(RecordError, match="aux"):
        TappedRecord(
            Record(bad.record.input_ids, bad.record.loss_mask, bad.record.aux[:4], bad.record.final), 0, 0
        )
    with pytest.raises(RecordError, match="loss_mask"):
        TappedRecord(
            Record(bad.record.input_ids, bad.record.input_ids, bad.record.aux, bad.record.final), 0, 0
        )


def mask_of(t: int, response: list[int]) -> torch.Tensor:
    m = torch.zeros(t, dtype=torch.bool)
    m[response] = True
    return m


@pytest.mark.parametrize(
    ("t", "response", "steps", "expected"),
    [
        # step j of chain s predicts token s+2+j: one step needs mask[s+2]
        (10, [5, 6, 9], 1, [3, 4, 7]),
        # three steps: mask[s+2] or mask[s+3] or mask[s+4]
        (10, [5, 6, 9], 3, [1, 2, 3, 4, 5, 6, 7]),
        # a response token at 0 or 1 can never be predicted (no position s ≥ 0 reaches it)
        (6, [0, 1], 3, []),
        (6, [2], 1, [0]),
        # the whole row is response: every start that still has a token two ahead
        (5, [0, 1, 2, 3, 4], 2, [0, 1, 2]),
    ],
)
def test_chain_starts_exact(t, response, steps, expected):
    got = chain_starts(mask_of(t, response), steps)
    assert got.dtype == torch.long
    assert got.tolist() == expected


def test_chain_starts_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        t = int(torch.randint(1, 30, (1,), generator=g))
        m = torch.rand(t, generator=g) < 0.3
        steps = int(torch.randint(1, 6, (1,), generator=g))
        want = [s for s in range(t) if any(s + 2 + j < t and m[s + 2 + j] for j in range(steps))]
        assert chain_starts(m, steps).tolist() == want


def record(ids: list[int], response: list[int], n_aux_h: int = 6, h: int = 2, fill: float = 0.0) -> Record:
    t = len(ids)
    aux = torch.arange(t * n_aux_h, dtype=torch.float32).view(t, n_aux_h).to(torch.bfloat16) + fill
    final = torch.full((t, h), fill + 1.0, dtype=torch.bfloat16)
    return Record(torch.tensor(ids), mask_of(t, response), aux, final)


def test_record_counts_targets():
    r = record([5, 6, 7, 8, 9], [0, 3, 4])
    assert len(r) == 5
    assert r.num_targets() == 2  # token 0 is never a target (nothing before it predicts it)


def test_collate_pads_and_lists_starts():
    a = record([11, 12, 13, 14, 15, 16], [4, 5], fill=1.0)
    b = record([21, 22, 23, 24], [3], fill=2.0)
    batch = collate([a, b], steps=2)
    assert batch.input_ids.tolist() == [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 0, 0]]
    assert batch.valid.tolist() == [[True] * 6, [True] * 4 + [False] * 2]
    assert batch.loss_mask.tolist() == [
        [False, False, False, False, True, True],
        [False, False, False, True, False, False],
    ]
    assert batch.num_tokens == 10
    # row 0: mask[s+2] or mask[s+3] → s ∈ {1, 2, 3}; row 1: s ∈ {0, 1}, padded with 0 and masked
    assert batch.starts.tolist() == [[1, 2, 3], [0, 1, 0]]
    assert batch.starts_valid.tolist() == [[True, True, True], [True, True, False]]
    assert torch.equal(batch.aux[0], a.aux) and torch.equal(batch.aux[1, :4], b.aux)
    assert (batch.aux[1, 4:] == 0).all() and (batch.final[1, 4:] == 0).all()
    assert batch.aux.dtype == torch.bfloat16 and batch.final.dtype == torch.bfloat16


def test_collate_without_any_chain_keeps_one_masked_slot():
    batch = collate([record([1, 2, 3], [])], steps=3)
    assert batch.starts.shape == (1, 1)
    assert not batch.starts_valid.any()


def lengths_fixture(n: int = 300, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 120, (n,), generator=g).tolist()


def test_make_batches_covers_each_index_once_within_budget():
    lengths = lengths_fixture() + [500, 700]  # two records longer than the budget
    budget = 256
    batches = make_batches(lengths, budget, torch.Generator().manual_seed(3))
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    for b in batches:
        assert b, "empty batch"
        padded = max(lengths[i] for i in b) * len(b)
        assert padded <= budget or len(b) == 1
    assert [len(lengths) - 2] in batches and [len(lengths) - 1] in batches  # over-long: alone
    # length bucketing keeps padding small: ≥ 80% of padded tokens are real
    real = sum(lengths[i] for b in batches for i in b if lengths[i] <= budget)
    pad = sum(max(lengths[i] for i in b) * len(b) for b in batches if len(b) > 1 or lengths[b[0]] <= budget)
    assert real / pad > 0.8


def test_make_batches_deterministic_per_seed():
    lengths = lengths_fixture()
    a = make_batches(lengths, 300, torch.Generator().manual_seed(7))
    b = make_batches(lengths, 300, torch.Generator().manual_seed(7))
    c = make_batches(lengths, 300, torch.Generator().manual_seed(8))
    assert a == b
    assert a != c
    assert sorted(i for x in c for i in x) == list(range(len(lengths)))
