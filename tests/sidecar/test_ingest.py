"""draft_align.sidecar.ingest: tapped messages → validated records → the replay buffer (unit level), and
garbage, forged and non-finite input through a real sidecar's socket."""

from __future__ import annotations

import torch

from draft_align.heads.layers import rms_norm
from draft_align.sidecar.ingest import Ingest, split_records
from draft_align.sidecar.state import Rates, SidecarState
from draft_align.train.replay import ReplayBuffer
from draft_align.wire.messages import BatchHeader, HeadSync, TapBatch, TapPart
from draft_align.wire.packing import pack_sequences

H, V, AUX = 8, 50, (1, 2, 3)


def _ingest(holdout: int = 0) -> Ingest:
    head = HeadSync.make_dummy(hidden_size=H, vocab_size=V)
    return Ingest(
        ReplayBuffer(10_000, 2.0, holdout, 0),
        SidecarState(),
        Rates(),
        aux_ids=AUX,
        hidden=H,
        vocab=V,
        draft_to_target=head.draft_to_target,
    )


def _seq(t: int, prompt: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(3, V, (t,), generator=g),
        "loss_mask": torch.arange(t) >= prompt,
        "aux_hidden": torch.randn(t, len(AUX) * H, generator=g),
        "final_hidden": torch.randn(t, H, generator=g),
        "logit_lse": torch.randn(t, generator=g),
    }


def _batch(
    seqs, *, step: int = 0, version: int = 0, final_norm: str = "post", aux=AUX, batch_id: int = 0
) -> TapBatch:
    return pack_sequences(
        seqs,
        BatchHeader(
            run_id="dummy",
            policy_version=version,
            source_rank=0,
            batch_id=batch_id,
            step=step,
            aux_layer_ids=aux,
            hidden_size=H,
            vocab_size=V,
            final_norm=final_norm,
            temperature=0.7,
        ),
    )


def test_split_records_slices_each_sequence():
    b = _batch([_seq(5, 2, 0), _seq(7, 3, 1)])
    parts = split_records(b)
    assert [len(r) for r, _ in parts] == [5, 7]
    rec, extras = parts[1]
    assert torch.equal(rec.input_ids, b.input_ids[5:12]) and torch.equal(rec.final, b.final_hidden[5:12])
    assert torch.equal(extras["logit_lse"], b.logit_lse[5:12])
    assert extras["next_logprob"] is None and extras["topk_ids"] is None
    assert [e["stats_from"] for _, e in parts] == [0, 0]  # no stats_from: statistics at every position


def test_stats_from_reaches_the_records_through_the_wire():
    from draft_align.wire.codec import encode
    from draft_align.wire.messages import decode

    seqs = [_seq(6, 3, 0), _seq(7, 1, 1)]
    for s, start in zip(seqs, (2, 0), strict=True):
        s["logit_lse"][:start] = 0
    sent = pack_sequences(
        seqs,
        BatchHeader(
            run_id="dummy",
            policy_version=0,
            source_rank=0,
            batch_id=0,
            step=0,
            aux_layer_ids=AUX,
            hidden_size=H,
            vocab_size=V,
            final_norm="post",
            temperature=1.0,
        ),
        stats_from=[2, 0],
    )
    ing = _ingest()
    ing.on_batch(decode(encode(sent, None), None))
    records, _ = ing.step_records(0)
    assert [r.stats_from for r in records] == [2, 0]
    assert torch.equal(records[0].logit_lse, seqs[0]["logit_lse"])


def test_records_train_on_arrival_and_stay_for_their_step_estimate_until_the_report():
    ing = _ingest()
    ing.on_batch(_batch([_seq(6, 2, 0), _seq(6, 6, 1)], step=0))  # the second has no response token: skipped
    records, temp = ing.step_records(0)
    # in the buffer at once (training does not wait for the report), and kept for step 0's estimate
    assert len(records) == 1 and temp == 0.7 and len(ing.buffer) == 1
    assert ing.buffer.trainable()[0].record is records[0].record  # the same record, trainable already
    assert ing.step_records(1) == ([], None)
    ing.on_batch(_batch([_seq(6, 2, 2)], step=2, version=1, batch_id=1))  # step 0's report never came
    assert len(ing.buffer) == 2 and list(ing.fresh) == [2]  # step 0 gets no estimate
    assert ing.state.buffered_tokens == 12 and ing.state.ingested_messages == 2
    assert ing.state.ingested_tokens == 18 and ing.state.newest_policy_version == 1
    assert ing.rates.ingest_tokens == 18 and ing.rates.ingest_s > 0
    ing.flush(upto_step=2)
    assert len(ing.buffer) == 2 and not ing.fresh and ing.held_tokens == 0


