"""Is vLLM's T = 1 speculative sampling lossless on vLLM's CPU build, in both of its draft sampling modes?

The RL job trains the policy on vLLM's samples: speculative decoding may only change speed, never what is
sampled.  Each test draws ``N_SAMPLES`` independent 3-token continuations of one chat prompt from a running
engine (fp32, the tiny vLLM world of tests/engines/conftest.py, EAGLE-3 at k = 3) and compares them with the exact
distribution of the same target run by HF in fp32 (tests.helpers.exact_three: every 2-token context, V² = 103²
forwards): Pearson χ² of each token's marginal at p = 1e-3, and the z-score of how often tokens 2 and 3 are
their context's greedy token (the statistic a bias towards the draft moves most).  Tokens 2 and 3 come out of
vLLM's rejection sampler: the draft proposes them after the first.

Power: the same statistics reject a rejection sampler whose uniforms are all 0 (it accepts every proposal,
the classic "the draft decides" bug), so a pass means something.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from draft_align.engines.rollout_types import DraftVersion
from draft_align.engines.vllm.counters import SpecCounters
from draft_align.engines.vllm.start import EngineError
from draft_align.engines.vllm.verify_choice import MARGIN_SE
from draft_align.publish.versions import version_dir
from tests.engines.conftest import ENGINE_K, QUESTIONS
from tests.helpers import distribution_stats, exact_three

N_SAMPLES = 2000
TEMPERATURE = 1.0
Z_CRIT = 3.29  # two-sided p = 1e-3
QUESTION = QUESTIONS[1]


@pytest.fixture(scope="module")
def stat_prompt(vllm_world) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_world.target)
    text = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def exact(vllm_world, stat_prompt) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(vllm_world.target, torch_dtype=torch.float32).eval()
    return exact_three(target, stat_prompt, TEMPERATURE)


@contextmanager
def serving(vllm_world, draft_sample_method: str | None) -> Iterator[Any]:
    """An eager fp32 engine on the tiny target on one thread: plain (None) or drafting with run/v0001."""
    from draft_align.engines.vllm.start import start_engine, start_plain_engine, stop_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    kw = dict(max_model_len=256, dtype="float32", enforce_eager=True, seed=7)
    try:
        if draft_sample_method is None:
            llm = start_plain_engine(str(vllm_world.target), **kw)
        else:
            llm = start_engine(
                str(vllm_world.target),
                version_dir(vllm_world.run, 1),
                k=ENGINE_K,
                draft_sample_method=draft_sample_method,
                **kw,
            )  # type: ignore[arg-type]
        try:
            yield llm
        finally:
            stop_engine(llm)
            del llm
            gc.collect()
    finally:
        torch.set_num_threads(threads)


def sample_three(llm, prompt: list[int]) -> tuple[torch.Tensor, SpecCounters]:
    """``N_SAMPLES`` independent 3-token continuations of ``prompt`` [n, 3], and the counters they moved."""
    import vllm

    params = vllm.SamplingParams(temperature=TEMPERATURE, max_tokens=3, ignore_eos=True)
    before = SpecCounters.snapshot(llm)
    outs = llm.generate([{"prompt_token_ids": prompt}] * N_SAMPLES, params, use_tqdm=False)
    tokens = torch.tensor([list(o.outputs[0].token_ids) for o in outs])
    assert tokens.shape == (N_SAMPLES, 3)
    return tokens, SpecCounters.snapshot(llm) - before


def assert_lossless(tokens: torch.Tensor, ex: dict[str, Any]) -> None:
    chi2, z = distribution_stats(tokens, ex)
    for i, (stat, crit) in enumerate(chi2):
        assert stat < crit, f"token {i + 1}: χ² {stat:.1f} ≥ {crit:.1f}"
    assert all(abs(zi) < Z_CRIT for zi in z), f"greedy-token z-scores {z}"


def test_exact_distribution_has_room_for_a_bias(exact):
    """The prompt is not near-deterministic: tokens 2 and 3 are their greedy token often, but not always."""
    assert all(0.3 < p < 0.95 for p in exact["p_greedy"]), exact["p_greedy"]


def test_plain_engine_samples_the_target(vllm_world, vllm_env, stat_prompt, exact):
    with serving(vllm_world, None) as llm:
        tokens, _ = sample_three(llm, stat_prompt)
    assert_lossless(tokens, exact)


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_speculative_engine_samples_the_target(vllm_world, vllm_env, stat_prompt, exact, method):
    with serving(vllm_world, method) as llm:
        tokens, counters = sample_three(llm, stat_prompt)
    # the draft proposed tokens 2-4 of every request, and both verdicts happened often
    assert counters.num_drafts >= N_SAMPLES
    assert 0.1 * counters.num_draft_tokens < counters.num_accepted_tokens < 0.9 * counters.num_draft_tokens
    assert_lossless(tokens, exact)


def test_distribution_test_rejects_an_accept_always_sampler(
    monkeypatch, vllm_world, vllm_env, stat_prompt, exact
):
    """Uniforms of 0 make vLLM's rejection sampler accept every proposal: the test must see it."""
    import vllm.v1.sample.rejection_sampler as rs

    monkeypatch.setattr(
        rs,
        "generate_uniform_probs",
        lambda num_tokens, *_a, **_k: torch.zeros(num_tokens, dtype=torch.float64),
    )
    with serving(vllm_world, "greedy") as llm:
        tokens, counters = sample_three(llm, stat_prompt)
    assert counters.num_accepted_tokens == counters.num_draft_tokens  # the patch reached the sampler
    chi2, z = distribution_stats(tokens, exact)
    assert max(z) > 2 * Z_CRIT or chi2[1][0] > 4 * chi2[1][1], (chi2, z)


