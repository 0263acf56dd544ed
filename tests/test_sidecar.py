"""draft_align.sidecar on the tiny target: ingest → train → gate → publish → notify; bad input, NaNs,
kill -9 (mid-run and mid-publish) and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draft_align.config import CotrainRecipe, load_recipe


class Feeder:
    """The policy side of a test: a tiny HF target, an HFPolicyTap and a TapSender to the sidecar."""

    def __init__(self, recipe: CotrainRecipe, draft_to_target: torch.Tensor, aux: tuple[int, ...]) -> None:
        from transformers import AutoModelForCausalLM

        from draft_align.tap.hf import HFPolicyTap
        from draft_align.wire import channel

        self.recipe = recipe
        self.model = AutoModelForCausalLM.from_pretrained(recipe.target.model, dtype=torch.float32).eval()
        self.key = channel.resolve_key(None, recipe.run_dir, create=True)
        self.sender = channel.TapSender(channel.default_endpoint(recipe.run_dir, "tap"), self.key,
                                        send_timeout_s=0.5)
        self.tap = HFPolicyTap(self.model, aux, self.sender, run_id=recipe.run, tokens_per_step=2000)
        self.d2t = draft_to_target
        from transformers import AutoTokenizer

        from draft_align import data

        tok = AutoTokenizer.from_pretrained(recipe.target.model)
        convs = data.load_conversations(recipe.data.source)
        self.prompts = [data.encode_prompt(tok, c) for c in convs]

    def step(self, step: int, version: int, n: int = 8) -> None:
        """One RL step's worth of taps: the tiny target's own T=1 continuations of chat prompts."""
        from draft_align.hf.generate import generate_responses
        from draft_align.rl.policy import Sequences
        from draft_align.wire.messages import StepReport

        if version != getattr(self, "_synced", -1):
            self.tap.head_sync(version, self.d2t)
            self._synced = version
        prompts = [self.prompts[(step * n + i) % len(self.prompts)] for i in range(n)]
        resp = generate_responses(self.model, prompts, max_new_tokens=24, temperature=1.0, eos_ids={2}, pad_id=2,
                                  batch_size=n, seed=step)
        pairs = [(p, r) for p, r in zip(prompts, resp, strict=True) if r is not None and r.numel() > 0]
        seqs = Sequences.pack(pairs, pad_id=2)
        with torch.no_grad(), self.tap.capturing():
            logits = self.model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
            self.tap.submit(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask, loss_mask=seqs.loss_mask,
                            logits=logits, policy_version=version, step=step, temperature=1.0)
        self.tap.end_step()
        self.sender.offer(StepReport(run_id=self.recipe.run, step=step, policy_version=version,
                                     metrics={"reward_mean": 0.25 * step, "accept_measured_adapted": 1.5}))

    def close(self) -> None:
        self.sender.close()


@pytest.fixture
def sidecar_world(tiny_run, tiny_env, tmp_path):
    from draft_align.sidecar import Sidecar, starting_draft

    recipe = load_recipe(None, tiny_run.cotrain_overrides(tmp_path), CotrainRecipe)
    sc = Sidecar(recipe, starting_draft(recipe))
    feeder = Feeder(recipe, sc.frozen.draft_to_target, sc.aux_ids)
    yield recipe, sc, feeder
    feeder.close()
    sc.close()


def test_ingest_train_gate_publish_notify_and_monitor(sidecar_world, until):
    from draft_align.monitor.live import scrape
    from draft_align.publish.folder import read_manifest
    from draft_align.publish.versions import read_latest
    from draft_align.wire import channel

    recipe, sc, feeder = sidecar_world
    sub = channel.Subscriber(channel.default_endpoint(recipe.run_dir, "notify"), feeder.key)
    feeder.step(0, 0)
    feeder.step(1, 1)
    assert until(lambda: sc.state.monitor_rows >= 2, 20, every=lambda: sc._drain(0.1, 100))
    assert sc.has_head and sc.state.head_policy_version == 1
    assert sc.state.ingested_messages >= 2 and sc.rejected == {}
    # both steps' records reached the buffer after their reports; the newest 6 are held out
    stats = sc.buffer.stats()
    assert stats["records"] == 16 and stats["holdout_records"] == 6
    for _ in range(4):
        assert sc._train_one()
    assert sc.state.train_steps == 4
    time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher
    assert sc.maybe_publish(force=True)
    v1 = recipe.run_dir / "drafts" / "v0001"
    assert read_latest(recipe.run_dir) == v1
    man = read_manifest(v1, verify=True)
    assert man["draft_version"] == 1 and man["policy_version"] == 1
    note = sub.poll(5000)
    assert note is not None and note.draft_version == 1 and note.path == str(v1)
    assert note.sha256 == man["files"]["model.safetensors"]["sha256"]
    rows = [json.loads(x) for x in (sc.dir / "monitor.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["reward_mean"] == 0.25 and rows[1]["accept_measured_adapted"] == 1.5
    for key in ("accept_est_adapted", "accept_est_frozen", "accept_est_adapted_prob", "accept_est_frozen_prob"):
        assert 1.0 <= rows[1][key] <= 1.0 + recipe.sidecar.eval_k
    # before any publish the "adapted" draft is the starting one: both estimates agree exactly
    assert rows[1]["accept_est_adapted"] == rows[1]["accept_est_frozen"]
    metrics = scrape(f"http://127.0.0.1:{sc.prom.port}/metrics")
    assert metrics["draft_align_published_versions"] == 1.0
    assert metrics["draft_align_sidecar_train_steps"] == 4.0
    sub.close()


def test_gate_refuses_a_worse_candidate(sidecar_world, until):
    recipe, sc, feeder = sidecar_world
    feeder.step(0, 0)
    assert until(lambda: sc.state.monitor_rows >= 1, 20, every=lambda: sc._drain(0.1, 100))
    sc.recipe.sidecar.gate_tolerance = 0.0
    assert sc._train_one()
    with torch.no_grad():  # wreck the candidate: it proposes the same token everywhere
        sc.trainer.draft.lm_head.weight.zero_()
        sc.trainer.draft.lm_head.weight[0] = 10.0
    published = sc.maybe_publish(force=True)
    if published:  # only possible if the starting draft were just as bad on these records
        pytest.fail("a collapsed candidate passed the gate")
    assert sc.state.gate_rejections == 1
    assert not (recipe.run_dir / "drafts" / "v0001").exists()


def test_garbage_forged_and_nonfinite_input_is_counted_and_survived(sidecar_world, until):
    import zmq

    from draft_align.wire.messages import encode, pack_sequences

    recipe, sc, feeder = sidecar_world
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(sc.receiver.endpoint)
    raw.send_multipart([b"not json", b"\x00" * 7, b"x" * 32])
    raw.send_multipart([b"{}"])
    h = sc.hidden
    good = {"input_ids": torch.tensor([5, 6, 7, 8]), "loss_mask": torch.tensor([False, True, True, True]),
            "aux_hidden": torch.randn(4, 3 * h), "final_hidden": torch.randn(4, h)}
    bad = {**good, "aux_hidden": good["aux_hidden"].clone()}
    bad["aux_hidden"][2, 5] = float("nan")
    batch = pack_sequences([good, bad, good], run_id=recipe.run, policy_version=0, source_rank=0, batch_id=0,
                           step=0, aux_layer_ids=sc.aux_ids, hidden_size=h, vocab_size=sc.vocab,
                           final_norm="post", temperature=1.0)
    raw.send_multipart(encode(batch, b"k" * 32))  # forged: signed with another key
    raw.send_multipart(encode(batch, feeder.key))
    assert until(lambda: sc.state.ingested_messages >= 1, 10, every=lambda: sc._drain(0.1, 100))
    rej = sc.rejected
    assert rej["mac"] == 2 and rej["frames"] == 1  # 3 garbage frames and the forged batch fail the MAC
    assert sc.state.nonfinite_sequences == 1
    assert sum(len(v) for v in sc.fresh.values()) == 2
    # a batch for another draft (wrong aux layers) is refused as mismatched, not trained on
    other = pack_sequences([good], run_id=recipe.run, policy_version=0, source_rank=0, batch_id=1, step=0,
                           aux_layer_ids=(1, 2, 5), hidden_size=h, vocab_size=sc.vocab, final_norm="post",
                           temperature=1.0)
    raw.send_multipart(encode(other, feeder.key))
    assert until(lambda: sc.state.mismatched_messages == 1, 10, every=lambda: sc._drain(0.1, 100))
    raw.close()
    ctx.term()


def test_nonfinite_loss_skips_the_step_and_publishes_nothing(sidecar_world, until):
    from draft_align.train.batch import Record
    from draft_align.train.replay import TappedRecord

    recipe, sc, feeder = sidecar_world
    feeder.step(0, 0)
    assert until(lambda: sc.state.monitor_rows >= 1, 20, every=lambda: sc._drain(0.1, 100))
    before = {k: v.clone() for k, v in sc.trainer.draft.state_dict().items()}
    # finite but huge states overflow inside the draft: the loss is not finite
    from draft_align.train.replay import ReplayBuffer

    sc.buffer = ReplayBuffer(4000, 2.0, 0, 0)
    h = sc.hidden
    rec = Record(input_ids=torch.randint(3, sc.vocab, (20,)), loss_mask=torch.arange(20) >= 5,
                 aux=torch.full((20, 3 * h), 3e38).bfloat16(), final=torch.randn(20, h).bfloat16())
    sc.buffer.add(TappedRecord(record=rec, policy_version=0, step=0))
    assert sc._train_one()
    assert sc.state.nonfinite_steps == 1 and sc.state.train_steps == 0
    for k, v in sc.trainer.draft.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not sc.maybe_publish(force=True)
    assert not (recipe.run_dir / "drafts").exists()


def _spawn(resolved: Path, start: Path, log: Path) -> subprocess.Popen:
    from draft_align.cotrain import spawn_sidecar

    return spawn_sidecar(resolved, start, log)


def _published(run_dir: Path) -> int:
    p = run_dir / "sidecar" / "publish.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def _check_visible_versions(run_dir: Path) -> list[int]:
    from draft_align.publish.folder import read_manifest
    from draft_align.publish.versions import read_latest

    versions = []
    for d in sorted((run_dir / "drafts").glob("v*")):
        versions.append(read_manifest(d, verify=True)["draft_version"])  # raises if half-written
    latest = read_latest(run_dir)
    if latest is not None:
        read_manifest(latest, verify=True)
    return versions


def test_kill9_mid_run_and_mid_publish_then_resume(tiny_run, tiny_env, tmp_path, until):
    """The RL side keeps offering without blocking while the sidecar is dead; every visible draft is
    complete after each kill (kills land at random points, publishes happen on every train step); a
    restarted sidecar resumes from its checkpoint and keeps publishing higher versions."""
    import random

    from draft_align.cotrain import write_resolved
    from draft_align.sidecar import starting_draft

    recipe = load_recipe(None, tiny_run.cotrain_overrides(tmp_path, run="kill"), CotrainRecipe)
    resolved = write_resolved(recipe)
    start = starting_draft(recipe)
    from draft_align.publish import load_draft

    frozen, _ = load_draft(start)
    feeder = Feeder(recipe, frozen.draft_to_target, tuple(frozen.cfg.aux_layer_ids))
    env_log = tmp_path / "sidecar.log"
    proc = _spawn(resolved, start, env_log)
    step = 0
    rng = random.Random(0)
    try:
        def feed() -> None:
            nonlocal step
            feeder.step(step, step // 2)
            step += 1

        assert until(lambda: _published(recipe.run_dir) >= 1, 90, every=feed), env_log.read_text()[-3000:]
        for _kill in range(3):
            time.sleep(rng.uniform(0.0, 0.6))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            # the RL side: offers never block with the sidecar gone
            worst = 0.0
            for _ in range(3):
                t = time.perf_counter()
                feed()
                worst = max(worst, time.perf_counter() - t)
            assert worst < 2.0
            versions = _check_visible_versions(recipe.run_dir)
            assert versions == list(range(1, len(versions) + 1))
            n_before = len(versions)
            proc = _spawn(resolved, start, env_log)
            assert until(lambda n=n_before: len(list((recipe.run_dir / "drafts").glob("v*"))) > n, 90,
                         every=feed), env_log.read_text()[-3000:]
        state = json.loads((recipe.run_dir / "sidecar" / "state.json").read_text())
        assert state["restarts"] >= 1
        assert feeder.sender.stats()["sent"] > 0
        from draft_align.wire.messages import StepReport

        feeder.sender.offer(StepReport(run_id=recipe.run, step=step, policy_version=0, metrics={"final": 1.0}))
        assert proc.wait(timeout=60) == 0
        _check_visible_versions(recipe.run_dir)
        assert not list((recipe.run_dir / "drafts").glob(".tmp-*"))
    finally:
        if proc.poll() is None:
            proc.kill()
        feeder.close()


def test_cli_sidecar_refuses_a_missing_starting_draft(tiny_run, tiny_env, tmp_path):
    ov = tiny_run.cotrain_overrides(tmp_path, draft=str(tmp_path / "nowhere"))
    r = subprocess.run([sys.executable, "-m", "draft_align", "sidecar", str(Path(__file__).resolve().parents[1] / "recipes" / "smollm2_cotrain.yaml"), *ov], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "no starting draft" in r.stderr or "does not exist" in r.stderr
