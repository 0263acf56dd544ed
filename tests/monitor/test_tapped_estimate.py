"""draft_align.monitor.tapped_estimate: acceptance from tapped records equals the estimator that runs the target
(and the sidecar's paired gate separates real drafts estimated this way)."""

import pytest
import torch

from draft_align.hf.capture import HFTap
from draft_align.hf.parts import decoder_parts, head_rows
from draft_align.monitor.estimator import alpha_table, estimate
from draft_align.monitor.tapped_estimate import RecordEstimateError, estimate_records, record_alpha
from draft_align.sidecar.gate import paired_gate
from draft_align.train.records import Record, TappedRecord

PROMPT = 4
MODES = ["greedy", "greedy_draft", "probabilistic"]


def tap_record(target, ids: torch.Tensor, aux_ids, lse: bool = True, topk: bool = True, arrival: int = 0):
    """A TappedRecord built from one forward of ``target`` (fp32 states: the comparison is exact)."""
    with torch.no_grad(), HFTap(target, aux_ids, capture_final=True) as tap:
        logits = target(ids[None]).logits[0]
        cap = tap.pop()
    mask = torch.arange(ids.numel()) >= PROMPT
    return TappedRecord(
        Record(ids, mask, cap.aux[0], cap.final[0]),
        policy_version=0,
        step=0,
        arrival=arrival,
        logit_lse=torch.logsumexp(logits, -1) if lse else None,
        topk_ids=logits.topk(3, -1).indices if topk else None,
    )


@pytest.fixture(scope="module")
def samples(target_samples):
    return target_samples[:6, :24]  # six T = 1 target samples, 4 prompt + 20 response tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lse", [True, False])
def test_full_vocab_equals_alpha_table(target, draft_random64, samples, mode, temperature, lse):
    """Draft vocab = target vocab: the tapped final state and lm_head give the target's own logits."""
    embed = decoder_parts(target)[0]
    rows = head_rows(target, draft_random64.draft_to_target)
    for ids in samples[:3]:
        rec = tap_record(target, ids, draft_random64.cfg.aux_layer_ids, lse=lse, topk=lse)
        got, valid = record_alpha(draft_random64, embed, rows, rec, 3, mode, temperature)
        want, want_valid = alpha_table(target, draft_random64, ids, PROMPT, 3, mode, temperature)
        assert got.dtype == torch.float32 and valid.dtype == torch.bool
        assert torch.equal(valid, want_valid)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("mode", "temperature"), [(m, 1.0) for m in MODES] + [(m, 0.0) for m in MODES])
def test_partial_vocab_with_lse_equals_alpha_table(target, draft_good48, samples, mode, temperature):
    """With the full-vocab lse (T = 1) and top-1 id (T = 0) the partial vocab is exact too."""
    embed = decoder_parts(target)[0]
    rows = head_rows(target, draft_good48.draft_to_target)
    total = 0.0
    for ids in samples[:3]:
        rec = tap_record(target, ids, draft_good48.cfg.aux_layer_ids)
        got, _ = record_alpha(draft_good48, embed, rows, rec, 3, mode, temperature)
        want, _ = alpha_table(target, draft_good48, ids, PROMPT, 3, mode, temperature)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        total += float(got.sum())
    assert total > 5.0  # a trained draft: not a trivial all-zero agreement


@pytest.mark.parametrize(
    ("mode", "temperature"), [("greedy", 0.0), ("greedy_draft", 1.0), ("probabilistic", 1.0)]
)
def test_partial_vocab_lse_is_below_renormalised(target, draft_good48, samples, mode, temperature):
    embed = decoder_parts(target)[0]
    rows = head_rows(target, draft_good48.draft_to_target)
    below = 0
    for ids in samples:
        exact, valid = record_alpha(
            draft_good48,
            embed,
            rows,
            tap_record(target, ids, draft_good48.cfg.aux_layer_ids),
            3,
            mode,
            temperature,
        )
        renorm, _ = record_alpha(
            draft_good48,
            embed,
            rows,
            tap_record(target, ids, draft_good48.cfg.aux_layer_ids, lse=False, topk=False),
            3,
            mode,
            temperature,
        )
        assert (exact <= renorm + 1e-6).all()
        below += int((exact < renorm - 1e-4)[valid].sum())
    if mode != "greedy":  # the off-vocab mass is positive everywhere; an off-vocab argmax is rare
        assert below > 20


