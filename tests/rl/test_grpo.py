"""The GRPO job: steps with a fake tap and sink, draft pickup between steps, merged policy, bad settings,
the real PolicyTap, and the engine as the one source of which draft served."""

import contextlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draft_align import data
from draft_align.acceptance import AcceptanceTally
from draft_align.config import (
    CotrainRecipe,
    PolicyLoraConfig,
    RLConfig,
    RLEngineConfig,
    RLPolicyConfig,
    RLTaskConfig,
)
from draft_align.rl.drafts import DraftSource
from draft_align.rl.grpo import GRPOJob
from draft_align.rl.loss import GRPOError
from draft_align.rl.policy import Policy, Sequences
from draft_align.rl.prompts import build_prompts, make_kl_sequences
from draft_align.wire.messages import StepReport
from tests.helpers import ListSink

EOS = {2}
K = 2
REQUIRED = {
    "step",
    "policy_version",
    "reward_mean",
    "reward_std",
    "kl_to_initial",
    "accept_measured_adapted",
    "accept_measured_frozen",
    "accept_r0_adapted",
    "accept_r1_adapted",
    "accept_r0_frozen",
    "accept_r1_frozen",
    "draft_version",
    "draft_policy_version",
    "staleness",
    "rollout_tokens",
    "rollout_s",
    "logprob_s",
    "tap_s",
    "update_s",
    "kl_s",
    "tap_tokens_seen",
    "draft_poll_s",
}


# ---------------------------------------------------------------- fakes and setup
class FakeTap:
    """List-backed PolicyTap: records every call in order."""

    def __init__(self):
        self.events = []
        self.submits = []
        self.inside = False

    def head_sync(self, policy_version, draft_to_target):
        self.events.append(("head_sync", policy_version))
        self.d2t = draft_to_target.clone()
        return True

    @contextlib.contextmanager
    def capturing(self):
        self.events.append(("enter",))
        self.inside = True
        try:
            yield self
        finally:
            self.inside = False
            self.events.append(("exit",))

    def submit(self, *, input_ids, attention_mask, loss_mask, logits, policy_version, step, temperature):
        assert self.inside
        self.events.append(("submit", policy_version, step))
        self.submits.append(
            dict(
                input_ids=input_ids.clone(),
                attention_mask=attention_mask.clone(),
                loss_mask=loss_mask.clone(),
                logits_shape=tuple(logits.shape),
                step=step,
                temperature=temperature,
            )
        )

    def end_step(self):
        self.events.append(("end_step",))
        return sum(int(s["attention_mask"].sum()) for s in self.submits)

    def stats(self):
        return {"tokens_seen": sum(int(s["attention_mask"].sum()) for s in self.submits)}


@pytest.fixture
def world(tiny_world, tiny_env, tmp_path, frozen_dir):
    tok = AutoTokenizer.from_pretrained(tiny_world.model)
    convs = data.load_conversations(str(tiny_world.data))
    prompts = build_prompts(tok, convs, n=6, max_prompt_tokens=60)

    def make(frozen_fraction=0.5, steps=2, **policy_kw):
        model = AutoModelForCausalLM.from_pretrained(tiny_world.model, dtype=torch.float32)
        rl = RLConfig(
            steps=steps,
            task=RLTaskConfig(
                prompts_per_step=2, group_size=2, max_new_tokens=6, temperature=1.0, reward="uppercase"
            ),
            policy=RLPolicyConfig(
                **{"lr": 2e-2, "micro_batch": 3, "lora": PolicyLoraConfig(rank=4, alpha=8), **policy_kw}
            ),
            engine=RLEngineConfig(spec_k=K, frozen_fraction=frozen_fraction),
        )
        recipe = CotrainRecipe(run="rltest", output_dir=str(tmp_path), seed=3, rl=rl)
        policy = Policy.from_config(model, rl.policy.lora, seed=0)
        kl_seqs = make_kl_sequences(policy, prompts[:2], max_new_tokens=5, eos_ids=EOS, seed=0)
        drafts = DraftSource(recipe.run_dir, frozen_dir)
        tap, sink = FakeTap(), ListSink()
        job = GRPOJob(
            rl, policy, tok, prompts, kl_seqs, drafts, tap, sink, recipe.run_dir, EOS, seed=3, run_id="rltest"
        )
        return job, tap, sink

    return make


