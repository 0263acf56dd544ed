"""The rollout plan, the RolloutEngine interface and the reference engine (lossless SpecDecoder rollouts)."""

import inspect
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_align.acceptance import AcceptanceTally
from draft_align.conventions import DRAFT_KINDS
from draft_align.engines.rollout_types import Decoding
from draft_align.rl.drafts import DraftSource
from draft_align.rl.rollouts import SEED_BITS, ReferenceRollouts, RolloutEngine, plan_given, plan_rollouts

K = 2
EOS = frozenset({2})


def test_plan_is_seeded_group_major_and_splits_the_drafts():
    plan = plan_rollouts(
        seed=3, step=5, num_prompts=10, prompts_per_step=3, group_size=4, frozen_fraction=0.25
    )
    assert plan == plan_rollouts(3, 5, 10, 3, 4, 0.25) and plan != plan_rollouts(3, 6, 10, 3, 4, 0.25)
    assert [p.index for p in plan.rollouts] == list(range(12))
    prompts = [p.prompt_index for p in plan.rollouts]
    groups = [prompts[i : i + 4] for i in range(0, 12, 4)]
    assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == 3  # distinct prompts
    assert sum(p.draft == "frozen" for p in plan.rollouts) == 3  # round(0.25 · 12)
    # the same draws as the job has always made: sample prompts, sample the frozen set, then the seeds
    rng = random.Random("grpo:3:5")
    chosen = rng.sample(range(10), 3)
    frozen = set(rng.sample(range(12), 3))
    assert [g[0] for g in groups] == chosen
    assert {p.index for p in plan.rollouts if p.draft == "frozen"} == frozen
    assert plan.seeds(63) == [rng.getrandbits(63) for _ in range(12)] == plan.seeds(63)
    assert all(p.draft == "adapted" for p in plan_rollouts(3, 5, 10, 3, 4, 0.0).rollouts)


def test_plan_given_keeps_the_prompt_order_and_splits_the_drafts():
    plan = plan_given(seed=3, step=5, num_rollouts=8, frozen_fraction=0.5)
    assert plan == plan_given(3, 5, 8, 0.5) and plan != plan_given(3, 6, 8, 0.5)
    assert [(p.index, p.prompt_index) for p in plan.rollouts] == [(i, i) for i in range(8)]
    assert sum(p.draft == "frozen" for p in plan.rollouts) == 4
    assert all(p.draft == "frozen" for p in plan_given(0, 0, 3, 1.0).rollouts)
    with pytest.raises(ValueError, match="frozen_fraction"):
        plan_given(0, 0, 3, 1.5)
    with pytest.raises(ValueError, match="num_rollouts"):
        plan_given(0, 0, 0, 0.5)


def test_both_engines_have_the_protocol_members():
    from draft_align.engines.vllm.vllm_rollouts import VLLMRollouts

    members = [
        n
        for n, v in vars(RolloutEngine).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, property))
    ]
    assert set(members) == {"adapted", "prepare", "rollouts", "prefetch", "step_metrics", "shutdown"}
    from draft_align.engines.vllm.server_rollouts import ServerRollouts

    for impl in (ReferenceRollouts, VLLMRollouts, ServerRollouts):
        for name in members:
            want, got = getattr(RolloutEngine, name), getattr(impl, name)
            assert isinstance(got, property) == isinstance(want, property), (impl, name)
            if not isinstance(want, property):
                assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), (
                    impl,
                    name,
                )


@pytest.fixture
def reference(tiny_world, tiny_env, tmp_path, frozen_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_world.model, dtype=torch.float32)
    drafts = DraftSource(tmp_path / "run", frozen_dir)
    return ReferenceRollouts(model, drafts, K, "greedy_draft"), model


def test_reference_rollouts_follow_the_plan(reference, kit, target_config):
    engine, model = reference
    prompts = [torch.tensor([1, 40, 41, 42]), torch.tensor([1, 50, 51]), torch.tensor([1, 60])]
    plan = plan_rollouts(seed=0, step=0, num_prompts=3, prompts_per_step=2, group_size=2, frozen_fraction=0.5)
    assert engine.prepare(model, 0, None) == {} and engine.adapted is None
    out, tallies = engine.rollouts(plan, prompts, Decoding(1.0, 6, EOS))
    again, _ = engine.rollouts(plan, prompts, Decoding(1.0, 6, EOS))
    assert [r.response.tolist() for r in out] == [r.response.tolist() for r in again]  # seeded per rollout
    assert [(r.prompt_index, r.draft) for r in out] == [(p.prompt_index, p.draft) for p in plan.rollouts]
    for r in out:
        assert r.prompt.tolist() == prompts[r.prompt_index].tolist() and r.engine_logprobs is None
        assert 1 <= r.response.numel() <= 6 and r.finished == (int(r.response[-1]) in EOS)
        assert r.reward == 0.0 and r.tally.k == K  # the job scores the rollouts
    assert set(tallies) == set(DRAFT_KINDS)
    for kind in DRAFT_KINDS:
        want = AcceptanceTally.empty(K)
        for r in out:
            if r.draft == kind:
                want.merge(r.tally)
        assert tallies[kind] == want and want.rounds > 0
    # each rollout is the decoder's output for its own seed
    from draft_align.engines.reference.specdec import SpecDecoder

    p = plan.rollouts[1]
    dec = SpecDecoder(
        model, engine.drafts.adapted if p.draft == "adapted" else engine.drafts.frozen, K, "greedy_draft", 1.0
    )
    gen = torch.Generator().manual_seed(plan.seeds(SEED_BITS)[1])
    new, tally = dec.generate(prompts[p.prompt_index], 6, EOS, gen)
    assert new.tolist() == out[1].response.tolist() and tally == out[1].tally
    assert engine.step_metrics(out, torch.zeros(0)) == {}


def test_reference_engine_serves_what_the_source_holds(reference, kit, target_config):
    engine, _ = reference
    kit.publish(kit.make(target_config, seed=21), engine.drafts.run_dir, target_config, 1, 4)
    assert engine.drafts.poll()
    assert engine.adapted is engine.drafts.adapted_version and engine.adapted.policy_version == 4


def test_probe_guard_follows_the_recipe_and_zero_prompts_turn_it_off():
    from draft_align.config import RLGuardConfig
    from draft_align.rl.build import probe_guard

    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6])]
    guard = probe_guard(RLGuardConfig(probe_prompts=2, probe_tokens=8, min_ratio=0.25), prompts)
    assert guard is not None
    assert guard.prompts == ({"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]})
    assert (guard.max_tokens, guard.min_ratio) == (8, 0.25)
    assert probe_guard(RLGuardConfig(probe_prompts=0), prompts) is None
    assert probe_guard(RLGuardConfig(probe_prompts=0), []) is None
    with pytest.raises(ValueError, match="no probe prompts"):
        probe_guard(RLGuardConfig(probe_prompts=4), [])
