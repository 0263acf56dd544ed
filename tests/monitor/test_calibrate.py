"""Calibration on the reference decoder standing in for an engine: its outputs and tallies in, the measured
acceptance, the estimator's round walk on the same outputs and their gap out."""

import math

import pytest
import torch

from draft_align.acceptance import AcceptanceTally
from draft_align.engines.reference.specdec import SpecDecoder
from draft_align.monitor.calibrate import calibrate
from draft_align.monitor.estimator import estimate

K = 3


@pytest.fixture(scope="module")
def engine_run(target, draft_good48):
    """An "engine" run at T = 0: each prompt decoded by the lossless reference decoder, counters summed."""
    prompts = torch.randint(0, 64, (6, 4), generator=torch.Generator().manual_seed(3)).tolist()
    dec = SpecDecoder(target, draft_good48, K, "greedy_draft", 0.0)
    measured, outputs = AcceptanceTally.empty(K), []
    for p in prompts:
        new, tally = dec.generate(torch.tensor(p), 24)
        outputs.append(new.tolist())
        measured.merge(tally)
    return prompts, outputs, measured


def test_calibrate_reports_the_engine_and_the_round_walk(target, draft_good48, engine_run):
    prompts, outputs, measured = engine_run
    res = calibrate(target, draft_good48, prompts, outputs, measured, temperature=0.0, generate_seconds=1.5)
    seqs = [(torch.tensor(p), torch.tensor(o)) for p, o in zip(prompts, outputs, strict=True)]
    est = estimate(target, draft_good48, seqs, K, "greedy_draft", 0.0)
    assert (res["k"], res["mode"], res["temperature"], res["num_prompts"]) == (K, "greedy_draft", 0.0, 6)
    assert res["num_tokens"] == sum(len(o) for o in outputs) and res["generate_seconds"] == 1.5
    assert res["measured"] == measured.mean_length() and res["measured_rounds"] == int(measured.rounds)
    assert res["measured_per_position"] == measured.per_position()
    assert res["est"] == est["acceptance_length_est"] and res["observed"] == est["acceptance_length_observed"]
    assert res["all_starts"] == est["acceptance_length_all_starts"] and res["rounds_est"] == est["rounds_est"]
    assert res["rel_gap"] == pytest.approx((res["est"] - res["measured"]) / res["measured"])
    # at T = 0 the round walk sees the engine's own rounds, up to each prompt's last round (≤ k drafts each)
    assert res["measured"] > 1.5
    assert abs(res["observed"] - res["measured"]) * measured.rounds <= K * len(prompts)


def test_calibrate_without_rounds_has_no_gap(target, draft_good48, engine_run):
    prompts, outputs, _ = engine_run
    res = calibrate(target, draft_good48, prompts, outputs, AcceptanceTally.empty(K), temperature=0.0)
    assert math.isnan(res["measured"]) and math.isnan(res["rel_gap"]) and res["measured_rounds"] == 0