def expected_tally(rollouts, kind):
    t = AcceptanceTally.empty(K)
    for r in rollouts:
        if r.draft == kind:
            t.merge(r.tally)
    return t


# ---------------------------------------------------------------- the job
def test_two_steps_with_fake_tap_and_sink(world):
    job, tap, sink = world()
    before = [p.detach().clone() for p in job.policy.trainable_parameters()]
    again, _ = job.rollouts(0)  # seeded: the step's rollouts are reproducible
    rollouts, metrics = [], []
    for _ in range(2):
        metrics.append(job.step())
        rollouts.append(job.last_rollouts)
    assert [r.response.tolist() for r in again] == [r.response.tolist() for r in rollouts[0]]

    # the tap: HeadSync once per policy version before its batches; submits inside capturing; end_step
    n_mb = 2  # 4 rollouts in micro-batches of 3
    per_step = [("enter",), *[("submit",)] * n_mb, ("exit",), ("end_step",)]
    assert [e[:1] for e in tap.events] == [("head_sync",), *per_step, ("head_sync",), *per_step]
    assert [e for e in tap.events if e[0] == "head_sync"] == [("head_sync", 0), ("head_sync", 1)]
    assert [e[1:] for e in tap.events if e[0] == "submit"] == [(0, 0), (0, 0), (1, 1), (1, 1)]
    assert torch.equal(tap.d2t, job.drafts.frozen.draft_to_target)
    for step in (0, 1):
        subs = [s for s in tap.submits if s["step"] == step]
        rows = [(s, b) for s in subs for b in range(s["input_ids"].shape[0])]
        assert len(rows) == 4
        for (s, b), r in zip(rows, rollouts[step], strict=True):
            assert s["temperature"] == 1.0 and s["logits_shape"][2] == 103
            p, n = r.prompt.numel(), r.prompt.numel() + r.response.numel()
            width = s["input_ids"].shape[1]
            assert s["input_ids"][b, :n].tolist() == r.prompt.tolist() + r.response.tolist()
            assert s["attention_mask"][b].tolist() == [1] * n + [0] * (width - n)  # right-padded
            assert s["loss_mask"][b].tolist() == [False] * p + [True] * (n - p) + [False] * (width - n)

    # steps.jsonl: one flushed line per step
    lines = [json.loads(x) for x in (job.run_dir / "rl" / "steps.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and REQUIRED <= set(lines[0])
    assert [x["step"] for x in lines] == [0, 1] and [x["policy_version"] for x in lines] == [1, 2]
    assert job.policy.version == 2
    assert (job.run_dir / "policy" / "v0001" / "adapter_model.safetensors").is_file()
    assert (job.run_dir / "policy" / "v0002" / "adapter_model.safetensors").is_file()
    for x, m, ro in zip(lines, metrics, rollouts, strict=True):
        assert {k: v for k, v in x.items() if k != "time"} == m
        rewards = torch.tensor([r.reward for r in ro])
        assert m["reward_mean"] == pytest.approx(float(rewards.mean()))
        assert m["rollout_tokens"] == sum(r.response.numel() for r in ro)
        assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["clip_frac"] == 0.0  # old = current
        assert m["kl_to_initial"] > 0 and m["staleness"] == m["step"]  # no publish: draft policy version 0
        assert m["draft_version"] == 0 and m["tap_tokens_accepted"] > 0
        # measured acceptance: frozen = adapted (same draft) and both groups counted
        assert m["rollouts_adapted"] == m["rollouts_frozen"] == 2
        for kind in ("adapted", "frozen"):
            t = expected_tally(ro, kind)
            assert t.rounds > 0 and m[f"accept_rounds_{kind}"] == t.rounds
            assert m[f"accept_measured_{kind}"] == pytest.approx(t.mean_length())
            assert m[f"accept_r0_{kind}"] == pytest.approx(t.per_position()[0])
            assert 1.0 <= m[f"accept_measured_{kind}"] <= 1.0 + K
    assert lines[1]["kl_to_initial"] != lines[0]["kl_to_initial"]
    assert any(x["reward_std"] > 0 for x in lines)  # a learning signal existed ...
    after = job.policy.trainable_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))  # ... and moved LoRA

    # the sink: one StepReport per step, valid on the wire
    assert [type(m) for m in sink.messages] == [StepReport, StepReport]
    for rep, m in zip(sink.messages, metrics, strict=True):
        assert (rep.run_id, rep.step, rep.policy_version) == ("rltest", m["step"], m["policy_version"])
        assert rep.metrics == m
        assert StepReport.from_frames(rep.to_frames(None), None).metrics == m


