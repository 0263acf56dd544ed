import json

import pytest
import torch

from draft_align.engines.reference.reference_eval import evaluate
from draft_align.monitor.evaluate import format_table

PROMPTS = [torch.tensor([5, 17, 33]), torch.tensor([1, 9, 40, 22, 7, 63]), torch.tensor([12, 0, 31, 31])]


@pytest.fixture(scope="module")
def results(target, draft_good48):
    common = dict(k=3, max_new_tokens=24, seed=0)
    return [
        evaluate(target, None, draft_good48, PROMPTS, mode="greedy", temperature=0.0, **common),
        evaluate(target, None, draft_good48, PROMPTS, mode="greedy_draft", temperature=1.0, **common),
        evaluate(target, None, draft_good48, PROMPTS, mode="probabilistic", temperature=0.7, **common),
    ]


def test_evaluate_t0_estimate_matches_measured(results):
    r = results[0]
    assert (r["verify_mode"], r["temperature"], r["k"], r["num_prompts"]) == ("greedy", 0.0, 3, 3)
    assert r["rounds_est"] == r["rounds_measured"]
    # the estimate misses only drafts each prompt's last round accepted past the limit: ≤ k per prompt
    gap = (r["acceptance_length_measured"] - r["acceptance_length_est"]) * r["rounds_measured"]
    assert -1e-9 <= gap <= 3 * 3
    assert r["acceptance_length_observed"] == pytest.approx(r["acceptance_length_est"])
    assert r["acceptance_length_measured"] > 1.5
    assert r["num_tokens"] <= 3 * 24
    assert r["seconds"] >= r["seconds_decode"] > 0


def test_evaluate_t1_observed_matches_measured(results):
    r = results[1]
    gap = (r["acceptance_length_measured"] - r["acceptance_length_observed"]) * r["rounds_measured"]
    assert -1e-9 <= gap <= 3 * 3
    assert 1.0 < r["acceptance_length_est"] < 1.0 + 3
    assert results[2]["acceptance_length_observed"] is None


def test_evaluate_is_json_and_tabulates(results):
    back = json.loads(json.dumps(results))
    assert back[0]["per_position_measured"] == results[0]["per_position_measured"]
    table = format_table(results)
    lines = table.splitlines()
    assert len(lines) == 2 + len(results)
    assert lines[0].split()[:6] == ["mode", "T", "k", "est", "all-starts", "measured"]
    assert "r3 meas/est" in lines[0]
    row = lines[2].split()
    assert row[:3] == ["greedy", "0", "3"]
    assert row[5] == f"{results[0]['acceptance_length_measured']:.3f}"
    m, e = results[0]["per_position_measured"][0], results[0]["per_position_est"][0]
    assert row[6] == f"{m:.3f}/{e:.3f}"
    assert lines[3].split()[:2] == ["greedy_draft", "1"]