def test_mismatched_and_nonfinite_batches_are_counted():
    ing = _ingest()
    ing.on_batch(_batch([_seq(5, 2, 0)], aux=(1, 2, 4)))
    assert ing.state.mismatched_messages == 1 and not ing.fresh
    bad = _seq(5, 2, 1)
    bad["aux_hidden"][1, 0] = float("inf")
    ing.on_batch(_batch([bad, _seq(5, 2, 2)]))
    assert ing.state.nonfinite_sequences == 1 and len(ing.step_records(0)[0]) == 1


def test_pre_norm_final_states_wait_for_the_head_and_are_normalised_once():
    ing = _ingest()
    b = _batch([_seq(6, 2, 0)], final_norm="pre")
    ing.on_batch(b)
    assert ing.state.mismatched_messages == 1 and not ing.fresh  # no HeadSync norm yet
    head = HeadSync.make_dummy(hidden_size=H, vocab_size=V)
    assert ing.accept_head(head) and ing.has_head
    ing.on_batch(b)
    (rec,), _ = ing.step_records(0)
    x = b.final_hidden.float()
    # weight · x / rms(x) computed in float32, rounded once to the wire dtype
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head.norm_eps) * head.norm_weight.float()
    assert rec.record.final.dtype == b.final_hidden.dtype
    assert torch.equal(rec.record.final, want.to(b.final_hidden.dtype))
    assert torch.equal(
        rec.record.final, rms_norm(x, head.norm_weight, head.norm_eps).to(b.final_hidden.dtype)
    )


def test_head_sync_checks():
    ing = _ingest()
    head = HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=3)
    other = HeadSync.make_dummy(hidden_size=H, vocab_size=V, seed=1)  # another draft vocabulary
    assert not ing.accept_head(other) and ing.state.mismatched_messages == 1
    nan = HeadSync.make_dummy(hidden_size=H, vocab_size=V)
    nan.rows[0, 0] = float("nan")
    assert not ing.accept_head(nan) and ing.state.nonfinite_heads == 1 and not ing.has_head
    assert ing.accept_head(head) and ing.state.head_policy_version == 3
    assert ing.norm is not None and ing.norm[1] == head.norm_eps


def test_out_of_range_heads_are_rejected_with_a_reason(caplog):
    ing = _ingest()
    for name, value in (("rows", 3e38), ("norm_weight", -2e4)):
        bad = HeadSync.make_dummy(hidden_size=H, vocab_size=V)
        getattr(bad, name)[0] = value
        with caplog.at_level("WARNING"):
            assert not ing.accept_head(bad)
        assert f"{name} magnitude" in caplog.text and not ing.has_head
    assert ing.state.nonfinite_heads == 2
    assert ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V))


def test_a_version_regression_is_an_rl_restart_not_a_lock_out(caplog):
    ing = _ingest()
    huge = HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=10**12)
    assert ing.accept_head(huge) and ing.state.head_policy_version == 10**12
    ing.on_batch(_batch([_seq(6, 2, 0)], step=5, version=10**12))
    restarted = HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=0)
    with caplog.at_level("WARNING"):
        assert ing.accept_head(restarted)  # not ignored: the RL job restarted from version 0
    assert "the RL job restarted" in caplog.text and ing.state.rl_restarts == 1
    assert ing.state.head_policy_version == 10**12 + 1 and not ing.fresh  # held records went to the buffer
    # the restarted job's versions keep increasing on the sidecar's side
    ing.on_batch(_batch([_seq(6, 2, 1)], step=0, version=1, batch_id=1))
    assert ing.step_records(0)[0][0].policy_version == 10**12 + 2 == ing.state.newest_policy_version
    assert ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=1))
    assert ing.state.head_policy_version == 10**12 + 2 and ing.state.rl_restarts == 1


def test_records_of_steps_without_a_report_are_bounded_and_counted():
    head = HeadSync.make_dummy(hidden_size=H, vocab_size=V)
    ing = Ingest(
        ReplayBuffer(10_000, 2.0, 0, 0),
        SidecarState(),
        Rates(),
        aux_ids=AUX,
        hidden=H,
        vocab=V,
        draft_to_target=head.draft_to_target,
        max_held_tokens=50,
    )
    # steps arriving in decreasing order are never flushed by a later step: only the bound frees them
    for i in range(30):
        ing.on_batch(_batch([_seq(10, 2, i)], step=1000 - i, batch_id=i))
        assert ing.held_tokens <= 50
    assert ing.held_tokens == sum(tr.num_tokens for recs in ing.fresh.values() for tr, _ in recs) == 50
    assert ing.state.held_dropped_records == 25 and ing.state.held_dropped_tokens == 250
    assert sorted(ing.fresh) == list(range(971, 976))  # the five held last
    ing.flush()
    # only the step estimates were bounded: every record trains
    assert ing.held_tokens == 0 and len(ing.buffer) == 30