# ------------------------------------------------------------------ switching in place, and rl.engine.verify_mode=auto
def rates(counters: SpecCounters) -> tuple[float, float]:
    """(acceptance rate of draft tokens, its standard error) over ``counters``."""
    n = counters.num_draft_tokens
    p = counters.num_accepted_tokens / n
    return p, (p * (1 - p) / n) ** 0.5


def rpc_probabilistic_flag(worker) -> bool:
    """(in the worker) Whether the proposer samples from q and hands q to the rejection sampler."""
    from draft_align.engines.vllm.worker_rpc import PROBABILISTIC_FLAG

    return getattr(worker.model_runner.drafter, PROBABILISTIC_FLAG)


def test_verify_mode_switches_in_place_and_stays_lossless(vllm_world, vllm_env, stat_prompt, exact):
    """greedy → probabilistic → greedy in one running engine: the acceptance rate moves with the mode (far past
    its noise) and returns, and the switched engine still samples the target."""
    from draft_align.engines.vllm.vllm_rollouts import VLLMRollouts

    with serving(vllm_world, "greedy") as llm:
        eng = VLLMRollouts(
            str(vllm_world.target),
            DraftVersion.read(version_dir(vllm_world.run, 1)),
            k=ENGINE_K,
            llm=llm,
            verify_mode="greedy_draft",
        )
        measured = {}
        for step, mode in enumerate(("greedy_draft", "probabilistic", "greedy_draft")):
            eng.set_verify_mode(mode)
            flag = llm.collective_rpc(rpc_probabilistic_flag)[0]
            assert flag is (mode == "probabilistic")
            tokens, counters = sample_three(llm, stat_prompt)
            measured[(step, mode)] = rates(counters)
            if mode == "probabilistic":
                assert_lossless(tokens, exact)
    (g0, se0), (p1, se1), (g2, se2) = measured.values()
    assert abs(p1 - g0) > 4 * (se0**2 + se1**2) ** 0.5, measured
    assert abs(g2 - g0) < 4 * (se0**2 + se2**2) ** 0.5, measured


def test_auto_verify_mode_measures_both_and_serves_the_better(vllm_world, vllm_env, stat_prompt, exact):
    from draft_align.engines.rollout_types import Decoding, PlannedRollout, RolloutPlan
    from draft_align.engines.vllm.refresher import ProbeGuard
    from draft_align.engines.vllm.vllm_rollouts import VLLMRollouts

    guard = ProbeGuard(({"prompt_token_ids": stat_prompt},) * 8, max_tokens=24)
    with serving(vllm_world, "greedy") as llm:
        with pytest.raises(EngineError, match="probe guard"):
            VLLMRollouts(
                str(vllm_world.target),
                DraftVersion.read(version_dir(vllm_world.run, 1)),
                k=ENGINE_K,
                llm=llm,
                verify_mode="auto",
            )
        eng = VLLMRollouts(
            str(vllm_world.target),
            DraftVersion.read(version_dir(vllm_world.run, 1)),
            k=ENGINE_K,
            llm=llm,
            verify_mode="auto",
            guard=guard,
        )
        assert eng.verify_mode == "greedy_draft" and eng.verify_choice is None
        plan = RolloutPlan(
            tuple(PlannedRollout(i, 0, "frozen") for i in range(4)), random.Random(3).getstate()
        )
        prompt = torch.tensor(stat_prompt)
        eng.rollouts(plan, [prompt], Decoding(0.0, 8, frozenset({2})))
        assert eng.verify_choice is None  # T = 0: vLLM verifies by argmax whatever the mode
        eng.rollouts(plan, [prompt], Decoding(TEMPERATURE, 8, frozenset({2})))
        c = eng.verify_choice
        assert c is not None and set(c.length) == {"greedy_draft", "probabilistic"}
        assert all(
            r >= 8 * 23 / (ENGINE_K + 1) for r in c.rounds.values()
        )  # every probe prompt decoded per mode
        best = max(c.length, key=c.length.get)
        past_noise = (
            abs(c.length["probabilistic"] - c.length["greedy_draft"])
            > MARGIN_SE * (c.se["probabilistic"] ** 2 + c.se["greedy_draft"] ** 2) ** 0.5
        )
        assert c.mode == (best if past_noise else "greedy_draft")
        assert eng.verify_mode == c.mode
        m = eng.metrics()
        assert m["verify_probabilistic"] == float(c.mode == "probabilistic")
        assert m["verify_measured_L_probabilistic"] == c.length["probabilistic"]
        eng.rollouts(plan, [prompt], Decoding(TEMPERATURE, 8, frozenset({2})))
        assert eng.verify_choice is c  # same draft, same temperature: not measured again
        eng.offer(DraftVersion.read(version_dir(vllm_world.run, 3)))  # a new adapted draft
        eng.rollouts(plan, [prompt], Decoding(TEMPERATURE, 8, frozenset({2})))
        assert eng.verify_choice is c  # verify_recheck_every = 0: measured once
        eng.verify_recheck_every = 1
        eng.rollouts(plan, [prompt], Decoding(TEMPERATURE, 8, frozenset({2})))
        assert eng.verify_choice is not c and eng.verify_choice.draft.endswith("v0003")  # the adapted one
        tokens, _ = sample_three(llm, stat_prompt)
    assert_lossless(tokens, exact)
