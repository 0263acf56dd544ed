"""draft_align.train.store: response cache and captured-state shards (round trips, torn and stale files)."""

import json

import pytest
import torch

from draft_align.train.records import Record
from draft_align.train.store import HiddenStore, ResponseCache, StoreError, settings_key


def test_settings_key_is_stable_and_order_free():
    a = settings_key({"model": "m", "aux": (1, 2, 3), "T": 0.0})
    assert a == settings_key({"T": 0.0, "aux": [1, 2, 3], "model": "m"})
    assert a != settings_key({"model": "m", "aux": (1, 2, 4), "T": 0.0})
    assert len(a) == 16 and int(a, 16) >= 0


def test_response_cache_round_trip(tmp_path):
    cache = ResponseCache(tmp_path / "sub" / "r.jsonl")
    assert cache.load() == {}
    cache.append(
        [(3, torch.tensor([1, 2, 3]), torch.tensor([9, 8])), (0, torch.tensor([4]), torch.tensor([]))]
    )
    cache.append([(7, torch.tensor([5, 6]), torch.tensor([2]))])
    done = cache.load()
    assert sorted(done) == [0, 3, 7]
    assert done[3][0].tolist() == [1, 2, 3] and done[3][1].tolist() == [9, 8]
    assert done[0][1].numel() == 0
    assert done[7][1].tolist() == [2]


def test_response_cache_ignores_a_torn_last_line_and_appends_after_it(tmp_path):
    path = tmp_path / "r.jsonl"
    cache = ResponseCache(path)
    cache.append([(1, torch.tensor([1, 2]), torch.tensor([3]))])
    full = json.dumps({"i": 2, "prompt": [4, 5], "response": [6, 7]})
    with open(path, "a", encoding="utf-8") as f:
        f.write(full[: len(full) // 2])  # killed mid-write
    done = cache.load()
    assert sorted(done) == [1]
    # the next run appends: its first row must not be glued to the torn line
    cache.append([(2, torch.tensor([4, 5]), torch.tensor([6, 7]))])
    done = cache.load()
    assert sorted(done) == [1, 2]
    assert done[2][1].tolist() == [6, 7]


def records(seed: int, n: int = 3, h: int = 4, n_aux: int = 3) -> list[Record]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 3 + 2 * i
        out.append(
            Record(
                torch.randint(0, 100, (t,), generator=g),
                torch.rand(t, generator=g) < 0.5,
                torch.randn(t, n_aux * h, generator=g).to(torch.bfloat16),
                torch.randn(t, h, generator=g).to(torch.bfloat16),
            )
        )
    return out


META = {"aux_layer_ids": [1, 2, 3], "model": "tiny"}


def test_hidden_store_round_trip_is_exact(tmp_path):
    store = HiddenStore(tmp_path / "h", META)
    assert store.existing_shards() == 0 and not store.complete
    a, b = records(0), records(1, n=2)
    store.write_shard(0, a)
    store.write_shard(1, b)
    assert store.existing_shards() == 2
    assert not store.complete
    store.finish()
    assert HiddenStore(tmp_path / "h", META).complete
    got = list(HiddenStore(tmp_path / "h", dict(META)).records())
    assert len(got) == 5
    for want, have in zip(a + b, got, strict=True):
        for field in ("input_ids", "loss_mask", "aux", "final"):
            w, h = getattr(want, field), getattr(have, field)
            assert w.dtype == h.dtype and torch.equal(w, h), field
    assert [len(r) for r in store.shard_records(1)] == [3, 5]
    assert not list(tmp_path.glob("h/.tmp-*"))


def test_shard_with_other_meta_is_rejected(tmp_path):
    HiddenStore(tmp_path / "h", META).write_shard(0, records(0))
    other = HiddenStore(tmp_path / "h", {"aux_layer_ids": [2, 3, 4], "model": "tiny"})
    with pytest.raises(StoreError, match=r"shard-00000\.safetensors was made with other settings"):
        list(other.records())


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_truncated_shard_is_a_clear_error(tmp_path, keep):
    store = HiddenStore(tmp_path / "h", META)
    store.write_shard(0, records(0))
    store.write_shard(1, records(1))
    p = store.shard_path(1)
    raw = p.read_bytes()
    p.write_bytes(raw[: int(len(raw) * keep)])
    got = store.shard_records(0)  # an intact shard still reads
    assert len(got) == 3
    with pytest.raises(StoreError, match=r"shard-00001\.safetensors is unreadable .*delete .*recapture"):
        list(store.records())