def test_stage_parts_are_joined_and_end_run_flushes():
    ing = _ingest()
    p0, p1 = TapPart.split(_batch([_seq(6, 2, 0)]), [AUX[:1], AUX[1:]])
    ing.on_part(p0)
    assert not ing.fresh and ing.joiner.pending == 1
    ing.on_part(p1)
    assert len(ing.step_records(0)[0]) == 1 and ing.joiner.joined == 1
    ing.end_run()
    assert not ing.fresh and len(ing.buffer) == 1


def test_garbage_forged_and_nonfinite_input_is_counted_and_survived(sidecar_world, until):
    import zmq

    from draft_align.wire.channel import authenticate
    from draft_align.wire.codec import encode
    from draft_align.wire.packing import pack_sequences

    recipe, sc, feeder = sidecar_world
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    authenticate(raw, feeder.key)  # a key holder's socket (without it the handshake is refused)
    raw.connect(sc.receiver.endpoint)
    raw.send_multipart([b"not json", b"\x00" * 7, b"x" * 32])
    raw.send_multipart([b"{}"])
    h = sc.hidden
    good = {
        "input_ids": torch.tensor([5, 6, 7, 8]),
        "loss_mask": torch.tensor([False, True, True, True]),
        "aux_hidden": torch.randn(4, 3 * h),
        "final_hidden": torch.randn(4, h),
    }
    bad = {**good, "aux_hidden": good["aux_hidden"].clone()}
    bad["aux_hidden"][2, 5] = float("nan")
    batch = pack_sequences(
        [good, bad, good],
        BatchHeader(
            run_id=recipe.run,
            policy_version=0,
            source_rank=0,
            batch_id=0,
            step=0,
            aux_layer_ids=sc.aux_ids,
            hidden_size=h,
            vocab_size=sc.vocab,
            final_norm="post",
            temperature=1.0,
        ),
    )
    raw.send_multipart(encode(batch, b"k" * 32))  # forged: signed with another key
    raw.send_multipart(encode(batch, feeder.key, sender="t", seq=0))
    assert until(lambda: sc.state.ingested_messages >= 1, 10, every=lambda: sc.drain(0.1, 100))
    rej = sc.rejected
    assert rej["mac"] == 2 and rej["frames"] == 1  # 3 garbage frames and the forged batch fail the MAC
    assert sc.state.nonfinite_sequences == 1
    assert sum(len(v) for v in sc.ingest.fresh.values()) == 2
    # a batch for another draft (wrong aux layers) is refused as mismatched, not trained on
    other = pack_sequences(
        [good],
        BatchHeader(
            run_id=recipe.run,
            policy_version=0,
            source_rank=0,
            batch_id=1,
            step=0,
            aux_layer_ids=(1, 2, 5),
            hidden_size=h,
            vocab_size=sc.vocab,
            final_norm="post",
            temperature=1.0,
        ),
    )
    raw.send_multipart(encode(other, feeder.key, sender="t", seq=1))
    assert until(lambda: sc.state.mismatched_messages == 1, 10, every=lambda: sc.drain(0.1, 100))
    raw.close()
    ctx.term()


def test_old_version_batches_and_untapped_heads_are_counted_and_kept_under_their_own_version():
    ing = _ingest()
    assert ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=2))
    ing.on_batch(_batch([_seq(6, 2, 0)], step=2, version=2))
    assert ing.state.old_version_batches == 0 and ing.head_tapped
    # a batch of version 1 after the head of version 2, with no HeadSync saying the job restarted
    ing.on_batch(_batch([_seq(6, 2, 1)], step=3, version=1, batch_id=1))
    assert ing.state.old_version_batches == 1 and ing.state.rl_restarts == 0
    assert [r.policy_version for r in ing.buffer.trainable()] == [2, 1]  # trained as the version it names
    # the head of version 3 gets no taps before version 4's: counted once, nothing attributed to it
    assert ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=3))
    assert ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=3))  # a repeat
    assert ing.state.untapped_heads == 0
    assert ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=4))
    assert ing.state.untapped_heads == 1 and ing.state.head_policy_version == 4
    ing.on_batch(_batch([_seq(6, 2, 2)], step=4, version=4, batch_id=2))
    assert ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=5))
    assert ing.state.untapped_heads == 1 and ing.state.newest_policy_version == 4