def test_job_uses_newly_published_draft_between_steps(world, kit, target_config):
    job, _, _ = world(frozen_fraction=0.0)
    m0 = job.step()
    assert m0["draft_version"] == 0 and m0["rollouts_frozen"] == 0 and m0["accept_measured_frozen"] is None
    kit.publish(
        kit.make(target_config, seed=21), job.run_dir, target_config, draft_version=1, policy_version=1
    )
    m1 = job.step()
    assert (m1["draft_version"], m1["draft_policy_version"], m1["staleness"], m1["draft_refreshed"]) == (
        1,
        1,
        0,
        1,
    )
    assert job.drafts.adapted is not job.drafts.frozen


def test_run_saves_merged_policy_and_kl_penalty(world):
    job, _, _ = world(steps=1, kl_coef=0.1, save_merged_at=[0])
    (m,) = job.run()
    # at rollout time the policy is the initial one: the k3 penalty is exactly 0 on the first step
    assert m["kl_penalty"] == 0.0
    merged = job.run_dir / "policy_merged" / "v0001"
    assert (merged / "model.safetensors").is_file() and (merged / "tokenizer_config.json").is_file()


def test_job_rejects_bad_configuration(world):
    job, tap, sink = world()
    args = (job.rl, job.policy, job.tokenizer)
    rest = (job.kl_sequences, job.drafts, tap, sink, job.run_dir, EOS)
    run = {"seed": job.seed, "run_id": job.run_id}
    with pytest.raises(GRPOError, match="no RL prompts"):
        GRPOJob(*args, [], *rest, **run)
    with pytest.raises(GRPOError, match=r"rl\.task\.prompts_per_step=2 must be in 1\.\.1"):
        GRPOJob(*args, job.prompts[:1], *rest, **run)
    with pytest.raises(GRPOError, match="non-empty 1-D"):
        GRPOJob(*args, [torch.tensor([], dtype=torch.long), job.prompts[0]], *rest, **run)
    bad = RLConfig(task=RLTaskConfig(reward="nope"))
    with pytest.raises(ValueError, match="unknown reward"):
        GRPOJob(bad, job.policy, job.tokenizer, job.prompts, *rest, **run)


def test_real_policy_tap_gets_headsync_and_tap_batches(world):
    from draft_align.tap.hf import HFPolicyTap
    from draft_align.wire.messages import HeadSync, TapBatch, decode

    job, _, _ = world(steps=1)
    sink = ListSink()
    job.tap = HFPolicyTap(job.policy.hf_model, (1, 3, 4), sink, run_id="rltest", tokens_per_step=100_000)
    job.step()
    kinds = [type(m) for m in sink.messages]
    assert kinds[0] is HeadSync and kinds[1:] and set(kinds[1:]) == {TapBatch}
    batch = sink.messages[1]
    rows = Sequences.pack([(r.prompt, r.response) for r in job.last_rollouts], 2)
    got = sorted(batch.input_ids.tensor_split(batch.cu_seqlens[1:-1]), key=lambda t: t.tolist())
    want = sorted(
        (rows.input_ids[b, : int(rows.attention_mask[b].sum())] for b in range(4)), key=lambda t: t.tolist()
    )
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    assert batch.policy_version == 0 and batch.step == 0 and batch.temperature == 1.0
    decode(batch.to_frames(None), None)  # valid on the wire


class RefusingEngine:
    """A RolloutEngine that decodes like the reference one but refuses every offered draft, so the frozen
    draft keeps serving the adapted rollouts (as vLLM does when the probe guard rolls a version back)."""

    def __init__(self, job):
        from draft_align.rl.rollouts import ReferenceRollouts

        self.inner = ReferenceRollouts(job.policy.hf_model, job.drafts, K, job.rl.engine.verify_mode)
        self.offered = []

    @property
    def adapted(self):
        return None

    def prepare(self, policy_model, policy_version, adapted):
        self.offered.append((policy_version, adapted))
        return {"engine_refused": 1.0}

    def rollouts(self, plan, prompts, decoding):
        drafts = self.inner.drafts
        kept, drafts.adapted = drafts.adapted, drafts.frozen
        try:
            return self.inner.rollouts(plan, prompts, decoding)
        finally:
            drafts.adapted = kept

    def prefetch(self, plan, prompts, decoding):
        pass

    def step_metrics(self, rollouts, old_logprobs):
        return {"engine_old_logprob_tokens": float(old_logprobs.numel())}

    def shutdown(self):
        pass