def test_estimate_records_pools_like_estimate(target, draft_good48, samples):
    embed = decoder_parts(target)[0]
    rows = head_rows(target, draft_good48.draft_to_target)
    recs = [
        tap_record(target, ids, draft_good48.cfg.aux_layer_ids, arrival=i) for i, ids in enumerate(samples)
    ]
    for mode in ("greedy_draft", "probabilistic"):
        got = estimate_records(draft_good48, embed, rows, recs, 3, mode, 1.0)
        want = estimate(target, draft_good48, [(ids[:PROMPT], ids[PROMPT:]) for ids in samples], 3, mode, 1.0)
        for key in ("acceptance_length_est", "acceptance_length_all_starts", "rounds_est"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
        for key in ("per_position_est", "per_position_all_starts"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        for key in ("num_starts", "num_tokens", "num_sequences", "k", "verify_mode", "temperature"):
            assert got[key] == want[key], key
        if mode == "greedy_draft":
            assert got["acceptance_length_observed"] == pytest.approx(want["acceptance_length_observed"])
        else:
            assert got["acceptance_length_observed"] is None
        assert got["sequence_ids"] == list(range(len(samples)))
        assert len(got["per_sequence"]) == len(samples)
        # pooled round walk = rounds-weighted per-sequence mean length
        ls = torch.tensor(got["per_sequence"], dtype=torch.float64)
        pooled = float((ls[:, 0] * ls[:, 1]).sum() / ls[:, 1].sum())
        assert pooled == pytest.approx(got["acceptance_length_est"], rel=1e-9)
        assert got["acceptance_length_est"] > 1.25  # the trained draft: well above 1


def test_draft_mode_restored_and_no_grad(target, draft_random64, samples):
    embed = decoder_parts(target)[0]
    rows = head_rows(target, draft_random64.draft_to_target)
    rec = tap_record(target, samples[0], draft_random64.cfg.aux_layer_ids)
    ref, _ = record_alpha(draft_random64, embed, rows, rec, 2, "probabilistic", 1.0)
    draft_random64.train()
    try:
        got, _ = record_alpha(draft_random64, embed, rows, rec, 2, "probabilistic", 1.0)
        assert draft_random64.training  # restored
        assert not got.requires_grad
        assert torch.equal(got, ref)
        estimate_records(draft_random64, embed, rows, [rec], 2, "greedy", 0.0)
        assert draft_random64.training
    finally:
        draft_random64.eval()
    assert not draft_random64.training
    estimate_records(draft_random64, embed, rows, [rec], 2, "greedy", 0.0)
    assert not draft_random64.training


def test_bf16_states_and_prompt_at_zero(target, draft_good48, samples):
    """Records as received (bf16 states) stay close to the fp32 result; a response starting at token 0
    drafts from position 0 (nothing precedes token 0)."""
    embed = decoder_parts(target)[0]
    rows = head_rows(target, draft_good48.draft_to_target)
    rec = tap_record(target, samples[0], draft_good48.cfg.aux_layer_ids)
    r = rec.record
    half = TappedRecord(
        Record(r.input_ids, r.loss_mask, r.aux.bfloat16(), r.final.bfloat16()),
        0,
        0,
        logit_lse=rec.logit_lse,
        topk_ids=rec.topk_ids,
    )
    a32, _ = record_alpha(draft_good48, embed, rows.bfloat16(), rec, 3, "greedy_draft", 1.0)
    a16, _ = record_alpha(draft_good48, embed, rows.bfloat16(), half, 3, "greedy_draft", 1.0)
    assert (a16 - a32).abs().mean() < 0.05
    assert (a16 <= 1.0).all() and (a16 >= 0.0).all()
    full = TappedRecord(Record(r.input_ids, torch.ones_like(r.loss_mask), r.aux, r.final), 0, 0)
    alpha, valid = record_alpha(draft_good48, embed, rows, full, 2, "greedy", 0.0)
    assert alpha.shape == (r.input_ids.numel() - 1, 2)  # starts 0 .. T−2
    want, _ = alpha_table(target, draft_good48, r.input_ids, 1, 2, "greedy", 0.0)
    # without topk the argmax is the draft-vocab one: never below the full-vocab argmax check
    assert (alpha >= want).all()


def test_mismatches_are_refused(target, draft_good48, samples):
    embed = decoder_parts(target)[0]
    rows = head_rows(target, draft_good48.draft_to_target)
    rec = tap_record(target, samples[0], draft_good48.cfg.aux_layer_ids)
    with pytest.raises(RecordEstimateError, match="rows"):
        record_alpha(draft_good48, embed, target.lm_head.weight, rec, 2, "greedy", 0.0)
    with pytest.raises(RecordEstimateError, match="k must be"):
        record_alpha(draft_good48, embed, rows, rec, 0, "greedy", 0.0)
    with pytest.raises(ValueError, match="unknown verify mode"):
        record_alpha(draft_good48, embed, rows, rec, 2, "sampled", 1.0)
    r = rec.record
    narrow = TappedRecord(Record(r.input_ids, r.loss_mask, r.aux[:, :64], r.final), 0, 0)
    with pytest.raises(RecordEstimateError, match="aux width"):
        record_alpha(draft_good48, embed, rows, narrow, 2, "greedy", 0.0)
    none = TappedRecord(Record(r.input_ids, torch.zeros_like(r.loss_mask), r.aux, r.final), 0, 0)
    with pytest.raises(RecordEstimateError, match="no response"):
        estimate_records(draft_good48, embed, rows, [rec, none], 2, "greedy", 0.0)


# ------------------------------------------------------------------------------------------- stats_from
def sent_from(rec: TappedRecord, start: int, *, say: bool = True) -> TappedRecord:
    """``rec`` with its statistics sent only from ``start`` on (0 before), as the HF Tap sends them;
    ``say=False``: the zeros without saying so (stats_from 0), a lying sender."""

    def cut(x):
        if x is None:
            return None
        y = x.clone()
        y[:start] = 0
        return y

    return TappedRecord(
        rec.record,
        rec.policy_version,
        rec.step,
        arrival=rec.arrival,
        logit_lse=cut(rec.logit_lse),
        topk_ids=cut(rec.topk_ids),
        stats_from=start if say else 0,
    )


@pytest.mark.parametrize(
    ("mode", "temperature"),
    [("greedy", 0.0), ("greedy_draft", 1.0), ("probabilistic", 1.0), ("probabilistic", 0.7)],
)
def test_statistics_from_the_response_give_the_same_estimate(
    target, draft_good48, samples, mode, temperature
):
    """Statistics only from the position before the first response token (the HF Tap) or from the first
    response token: the very same estimate as with statistics at every position (the old senders' records),
    so nothing the estimate reads was dropped; starting one later changes it, and is refused."""
    embed = decoder_parts(target)[0]
    rows = head_rows(target, draft_good48.draft_to_target)
    full = [
        tap_record(target, ids, draft_good48.cfg.aux_layer_ids, arrival=i) for i, ids in enumerate(samples)
    ]
    want = estimate_records(draft_good48, embed, rows, full, 3, mode, temperature)
    for start in (PROMPT - 1, PROMPT):
        got = estimate_records(
            draft_good48, embed, rows, [sent_from(r, start) for r in full], 3, mode, temperature
        )
        assert repr(got) == repr(want), start  # every number, NaN included
    late = [sent_from(r, PROMPT + 1) for r in full]
    if mode == "probabilistic" and temperature != 1.0:
        return  # at T ≠ 1 neither logit_lse nor topk_ids is read
    lying = estimate_records(
        draft_good48, embed, rows, [sent_from(r, PROMPT + 1, say=False) for r in full], 3, mode, temperature
    )
    assert lying["per_sequence"] != want["per_sequence"]  # zeros read as statistics would change the estimate
    with pytest.raises(RecordEstimateError, match="statistics start at 5, after position 4"):
        estimate_records(draft_good48, embed, rows, late, 3, mode, temperature)


# ---------------------------------------------------------------------------------------------- paired gate
def test_paired_gate_on_real_drafts(target, draft_good48, draft_random48, samples):
    embed = decoder_parts(target)[0]
    rows = head_rows(target, draft_good48.draft_to_target)
    recs = [
        tap_record(target, ids, draft_good48.cfg.aux_layer_ids, arrival=i) for i, ids in enumerate(samples)
    ]
    good = estimate_records(draft_good48, embed, rows, recs, 3, "greedy_draft", 1.0)
    rows_r = head_rows(target, draft_random48.draft_to_target)
    bad = estimate_records(draft_random48, embed, rows_r, recs, 3, "greedy_draft", 1.0)
    assert paired_gate(good, good, 0.0) == (True, 0.0, 0.0)
    ok, diff, se = paired_gate(good, bad, 0.02)
    assert ok and diff > 0.3
    ok, diff2, _ = paired_gate(bad, good, 0.02)
    assert not ok and diff2 == pytest.approx(-diff)
