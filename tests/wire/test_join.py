"""TapPart on the wire and the StageJoiner: complete joins, expiry, layer mismatches, the end of a run."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from draft_align.wire.codec import encode, validate
from draft_align.wire.join import JOIN_REASONS, JoinError, StageJoiner
from draft_align.wire.messages import TapBatch, TapPart, decode
from draft_align.wire.schema import WireError

KEY = b"j" * 32
STAGES = [(1,), (), (2, 3)]  # three pipeline stages; the middle one owns no aux layer


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def batch(batch_id: int = 0, seed: int = 0) -> TapBatch:
    return TapBatch.make_dummy(4, aux_layer_ids=(1, 2, 3), batch_id=batch_id, seed=seed, topk=2)


def assert_same(a: TapBatch, b: TapBatch) -> None:
    assert encode(a, KEY) == encode(b, KEY)  # byte-identical on the wire


# ------------------------------------------------------------------------------------------- the wire
def test_tap_part_roundtrip_and_split_shapes():
    b = batch()
    parts = TapPart.split(b, STAGES)
    assert [p.layer_ids for p in parts] == [(1,), (), (2, 3)]
    assert [p.aux_hidden.shape[1] for p in parts] == [8, 0, 16]
    assert parts[0].final_hidden is None and parts[2].final_hidden is not None
    for p in parts:
        q = decode(encode(p, KEY), KEY)
        assert isinstance(q, TapPart) and q.layer_ids == p.layer_ids and q.stage == p.stage
        for name, t in p.tensors().items():
            assert torch.equal(getattr(q, name), t), name


def test_make_dummy_and_frames_roundtrip():
    part = TapPart.make_dummy(stage=1, seed=3)
    assert part.stage == 1 and part.num_stages == 2 and part.layer_ids == (2, 3)
    back = TapPart.from_frames(part.to_frames(KEY), KEY)
    assert torch.equal(back.aux_hidden, part.aux_hidden) and back.final_norm == "post"
    with pytest.raises(WireError) as e:  # a TapPart is not a TapBatch
        TapBatch.from_frames(part.to_frames(KEY), KEY)
    assert e.value.reason == "kind"


def test_tap_batch_encoding_is_unchanged_by_the_new_kind():
    header = json.loads(encode(batch(), None)[0])
    assert header["kind"] == "TapBatch" and header["version"] == 2
    assert list(header["fields"]) == [
        "run_id",
        "policy_version",
        "source_rank",
        "batch_id",
        "step",
        "aux_layer_ids",
        "hidden_size",
        "vocab_size",
        "final_norm",
        "temperature",
    ]


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"stage": 3}, "fields"),  # stage ≥ num_stages
        ({"layer_ids": (1, 4)}, "fields"),  # 4 is not one of the joined aux layers
        ({"layer_ids": (2, 1)}, "fields"),
        ({"layer_ids": (1, 2)}, "shape"),  # aux_hidden holds one layer's columns
        ({"num_stages": 0}, "fields"),
    ],
)
def test_tap_part_validation(change, reason):
    part = dataclasses.replace(TapPart.split(batch(), STAGES)[0], **change)
    with pytest.raises(WireError) as e:
        validate(part)
    assert e.value.reason == reason


# ------------------------------------------------------------------------------------------ the joiner
@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_join_in_any_order_gives_the_original_batch(order):
    b = batch()
    parts = TapPart.split(b, STAGES)
    j = StageJoiner(timeout_s=10.0)
    results = [j.add(decode(encode(parts[i], KEY), KEY)) for i in order]
    assert results[:2] == [None, None]
    assert_same(results[2], b)
    assert j.stats() == {"joined": 1, "pending": 0, **{r: 0 for r in JOIN_REASONS}}


def test_interleaved_batches_and_pipelines_join_separately():
    j = StageJoiner(timeout_s=10.0)
    b0, b1 = batch(0, seed=1), batch(1, seed=2)
    other = dataclasses.replace(batch(0, seed=3), source_rank=1)  # same batch id, another pipeline
    p0, p1, po = (TapPart.split(x, [(1, 2), (3,)]) for x in (b0, b1, other))
    assert j.add(p0[0]) is None and j.add(p1[1]) is None and j.add(po[0]) is None
    assert_same(j.add(p1[0]), b1)
    assert_same(j.add(po[1]), other)
    assert_same(j.add(p0[1]), b0)
    assert j.pending == 0 and j.joined == 3


def test_single_stage_part_is_a_whole_batch():
    b = batch()
    (part,) = TapPart.split(b, [(1, 2, 3)])
    assert_same(StageJoiner().add(part), b)


def test_missing_stage_expires_counted_and_stragglers_are_late():
    clock = Clock()
    j = StageJoiner(timeout_s=5.0, clock=clock)
    parts = TapPart.split(batch(), STAGES)
    assert j.add(parts[0]) is None and j.add(parts[1]) is None
    clock.t += 4.9
    assert j.expire() == 0 and j.pending == 1
    clock.t += 0.2
    assert j.expire() == 1
    assert j.pending == 0 and j.rejected["expired"] == 1 and j.joined == 0
    with pytest.raises(JoinError) as e:  # the stage that was too slow: nothing is trained from it
        j.add(parts[2])
    assert e.value.reason == "late" and "expired" in str(e.value)
    assert j.stats()["late"] == 1 and j.pending == 0


def test_expiry_runs_on_add_too():
    clock = Clock()
    j = StageJoiner(timeout_s=1.0, clock=clock)
    old = TapPart.split(batch(0), STAGES)
    new = TapPart.split(batch(1), STAGES)
    j.add(old[0])
    clock.t += 2.0
    assert j.add(new[0]) is None  # the old batch expired on the way
    assert j.rejected["expired"] == 1 and j.pending == 1


@pytest.mark.parametrize("case", ["aux_set", "overlap", "gap"])
def test_mismatched_layer_ids_drop_the_batch(case):
    b = batch()
    j = StageJoiner()
    if case == "aux_set":  # stages disagree on the joined layer set
        b2 = TapBatch.make_dummy(4, aux_layer_ids=(1, 2, 4), seed=0, topk=2)
        parts = [TapPart.split(b, STAGES)[0], TapPart.split(b2, [(1,), (), (2, 4)])[2]]
    elif case == "overlap":  # two stages claim layer 2
        parts = [TapPart.split(b, [(1, 2), (3,)])[0], TapPart.split(b, [(1,), (2, 3)])[1]]
    else:  # layer 2 sent by nobody
        parts = [TapPart.split(b, [(1,), (3,)])[0], TapPart.split(b, [(1,), (3,)])[1]]
    assert j.add(parts[0]) is None
    with pytest.raises(JoinError) as e:
        j.add(parts[1])
    assert e.value.reason == "layer_mismatch"
    assert j.rejected["layer_mismatch"] == 1 and j.pending == 0 and j.joined == 0
    with pytest.raises(JoinError) as e:  # a resend of the same batch is not joined either
        j.add(parts[0])
    assert e.value.reason == "late"


def test_inconsistent_sequences_and_duplicates():
    b = batch()
    parts = TapPart.split(b, [(1, 2), (3,)])
    j = StageJoiner()
    j.add(parts[0])
    with pytest.raises(JoinError) as e:
        j.add(parts[0])
    assert e.value.reason == "duplicate" and j.pending == 1
    ids = parts[1].input_ids.clone()
    ids[0] = (ids[0] + 1) % b.vocab_size
    with pytest.raises(JoinError) as e:
        j.add(dataclasses.replace(parts[1], input_ids=ids))
    assert e.value.reason == "inconsistent" and "input_ids" in str(e.value)
    assert j.pending == 0 and j.joined == 0
    j2 = StageJoiner()
    j2.add(parts[0])
    with pytest.raises(JoinError) as e:
        j2.add(dataclasses.replace(parts[1], policy_version=b.policy_version + 1))
    assert e.value.reason == "inconsistent"


def test_final_hidden_from_two_stages_is_rejected():
    b = batch()
    last = TapPart.split(b, [(1, 2), (3,)])[1]
    first = dataclasses.replace(
        TapPart.split(b, [(1, 2), (3,)])[0], final_hidden=b.final_hidden, final_norm="post"
    )
    j = StageJoiner()
    j.add(first)
    with pytest.raises(JoinError) as e:
        j.add(last)
    assert e.value.reason == "inconsistent" and "final_hidden" in str(e.value)


def test_send_after_the_run_ended():
    j = StageJoiner()
    a, c = TapPart.split(batch(0), STAGES), TapPart.split(batch(1), STAGES)
    j.add(a[0])
    assert j.end_run() == 1
    assert j.rejected["ended_incomplete"] == 1 and j.pending == 0
    for p in (a[1], c[0]):
        with pytest.raises(JoinError) as e:
            j.add(p)
        assert e.value.reason == "after_end" and "ended" in str(e.value)
    assert j.rejected["after_end"] == 2
    assert j.offer(c[1]) is None and j.rejected["after_end"] == 3  # offer(): counted, not raised


def test_overflow_drops_the_oldest_batch():
    j = StageJoiner(max_pending=2)
    firsts = [TapPart.split(batch(i), STAGES)[0] for i in range(3)]
    j.add(firsts[0])
    j.add(firsts[1])
    j.add(firsts[2])
    assert j.pending == 2 and j.rejected["overflow"] == 1
    with pytest.raises(JoinError) as e:
        j.add(TapPart.split(batch(0), STAGES)[1])
    assert e.value.reason == "late"


def test_bad_arguments():
    with pytest.raises(ValueError):
        StageJoiner(timeout_s=0)
    with pytest.raises(TypeError):
        StageJoiner().add(batch())


# ------------------------------------------------------------------------------------ in the sidecar
def test_sidecar_trains_only_joined_batches(tiny_run, tiny_env, tmp_path):
    """TapParts through the sidecar's socket: a complete pair is ingested as one batch; an incomplete one is
    dropped at the end of the run, and a part sent after the end is refused; both counted."""
    import time

    import zmq

    from draft_align.config import CotrainRecipe, load_recipe
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar
    from draft_align.wire import channel
    from draft_align.wire.messages import BatchHeader, StepReport
    from draft_align.wire.packing import pack_sequences

    recipe = load_recipe(None, tiny_run.cotrain_overrides(tmp_path), CotrainRecipe)
    sc = Sidecar(recipe, starting_draft(recipe)).setup()
    key = channel.resolve_key(None, recipe.run_dir, create=False)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    channel.authenticate(raw, key)
    raw.connect(sc.receiver.endpoint)
    try:
        h, aux = sc.hidden, sc.aux_ids
        g = torch.Generator().manual_seed(0)
        seq = {
            "input_ids": torch.tensor([5, 6, 7, 8, 9]),
            "loss_mask": torch.tensor([False, False, True, True, True]),
            "aux_hidden": torch.randn(5, len(aux) * h, generator=g),
            "final_hidden": torch.randn(5, h, generator=g),
        }

        def whole(batch_id: int) -> TapBatch:
            return pack_sequences(
                [seq, seq],
                BatchHeader(
                    run_id=recipe.run,
                    policy_version=0,
                    source_rank=0,
                    batch_id=batch_id,
                    step=0,
                    aux_layer_ids=aux,
                    hidden_size=h,
                    vocab_size=sc.vocab,
                    final_norm="post",
                    temperature=1.0,
                ),
            )

        split = [aux[:1], aux[1:]]

        def drain_until(cond) -> bool:
            end = time.monotonic() + 10
            while time.monotonic() < end and not cond():
                sc.drain(0.1, 100)
            return cond()

        p0, p1 = TapPart.split(whole(0), split)
        raw.send_multipart(encode(p1, key, sender="t", seq=1))
        raw.send_multipart(encode(p0, key, sender="t", seq=2))
        assert drain_until(lambda: sc.state.ingested_messages == 1)
        assert sc.state.ingested_tokens == 10 and sc.ingest.joiner.joined == 1
        q0, q1 = TapPart.split(whole(1), split)
        raw.send_multipart(encode(q0, key, sender="t", seq=3))  # its other stage never comes
        assert drain_until(lambda: sc.ingest.joiner.pending == 1)
        raw.send_multipart(
            encode(
                StepReport(run_id=recipe.run, step=0, policy_version=0, metrics={"final": 1.0}),
                key,
                sender="t",
                seq=9,
            )
        )
        assert drain_until(lambda: sc.state.done)
        raw.send_multipart(encode(q1, key, sender="t", seq=10))
        assert drain_until(lambda: sc.rejected["join_after_end"] == 1)
        assert sc.rejected["join_ended_incomplete"] == 1
        assert sc.state.ingested_messages == 1  # nothing from the incomplete batch
    finally:
        raw.close()
        ctx.term()
        sc.close()