def test_the_engine_says_which_draft_served(world, kit, target_config):
    job, _, _ = world(frozen_fraction=0.0)
    engine = RefusingEngine(job)
    job.engine = engine
    kit.publish(
        kit.make(target_config, seed=21), job.run_dir, target_config, draft_version=1, policy_version=1
    )
    m = job.step()
    # the source took v1 and offered it, but the engine kept the frozen draft: the step reports what served
    assert job.drafts.adapted_version.version == 1 and m["draft_refreshed"] == 1
    assert engine.offered == [(0, job.drafts.adapted_version)]
    assert (m["draft_version"], m["draft_policy_version"], m["staleness"]) == (0, 0, 0)
    assert m["engine_refused"] == 1.0 and m["engine_old_logprob_tokens"] == m["rollout_tokens"]


def test_serve_lags_are_reported_once_per_newly_served_policy_version():
    from types import SimpleNamespace

    job = SimpleNamespace(
        _created={0: 100.0, 1: 130.0, 2: 160.0}, _tapped={0: 110.0, 1: 140.0}, _served_policy_version=-1
    )
    lags = GRPOJob._serve_lags
    assert lags(job, None, 120.0) == {"draft_serve_lag_s": None, "draft_tap_to_serve_s": None}  # frozen only
    assert lags(job, 0, 150.0) == {"draft_serve_lag_s": 50.0, "draft_tap_to_serve_s": 40.0}
    assert lags(job, 0, 180.0) == {"draft_serve_lag_s": None, "draft_tap_to_serve_s": None}  # not new
    assert lags(job, 2, 200.0) == {"draft_serve_lag_s": 40.0, "draft_tap_to_serve_s": None}  # v2 never tapped
    assert job._served_policy_version == 2 and job._created == {} and job._tapped == {}  # pruned as served


def test_step_profile_adds_up_and_reaches_report_and_advise(world):
    """Each step's stages (data, weight sync, generation, log-prob, train, draft refresh, Tap, checkpoint) are
    timed apart and never sum past the step; other is the rest; report.md and advise print them."""
    from draft_align.monitor.advise import advise_run
    from draft_align.monitor.advise_text import format_advice
    from draft_align.monitor.report import write_report
    from draft_align.monitor.step_profile import LABELS, OTHER, STAGES, StepProfile

    job, _, sink = world()
    metrics = [job.step() for _ in range(3)]
    for m, rep in zip(metrics, sink.messages, strict=True):
        p = StepProfile.from_metrics(m)
        assert p.step_s == m["step_s"] and m["stage_step_s"] == m["step_s"]
        assert p.timed_s <= p.step_s  # no stage counted twice
        assert p.timed_s + p.other_s == pytest.approx(p.step_s)
        assert sum(p.share(s) for s in (*STAGES, OTHER)) == pytest.approx(1.0)
        for stage in ("data", "generation", "logprob", "train", "draft_refresh", "tap", "checkpoint"):
            assert m[f"stage_{stage}_s"] > 0, stage
        assert m["stage_weight_sync_s"] == 0.0  # the reference decoder reads the live policy: nothing to sync
        assert m["stage_other_s"] < 0.5 * m["step_s"]  # the timers cover most of the step
        assert m["stage_generation_s"] <= m["rollout_s"] and m["stage_train_s"] == m["update_s"]
        assert rep.metrics["stage_generation_share"] == m["stage_generation_share"]  # in the StepReport
    write_report(job.run_dir)
    report = (job.run_dir / "report.md").read_text()
    assert "## Step profile (seconds and share of the step, measured)" in report
    assert all(LABELS[s] in report for s in (*STAGES, OTHER))
    mean_gen = sum(m["stage_generation_s"] for m in metrics[1:]) / 2
    assert f"| generation | {mean_gen:.3f} |" in report
    a = advise_run(job.run_dir)
    got = {s.name: s.seconds for s in a.profile.stages}
    assert got[LABELS["generation"]] == pytest.approx(mean_gen)
    assert got[LABELS["data"]] == pytest.approx(sum(m["stage_data_s"] for m in metrics[1:]) / 2)
    text = format_advice(a)
    assert f"| {LABELS['draft_refresh']} |" in text and f"| {LABELS['data']} |" in text
