"""Scale on the record (docs/sizing.md): the sidecar at Qwen3-8B shapes, measured on this CPU where it can be,
and the GPU figures projected from those measurements.

    .venv/bin/python benchmarks/scale.py [--parts wire headsync train project peer] [--senders 1 2 4 8]
        [--transports tcp ipc] [--phase-s 15] [--lengths 512 1024 2048 4096] [--threads 2]

Parts (each writes its table into one RESULTS.md section and ``benchmarks/out/scale.json``):

- **wire**: N tap processes (``--senders``, as data-parallel ranks would be) send TapBatches of Qwen3-8B records
  (H = 4096: 3 aux + final hidden in bf16, ids, mask, next log-prob, logit lse, top-1) through the real
  ``TapSender`` (signed: HMAC key, PLAIN handshake) to one real sidecar (``run_sidecar``, as ``draft-align sidecar``
  runs it, on a Qwen3-8B-shaped target and EAGLE-3 draft, see ``prepare``) over TCP on 127.0.0.1 and over ipc.
  *Saturated*: each sender keeps ≤ 2 messages queued and offers the next as soon as one leaves.  *Budget*:
  docs/sizing.md's 1.2 M tokens per 107.5 s step for the whole sidecar, sent as the tap sends it (each rank's
  share of a step offered at once, in messages of ``tap.max_tokens_per_message``), the step time scaled so that
  ``--budget-ranks`` ranks carry the whole budget rate.  Measured: ingest tokens/s and GB/s (what reached the
  replay buffer), drops by reason on both sides, send → buffer latency (offer on the RL side to the record in
  the buffer: p50/p99), the sidecar's RSS and CPU.  The limit, measured in the same run on the same transport:
  raw ZeroMQ PUSH/PULL of the same encoded bytes with no encode and no decode, and this CPU's memcpy bandwidth.
  The sidecar has no head during these phases, so it ingests and does not train (training is on the GPU in a
  real deployment; here it would take the cores the ingest is measured on).
- **headsync**: one HeadSync at the 8B shapes (Vd 32,000 × H 4,096 bf16 rows) sent to the same sidecar: encode
  and decode time, end-to-end time to the accepted head, the peak memory on both sides, its size against the
  default ``wire.max_message_mb``.
- **train**: one ``DraftTrainer.train_step`` of the Qwen3-8B EAGLE-3 draft (one Llama layer, H 4,096, 32/8
  heads of 128, intermediate 12,288, Vd 32,000, K = 7, bf16 autocast where the CPU has it) on one record of T
  tokens (75% response), one child process per length (``benchmarks/train_step_memory.child``): tokens/s,
  matmul GFLOP per trained token (``benchmarks/warmstart.train_step_flops``) against docs/sizing.md's formula,
  the fraction of this CPU's bf16 matmul roofline (measured in the same run), peak memory against T.
- **project**: tokens/s per H100, H200 and GB200 from the measured roofline fraction and the measured FLOPs per
  token (projected, never measured here).
- **peer**: draft_align's EAGLE-3 TTT step against speculators' at the SmolLM2 shapes (benchmarks/peer_step.py).

Run it alone on the machine: every part measures throughput on both cores.  The wire part holds about 12 GB
(the sidecar's three copies of a 0.4 B-parameter draft, its buffer, the senders' queues); the train part's
longest step about 16 GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEAD = "## Scale: the sidecar at Qwen3-8B shapes (benchmarks/scale.py)"
OUT_JSON = ROOT / "benchmarks" / "out" / "scale.json"
STUB_DIR = ROOT / "checkpoints" / "qwen3-8b-shapes"
RUN = "scale"

# Qwen3-8B's config (hidden 4096, 32 query / 8 KV heads of 128, intermediate 12,288, vocab 151,936)
H, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, MAX_POS = 4096, 32, 8, 128, 12288, 151_936, 40_960
DRAFT_VOCAB = 32_000
# The sidecar reads only the target's config and its embedding: the stub target has Qwen3-8B's layer shape and
# vocabulary but 4 layers (1.4 B parameters instead of 8.2 B), so the 3 aux layers are 1, 2, 3.
STUB_LAYERS, AUX = 4, (1, 2, 3)
DRAFT_8B = dict(
    hidden_size=H,
    intermediate_size=INTER,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    vocab_size=VOCAB,
    draft_vocab_size=DRAFT_VOCAB,
    target_hidden_size=H,
    aux_layer_ids=AUX,
    target_num_layers=STUB_LAYERS,
    max_position_embeddings=MAX_POS,
)
SIZING_STEP_S, SIZING_BUDGET, SIZING_DP = 107.5, 1_200_000, 32  # docs/sizing.md §2, §4 (Qwen3-8B)
GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "GB200": 2500.0}  # dense bf16, vendor figures
SIZING_ASSUMED_FRACTION = 0.35  # what docs/sizing.md §3 assumed before this benchmark


def _d2t() -> Any:
    import torch

    return torch.arange(DRAFT_VOCAB) * (VOCAB // DRAFT_VOCAB)


# ------------------------------------------------------------------------------------------------ prepare
def role_prepare(a: argparse.Namespace) -> None:
    """The stub target (config, tokenizer, bf16 weights) and a random EAGLE-3 draft at the 8B shapes, once."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from draft_align import assets
    from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
    from draft_align.publish import export_draft
    from draft_align.publish.compat import tokenizer_fingerprint

    tgt, drf = STUB_DIR / "target", STUB_DIR / "draft"
    tok = AutoTokenizer.from_pretrained(assets.resolve_model("smollm2-135m"))
    if not (tgt / "config.json").exists():
        cfg = Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=H,
            intermediate_size=INTER,
            num_hidden_layers=STUB_LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            max_position_embeddings=MAX_POS,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        model = Qwen3ForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
        tmp = tgt.with_name("target.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del model
        tmp.rename(tgt)
    if not (drf / "manifest.json").exists():
        torch.manual_seed(0)
        draft = Eagle3Draft(Eagle3Config(**DRAFT_8B, rms_norm_eps=1e-6))
        for p in draft.parameters():
            nn.init.normal_(p, std=0.02)
        draft.set_vocab(_d2t())
        export_draft(
            draft,
            drf,
            target_config=AutoConfig.from_pretrained(tgt),
            target_name=str(tgt),
            metrics={},
            draft_version=0,
            policy_version=0,
            tokenizer_fingerprint=tokenizer_fingerprint(tok),
        )


# ------------------------------------------------------------------------------------------------ sidecar
def _recipe(run_dir: Path, endpoint: str, extra: list[str]) -> Any:
    from draft_align.config import CotrainRecipe, load_recipe

    overrides = [
        f"run={RUN}",
        f"output_dir={run_dir}",
        f"draft={STUB_DIR / 'draft'}",
        f"target.model={STUB_DIR / 'target'}",
        "target.dtype=bfloat16",
        f"wire.endpoint={endpoint}",
        "logging.wandb=false",
        "sidecar.monitor.prometheus_port=null",
        "sidecar.num_threads=1",
        *extra,
    ]
    return load_recipe(ROOT / "recipes" / "smollm2_cotrain.yaml", overrides, CotrainRecipe)


def role_sidecar(a: argparse.Namespace) -> None:
    """``run_sidecar`` as ``draft-align sidecar`` runs it, with a probe: a line per TapBatch in the buffer and per
    HeadSync applied, and every 0.25 s the sidecar's counters (rejections by reason, ingested and buffered)."""
    import torch

    from draft_align.sidecar.launch import run_sidecar

    recipe = _recipe(Path(a.run_dir), a.endpoint, a.override)
    torch.set_num_threads(recipe.sidecar.num_threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    probe = open(a.probe, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    lock = threading.Lock()

    def write(**row: Any) -> None:
        with lock:
            probe.write(json.dumps(row) + "\n")

    def on_ready(sc: Any) -> None:
        batch, head = sc.ingest.on_batch, sc.on_head

        def on_batch(msg: Any) -> None:
            batch(msg)
            write(
                k="tap",
                t=time.monotonic(),
                step=int(msg.step),
                rank=int(msg.source_rank),
                id=int(msg.batch_id),
                tokens=int(msg.num_tokens),
            )

        def on_head(msg: Any) -> None:
            t0 = time.monotonic()
            head(msg)
            write(k="head", t=time.monotonic(), apply_s=time.monotonic() - t0, accepted=bool(sc.has_head))
            stop.set()  # the measurement is done; no 8B train step on this CPU

        sc.ingest.on_batch, sc.on_head = on_batch, on_head

        def tick() -> None:
            while not stop.is_set():
                write(
                    k="tick",
                    t=time.monotonic(),
                    rejected=dict(sc.rejected),
                    ingested=sc.state.ingested_tokens,
                    buffered=sc.ingest.buffer.num_tokens,
                    mismatched=sc.state.mismatched_messages,
                )
                time.sleep(0.25)

        threading.Thread(target=tick, daemon=True).start()
        write(k="ready", t=time.monotonic())

    run_sidecar(recipe, None, stop=stop, on_ready=on_ready)


# ------------------------------------------------------------------------------------------------ senders
def tap_batch(tokens: int, seq_len: int, rank: int, step: int = 0) -> Any:
    """A TapBatch of ``tokens`` Qwen3-8B tokens in sequences of ``seq_len`` (the last 75% of each a response),
    random contents, top-1 log-probs (the tap's default ``tap.topk``)."""
    import torch

    from draft_align.wire.messages import TapBatch

    g = torch.Generator().manual_seed(rank)
    n_seq = max(1, tokens // seq_len)
    tokens = n_seq * seq_len
    pos = torch.arange(tokens) % seq_len
    lp = -torch.rand(tokens, generator=g) * 5
    lp[pos == seq_len - 1] = 0.0
    return TapBatch(
        run_id=RUN,
        policy_version=0,
        source_rank=rank,
        batch_id=0,
        step=step,
        aux_layer_ids=AUX,
        hidden_size=H,
        vocab_size=VOCAB,
        final_norm="post",
        temperature=1.0,
        cu_seqlens=torch.arange(n_seq + 1, dtype=torch.int64) * seq_len,
        input_ids=torch.randint(0, VOCAB, (tokens,), generator=g),
        loss_mask=pos >= seq_len // 4,
        aux_hidden=torch.randn(tokens, len(AUX) * H, generator=g).bfloat16(),
        final_hidden=torch.randn(tokens, H, generator=g).bfloat16(),
        next_logprob=lp,
        logit_lse=torch.randn(tokens, generator=g) + 4,
        topk_ids=torch.randint(0, VOCAB, (tokens, 1), generator=g),
        topk_logprobs=-(torch.rand(tokens, 1, generator=g) * 5),
    )


def head_sync() -> Any:
    import torch

    from draft_align.wire.messages import HeadSync

    g = torch.Generator().manual_seed(7)
    return HeadSync(
        run_id=RUN,
        policy_version=0,
        hidden_size=H,
        vocab_size=VOCAB,
        norm_eps=1e-6,
        norm_weight=torch.ones(H),
        draft_to_target=_d2t(),
        rows=(torch.randn(DRAFT_VOCAB, H, generator=g) * 0.05).bfloat16(),
    )


def _wait_until(t: float) -> None:
    while (d := t - time.monotonic()) > 0:
        time.sleep(min(d, 0.05))


def role_sender(a: argparse.Namespace) -> None:
    """One RL-side rank: the real TapSender with the recipe's wire settings."""
    import torch

    from draft_align.wire import channel

    torch.set_num_threads(1)
    recipe = _recipe(Path(a.run_dir), a.endpoint, a.override)
    w = recipe.wire
    base = tap_batch(a.message_tokens, a.seq_len, a.rank, a.phase)
    key = channel.resolve_key(w.key_file, recipe.run_dir, create=False)
    sender = channel.TapSender(
        a.endpoint,
        key,
        queue_messages=w.queue_messages,
        queue_bytes=w.queue_mb << 20,
        max_message_bytes=w.max_message_mb << 20,
        send_timeout_s=w.send_timeout_s,
    )
    offers: list[tuple[int, float, bool]] = []
    _wait_until(a.start_at)
    end = a.start_at + a.seconds
    i = 0
    if a.mode == "saturate":
        while time.monotonic() < end:
            if sender.stats()["queue_depth"] >= 2:
                time.sleep(0.002)
                continue
            t = time.monotonic()
            offers.append((i, t, sender.offer(dataclasses.replace(base, batch_id=i))))
            i += 1
    else:  # budget: each scaled step, this rank's share offered at once, as tap/shipping.ship() does
        n_steps = 0
        while (t_step := a.start_at + n_steps * a.step_s) < end:
            _wait_until(t_step)
            for _ in range(a.messages_per_step):
                t = time.monotonic()
                offers.append((i, t, sender.offer(dataclasses.replace(base, batch_id=i))))
                i += 1
            n_steps += 1
    # the RL job runs on after a step: let the queue and ZeroMQ's writes finish before the socket closes (a
    # message still being written when it closes is cut, which a running job never does)
    t_end = time.monotonic() + a.close_s
    while sender.stats()["queue_depth"] and time.monotonic() < t_end:
        time.sleep(0.01)
    time.sleep(2.0)
    sender.close(timeout_s=a.close_s)
    Path(a.out).write_text(json.dumps({"offers": offers, "stats": sender.stats(), "tokens": base.num_tokens}))


def role_headsync(a: argparse.Namespace) -> None:
    """One HeadSync at the 8B shapes: encode / decode timed here, then sent through a TapSender."""
    import resource

    import torch

    from draft_align.wire import channel
    from draft_align.wire.codec import encode_views
    from draft_align.wire.messages import decode

    torch.set_num_threads(1)
    recipe = _recipe(Path(a.run_dir), a.endpoint, a.override)
    w = recipe.wire
    key = channel.resolve_key(w.key_file, recipe.run_dir, create=False)
    rss0 = _rss_self()
    msg = head_sync()
    enc, dec = [], []
    for _ in range(3):
        t = time.perf_counter()
        frames = encode_views(msg, key, sender="probe", seq=0)
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        decode(frames, key, max_bytes=w.max_message_mb << 20, max_tokens=w.max_tokens)
        dec.append(time.perf_counter() - t)
    size = sum(len(f) for f in frames)
    del frames
    sender = channel.TapSender(a.endpoint, key, max_message_bytes=w.max_message_mb << 20, send_timeout_s=5.0)
    t0 = time.monotonic()
    sender.offer(msg)
    while sender.stats()["sent"] + sender.stats()["dropped_peer"] + sender.stats()["dropped_too_large"] == 0:
        time.sleep(0.001)
    t_sent = time.monotonic()
    stats = sender.stats()
    # a message ZeroMQ is still writing when its socket closes is cut (libzmq's linger covers the queue, not
    # the write in progress): hold the socket until the sidecar has it
    done = Path(a.out + ".done")
    while not done.exists() and time.monotonic() - t_sent < 300:
        time.sleep(0.05)
    sender.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(a.out).write_text(
        json.dumps(
            {
                "bytes": size,
                "rows_bytes": msg.rows.numel() * 2,
                "encode_s": statistics.median(enc),
                "decode_s": statistics.median(dec),
                "t_offer": t0,
                "send_s": t_sent - t0,
                "stats": stats,
                "rss_before_message": rss0,
                "peak_rss": peak,
            }
        )
    )


def role_raw(a: argparse.Namespace) -> None:
    """Raw ZeroMQ PUSH/PULL of the same encoded bytes (sender: encoded once, sent again and again; receiver:
    received and counted, never decoded)."""
    import zmq

    ctx = zmq.Context()
    if a.raw == "recv":
        s = ctx.socket(zmq.PULL)
        s.setsockopt(zmq.RCVHWM, 4)
        s.bind(a.endpoint)
        Path(a.out + ".ready").write_text("1")
        n = nbytes = 0
        s.setsockopt(zmq.RCVTIMEO, 200)
        end = a.start_at + a.seconds
        while time.monotonic() < end:  # what arrives inside the window counts
            try:
                frames = s.recv_multipart(copy=False)
            except zmq.Again:
                continue
            if time.monotonic() >= a.start_at:
                n += 1
                nbytes += sum(len(f.buffer) for f in frames)
        Path(a.out).write_text(json.dumps({"messages": n, "bytes": nbytes}))
    else:
        import torch

        from draft_align.wire.codec import encode

        torch.set_num_threads(1)
        frames = encode(tap_batch(a.message_tokens, a.seq_len, a.rank), os.urandom(32), sender="raw", seq=0)
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 4)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(a.endpoint)
        _wait_until(a.start_at)
        n = 0
        s.setsockopt(zmq.SNDTIMEO, 200)
        while time.monotonic() < a.start_at + a.seconds:
            try:
                s.send_multipart(frames, copy=False)
                n += 1
            except zmq.Again:
                pass
        Path(a.out).write_text(json.dumps({"sent": n}))
    s.close(linger=0)
    ctx.term()


def _rss_self() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------------------------------ the wire part
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Sampler:
    """The sidecar's RSS and CPU seconds, sampled every ``every_s`` on a thread."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.rows: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        self.every_s = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                c = self.proc.cpu_times()
                self.rows.append((time.monotonic(), self.proc.memory_info().rss, c.user + c.system))
            except Exception:  # the process ended
                return
            time.sleep(self.every_s)

    def window(self, t0: float, t1: float) -> dict[str, float]:
        rows = [r for r in self.rows if t0 <= r[0] <= t1]
        if len(rows) < 2:
            return {"rss_max": float("nan"), "cpu_cores": float("nan"), "cpu_s": float("nan")}
        cpu = rows[-1][2] - rows[0][2]
        return {
            "rss_max": max(r[1] for r in rows),
            "cpu_s": cpu,
            "cpu_cores": cpu / (rows[-1][0] - rows[0][0]),
        }

    def stop(self) -> None:
        self._stop.set()


def _wait_all(procs: list[subprocess.Popen], timeout_s: float, what: str, check: bool = True) -> None:
    """Wait for ``procs``; any still running at the deadline (or when waiting fails) is killed by its PID and
    reaped; with ``check``, a process that failed is one error line."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [p.returncode for p in procs if p.returncode]
    if check and failed:
        raise RuntimeError(f"{what}: {len(failed)} of {len(procs)} processes failed (exit codes {failed})")


def _me() -> list[str]:
    return [sys.executable, str(Path(__file__).resolve())]


def _probe_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of a killed sidecar
            pass
    return rows


def memcpy_gbps(threads: int, mb: int = 512, reps: int = 5) -> float:
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(mb << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t)
    return (mb << 20) / statistics.median(ts) / 1e9


class WireRun:
    """One transport: raw ZeroMQ phases, then one sidecar through the saturated, budget and HeadSync phases."""

    def __init__(self, a: argparse.Namespace, transport: str, work: Path) -> None:
        self.a, self.transport, self.work = a, transport, work
        self.run_dir = work / f"run-{transport}"
        self.phase = 0

    def endpoint(self) -> str:
        if self.transport == "tcp":
            return f"tcp://127.0.0.1:{_free_port()}"
        return f"ipc://{self.work}/{self.transport}-{self.phase}.sock"

    def raw(self, n: int) -> dict[str, Any]:
        a, ep = self.a, self.endpoint()
        self.phase += 1
        out = self.work / f"raw-{self.transport}-{n}"
        start_at = time.monotonic() + 10.0 + 2.0 * n
        common = [
            "--endpoint",
            ep,
            "--start-at",
            str(start_at),
            "--seconds",
            str(a.raw_s),
            "--message-tokens",
            str(a.message_tokens),
            "--seq-len",
            str(a.seq_len),
        ]
        recv = subprocess.Popen([*_me(), "--role", "raw", "--raw", "recv", "--out", str(out), *common])
        senders = [
            subprocess.Popen(
                [*_me(), "--role", "raw", "--raw", "send", "--rank", str(r), "--out", f"{out}.s{r}", *common]
            )
            for r in range(n)
        ]
        # a raw sender may die in libzmq's teardown at its deadline (seen once: session_base.cpp EAGAIN); what
        # counts is what the receiver got inside the window, and a receiver that failed leaves no result
        _wait_all([recv, *senders], a.raw_s + 120, "raw ZeroMQ", check=False)
        r = json.loads(out.read_text())
        return {
            "senders": n,
            "messages": r["messages"],
            "bytes": r["bytes"],
            "gb_per_s": r["bytes"] / a.raw_s / 1e9,
        }

    def start_sidecar(self, extra: list[str]) -> None:
        self.ep = self.endpoint()
        self.extra = extra
        self.probe = self.work / f"probe-{self.transport}.jsonl"
        self.probe.write_text("")
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        self.sidecar = subprocess.Popen(
            [
                *_me(),
                "--role",
                "sidecar",
                "--run-dir",
                str(self.run_dir),
                "--endpoint",
                self.ep,
                "--probe",
                str(self.probe),
                *sum((["--override", o] for o in extra), []),
            ],
            env=env,
        )
        t0 = time.monotonic()
        while not any(r["k"] == "ready" for r in _probe_rows(self.probe)):
            if self.sidecar.poll() is not None:
                raise RuntimeError(f"the sidecar exited with {self.sidecar.returncode} before it was ready")
            if time.monotonic() - t0 > 900:
                raise RuntimeError("the sidecar was not ready within 900 s")
            time.sleep(0.5)
        self.setup_s = time.monotonic() - t0
        self.sampler = Sampler(self.sidecar.pid)
        self.rss_ready = self.sampler.proc.memory_info().rss

    def senders(self, n: int, mode: str, seconds: float, **kw: Any) -> tuple[list[dict[str, Any]], float]:
        a = self.a
        self.phase += 1
        start_at = time.monotonic() + 10.0 + 3.0 * n  # every sender built its batch and connected by then
        procs, outs = [], []
        for r in range(n):
            out = self.work / f"send-{self.transport}-{self.phase}-{r}.json"
            outs.append(out)
            cmd = [
                *_me(),
                "--role",
                "sender",
                "--run-dir",
                str(self.run_dir),
                "--endpoint",
                self.ep,
                "--rank",
                str(r),
                "--out",
                str(out),
                "--phase",
                str(self.phase),
                "--mode",
                mode,
                "--start-at",
                str(start_at),
                "--seconds",
                str(seconds),
                "--message-tokens",
                str(a.message_tokens),
                "--seq-len",
                str(a.seq_len),
                "--close-s",
                str(kw.get("close_s", 4.0)),
                *sum((["--override", o] for o in [*self.extra, *kw.get("sender_extra", [])]), []),
            ]
            if mode == "budget":
                cmd += ["--step-s", str(kw["step_s"]), "--messages-per-step", str(kw["messages_per_step"])]
            procs.append(subprocess.Popen(cmd))
        _wait_all(procs, seconds + 300, "senders")
        time.sleep(2.0)  # the sidecar drains what is in flight
        return [json.loads(o.read_text()) for o in outs], start_at

    def phase_result(self, n: int, mode: str, sent: list[dict[str, Any]], t0: float, seconds: float) -> dict:
        rows = _probe_rows(self.probe)
        taps = [r for r in rows if r["k"] == "tap" and r["step"] == self.phase]
        ticks = [r for r in rows if r["k"] == "tick" and t0 - 1.0 <= r["t"]]
        before = [r for r in rows if r["k"] == "tick" and r["t"] < t0]
        rej0 = before[-1]["rejected"] if before else {}
        rej1 = ticks[-1]["rejected"] if ticks else {}
        rejected = {k: v - rej0.get(k, 0) for k, v in rej1.items() if v - rej0.get(k, 0)}
        offered_at = {(rank, i): t for rank, s in enumerate(sent) for i, t, ok in s["offers"] if ok}
        lat = [r["t"] - offered_at[(r["rank"], r["id"])] for r in taps if (r["rank"], r["id"]) in offered_at]
        tokens = sum(r["tokens"] for r in taps)
        last = max((r["t"] for r in taps), default=t0 + seconds)
        wall = max(seconds, last - t0) if mode == "saturate" else seconds
        drops: dict[str, int] = {}
        for s in sent:
            for k, v in s["stats"].items():
                if k.startswith("dropped_") and v:
                    drops[k] = drops.get(k, 0) + v
        usage = self.sampler.window(t0, t0 + wall)
        return {
            "transport": self.transport,
            "mode": mode,
            "senders": n,
            "seconds": wall,
            "offered_messages": sum(s["stats"]["offered"] for s in sent),
            "sent_messages": sum(s["stats"]["sent"] for s in sent),
            "buffered_messages": len(taps),
            "lost_in_transit": sum(s["stats"]["sent"] for s in sent) - len(taps),
            "tokens": tokens,
            "tokens_per_s": tokens / wall,
            "gb_per_s": tokens * self.bytes_per_token / wall / 1e9,
            "sender_drops": drops,
            "sidecar_rejected": rejected,
            "latency_p50_s": _pct(lat, 0.5),
            "latency_p99_s": _pct(lat, 0.99),
            "sidecar_rss_max": usage["rss_max"],
            "sidecar_cpu_cores": usage["cpu_cores"],
            "sidecar_tokens_per_cpu_s": tokens / usage["cpu_s"] if usage["cpu_s"] else None,
            "buffered_tokens_end": ticks[-1]["buffered"] if ticks else None,
        }

    def headsync(self) -> dict[str, Any]:
        out = self.work / "headsync.json"
        t_before = time.monotonic()
        self.sampler.every_s = 0.05
        p = subprocess.Popen(
            [
                *_me(),
                "--role",
                "headsync",
                "--run-dir",
                str(self.run_dir),
                "--endpoint",
                self.ep,
                "--out",
                str(out),
                *sum((["--override", o] for o in self.extra), []),
            ]
        )
        t_end = time.monotonic() + 300
        head = None
        while time.monotonic() < t_end and head is None and p.poll() is None:
            head = next((r for r in _probe_rows(self.probe) if r["k"] == "head"), None)
            time.sleep(0.05)
        Path(str(out) + ".done").write_text("1")
        _wait_all([p], 120, "HeadSync sender")
        r = json.loads(out.read_text())
        window = self.sampler.window(t_before, time.monotonic())
        limit = self.max_message_mb << 20
        overhead = r["bytes"] - r["rows_bytes"] - DRAFT_VOCAB * 8 - H * 4
        return {
            **{k: v for k, v in r.items() if k not in ("t_offer",)},
            "accepted": bool(head and head["accepted"]),
            "end_to_end_s": head["t"] - r["t_offer"] if head else None,
            "apply_s": head["apply_s"] if head else None,
            "sidecar_rss_before": self.rss_before_head,
            "sidecar_rss_peak": window["rss_max"],
            "max_message_bytes": limit,
            "max_draft_vocab_at_default": (limit - overhead - H * 4) // (H * 2 + 8),
        }

    def stop(self) -> None:
        self.sampler.stop()
        if self.sidecar.poll() is None:
            self.sidecar.send_signal(signal.SIGKILL)
        self.sidecar.wait()


def part_wire(a: argparse.Namespace, work: Path, res: dict[str, Any]) -> None:
    from draft_align.wire.codec import encode

    res["memcpy_gb_per_s"] = {str(t): memcpy_gbps(t) for t in (1, 2)}
    frames = encode(tap_batch(a.message_tokens, a.seq_len, 0), os.urandom(32), sender="x", seq=0)
    bytes_per_token = sum(len(f) for f in frames) / a.message_tokens
    del frames
    res["bytes_per_token"] = bytes_per_token
    res["message_tokens"] = a.message_tokens
    rows, raws, heads = [], [], {}
    buffer_tokens = a.buffer_tokens
    extra = [f"sidecar.buffer.tokens={buffer_tokens}", f"tap.max_tokens_per_message={a.message_tokens}"]
    per_rank = SIZING_BUDGET // SIZING_DP  # one rank's share of a step at DP = 32 (docs/sizing.md §4)
    msgs_per_step = -(-per_rank // a.message_tokens)
    budget_rate = SIZING_BUDGET / SIZING_STEP_S
    step_s = a.budget_ranks * msgs_per_step * a.message_tokens / budget_rate
    res["budget"] = {
        "tokens_per_s": budget_rate,
        "per_rank_step_tokens": msgs_per_step * a.message_tokens,
        "step_s_scaled": step_s,
        "ranks": a.budget_ranks,
    }
    for transport in a.transports:
        wr = WireRun(a, transport, work)
        wr.bytes_per_token = bytes_per_token
        for n in a.senders:
            raws.append({"transport": transport, **wr.raw(n)})
            print(f"raw {transport} ×{n}: {raws[-1]['gb_per_s']:.2f} GB/s", flush=True)
        wr.start_sidecar(extra)
        wr.max_message_mb = 256
        try:
            for n in a.senders:
                sent, t0 = wr.senders(n, "saturate", a.phase_s)
                rows.append(wr.phase_result(n, "saturate", sent, t0, a.phase_s))
                print(json.dumps(rows[-1]), flush=True)
            secs = a.budget_steps * step_s
            queue = [f"wire.queue_mb={a.budget_queue_mb}", f"wire.queue_messages={2 * msgs_per_step}"]
            timeout = f"wire.send_timeout_s={step_s:.0f}"  # the sender may wait a step for the sidecar
            settings = {  # the defaults, then a queue that holds a step's share, then also the sender's patience
                "defaults": [],
                f"queue_mb {a.budget_queue_mb}": queue,
                f"queue_mb {a.budget_queue_mb}, send_timeout_s {step_s:.0f}": [*queue, timeout],
            }
            for label, qx in settings.items():
                sent, t0 = wr.senders(
                    a.budget_ranks,
                    "budget",
                    secs,
                    step_s=step_s,
                    messages_per_step=msgs_per_step,
                    close_s=60.0,
                    sender_extra=qx,
                )
                rows.append({**wr.phase_result(a.budget_ranks, "budget", sent, t0, secs), "settings": label})
                print(json.dumps(rows[-1]), flush=True)
            if "headsync" in a.parts and transport == a.transports[-1]:
                wr.rss_before_head = wr.sampler.proc.memory_info().rss
                heads = wr.headsync()
                print(json.dumps(heads), flush=True)
            res.setdefault("sidecar_setup_s", {})[transport] = wr.setup_s
            res.setdefault("sidecar_rss_ready", {})[transport] = wr.rss_ready
        finally:
            wr.stop()
    res["buffer_tokens"] = buffer_tokens
    res["buffer_bytes"] = buffer_tokens * bytes_per_token
    res["raw"], res["phases"], res["headsync"] = raws, rows, heads


# ------------------------------------------------------------------------------------------------ train
def formula_gflop(t: int) -> float:
    """docs/sizing.md §3's GFLOP per trained token (K = 7, ctx = T/2 mean attended positions)."""
    ctx = t / 2
    step = (
        2 * 2 * H * H
        + 2 * 2 * 2 * H * 1024
        + 2 * H * H
        + 2 * 3 * H * INTER
        + 2 * H * DRAFT_VOCAB
        + 2 * 2 * ctx * H
    )
    return 3 * (7 * step + 2 * 3 * H * H) / 1e9


def role_train(a: argparse.Namespace) -> None:
    import torch

    from benchmarks.train_step_memory import child
    from draft_align.train.precision import resolve_autocast

    bf16 = resolve_autocast(None, torch.device("cpu"))
    r = child(a.tokens, 7, a.threads, 0.75, a.cap, "cpu", bf16, "soft", shape=DRAFT_8B)
    Path(a.out).write_text(json.dumps({**r, "autocast_bf16": bf16}))


def part_train(a: argparse.Namespace, work: Path, res: dict[str, Any]) -> None:
    import torch

    from benchmarks.warmstart import matmul_roofline, train_step_flops
    from draft_align.heads.eagle3 import Eagle3Config

    torch.set_num_threads(a.threads)
    roof = {"bf16": matmul_roofline(torch.bfloat16), "fp32": matmul_roofline(torch.float32)}
    cfg = Eagle3Config(**DRAFT_8B)
    rows = []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    for t in a.lengths:
        out = work / f"train-{t}.json"
        cmd = [*_me(), "--role", "train", "--tokens", str(t), "--threads", str(a.threads), "--out", str(out)]
        if a.cap:
            cmd += ["--cap", str(a.cap)]
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0 or not out.exists():  # e.g. killed for memory: recorded, the others still run
            rows.append({"tokens": t, "failed": proc.returncode})
            print(json.dumps(rows[-1]), flush=True)
            continue
        r = json.loads(out.read_text())
        flops = train_step_flops(cfg, r["chain_starts"], r["tokens"], 7)
        # the attention's work, which train_step_flops leaves out: 2·2·ctx·(h·d) per start and step, ×3
        attn = 3 * r["chain_starts"] * 7 * 2 * 2 * (t / 2) * HEADS * HEAD_DIM
        gflops = (flops + attn) / r["seconds"] / 1e9
        rows.append(
            {
                **r,
                "tokens_per_s": r["chain_starts"] / r["seconds"],
                "gflop_per_token_matmul": flops / r["chain_starts"] / 1e9,
                "gflop_per_token_with_attention": (flops + attn) / r["chain_starts"] / 1e9,
                "gflop_per_token_formula": formula_gflop(t),
                "gflops": gflops,
                "roofline_fraction": gflops / (roof["bf16"] if r["autocast_bf16"] else roof["fp32"]),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    res["roofline_gflops"], res["train"] = roof, rows


def part_project(res: dict[str, Any]) -> None:
    """tokens/s per GPU = measured roofline fraction × the GPU's dense bf16 peak / measured FLOPs per token."""
    rows = [r for r in res.get("train") or [] if "failed" not in r]
    proj = []
    for r in rows:
        for gpu, peak in GPU_PEAK_TFLOPS.items():
            tps = r["roofline_fraction"] * peak * 1e12 / (r["gflop_per_token_with_attention"] * 1e9)
            proj.append(
                {
                    "tokens": r["tokens"],
                    "gpu": gpu,
                    "fraction": r["roofline_fraction"],
                    "gflop_per_token": r["gflop_per_token_with_attention"],
                    "tokens_per_s": tps,
                }
            )
    res["projection"] = proj


# ------------------------------------------------------------------------------------------------ render
def _mib(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x / 2**20:,.0f}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:,.0f}"


def render(res: dict[str, Any]) -> str:
    lines = [
        HEAD,
        "",
        "Commands (this 2-core CPU, run alone), with the parts whose figures each last produced:",
        "",
    ]
    by_cmd: dict[tuple[str, str], list[str]] = {}
    for part, (cmd, when) in res.get("commands", {}).items():
        by_cmd.setdefault((cmd, when), []).append(part)
    lines += [f"- `{cmd}` ({when} UTC): {', '.join(parts)}" for (cmd, when), parts in by_cmd.items()]
    lines.append("")
    if res.get("phases"):
        b = res["budget"]
        lines += [
            f"**The wire and ingest at Qwen3-8B shapes.** {res['message_tokens']:,}-token TapBatches of "
            f"{res['bytes_per_token']:,.0f} B per token as encoded (H = 4,096: 3 aux + final bf16, ids, mask, "
            "next log-prob, lse, top-1), signed, through the real `TapSender` to one real sidecar (a stub "
            "target with Qwen3-8B's layer shape and vocabulary, 4 layers; a random EAGLE-3 draft at the 8B "
            "draft shape; no head, so it ingests and does not train). The senders and the sidecar share the "
            f"2 cores. Buffer bound `sidecar.buffer.tokens` = {res['buffer_tokens']:,} "
            f"({res['buffer_bytes'] / 2**30:.2f} GiB of records). memcpy on this CPU: "
            f"{res['memcpy_gb_per_s']['1']:.1f} GB/s (1 thread), {res['memcpy_gb_per_s']['2']:.1f} GB/s (2).",
            "",
            "| transport | mode | senders | raw ZeroMQ GB/s | ingest tokens/s | ingest GB/s | of raw | buffered / "
            "offered msgs | sender drops | cut at close | sidecar rejects | send → buffer p50 / p99 ms | "
            "sidecar cores | tokens per sidecar CPU-s | sidecar RSS max MiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|",
        ]
        raw = {(r["transport"], r["senders"]): r["gb_per_s"] for r in res["raw"]}
        for r in res["phases"]:
            rz = raw.get((r["transport"], r["senders"]))
            frac = f"{r['gb_per_s'] / rz:.2f}" if rz and r["mode"] == "saturate" else "—"
            drops = (
                ", ".join(f"{k.removeprefix('dropped_')} {v}" for k, v in r["sender_drops"].items()) or "0"
            )
            rej = ", ".join(f"{k} {v}" for k, v in r["sidecar_rejected"].items()) or "0"
            tpc = r["sidecar_tokens_per_cpu_s"]
            mode = r["mode"] if r["mode"] == "saturate" else f"budget, {r['settings']}"
            lines.append(
                f"| {r['transport']} | {mode} | {r['senders']} | {rz:.2f} | {r['tokens_per_s']:,.0f} | "
                f"{r['gb_per_s']:.2f} | {frac} | {r['buffered_messages']} / {r['offered_messages']} | {drops} | "
                f"{r['lost_in_transit']} | {rej} | {_ms(r['latency_p50_s'])} / {_ms(r['latency_p99_s'])} | {r['sidecar_cpu_cores']:.2f} | "
                f"{'n/a' if tpc is None else f'{tpc:,.0f}'} | {_mib(r['sidecar_rss_max'])} |"
            )
        lines += [
            "",
            f"Budget mode: docs/sizing.md's {SIZING_BUDGET:,} tokens per {SIZING_STEP_S} s step "
            f"({b['tokens_per_s']:,.0f} tokens/s, {b['tokens_per_s'] * res['bytes_per_token'] / 1e9:.2f} GB/s) "
            f"for the whole sidecar; each of {b['ranks']} ranks offers a DP = {SIZING_DP} rank's share of a step "
            f"({b['per_rank_step_tokens']:,} tokens) at once, every {b['step_s_scaled']:.1f} s (the step time "
            f"scaled so that {b['ranks']} ranks carry the whole rate). Sidecar ready in "
            + ", ".join(f"{k} {v:.0f} s" for k, v in res.get("sidecar_setup_s", {}).items())
            + " at RSS "
            + ", ".join(f"{k} {_mib(v)} MiB" for k, v in res.get("sidecar_rss_ready", {}).items())
            + ". Sender drops: `peer`, the sidecar did not take the message within the sender's "
            "`wire.send_timeout_s`; `queue_full`, the send queue (`wire.queue_mb`, `queue_messages`) could not hold "
            "the step's share. *Cut at close*: sent into ZeroMQ but not in the buffer when the phase's senders "
            "closed (their sockets close with linger 0 and drop what is still queued toward a sidecar that is "
            "behind; a running RL job does not close). The saturated rows put N encoding senders on the 2 cores "
            "beside the sidecar, so past one sender they measure this box; *tokens per sidecar CPU-s* is the "
            "sidecar's own cost.",
            "",
        ]
    hs = res.get("headsync")
    if hs:
        lines += [
            "**HeadSync at the 8B shapes** (Vd 32,000 × H 4,096 bf16 rows): "
            f"{hs['bytes']:,} B on the wire against the default `wire.max_message_mb` = 256 "
            f"({hs['max_message_bytes']:,} B): {'accepted' if hs['accepted'] else 'NOT accepted'}; the largest "
            f"draft vocabulary that fits the default at H = 4,096: {hs['max_draft_vocab_at_default']:,}. "
            f"Encode (header, HMAC; tensors as views) {_ms(hs['encode_s'])} ms, decode of the bytes (MAC check, parse, "
            f"copy) "
            f"{_ms(hs['decode_s'])} ms, offer → sent {_ms(hs['send_s'])} ms, offer → head applied in the "
            f"sidecar {_ms(hs['end_to_end_s'])} ms (of which the sidecar's checks and apply "
            f"{_ms(hs['apply_s'])} ms). Peak memory: sender {_mib(hs['peak_rss'])} MiB (from "
            f"{_mib(hs['rss_before_message'])} before the message), sidecar {_mib(hs['sidecar_rss_peak'])} MiB "
            f"(from {_mib(hs['sidecar_rss_before'])}).",
            "",
        ]
    if res.get("train"):
        roof = res["roofline_gflops"]
        lines += [
            "**The train step at the Qwen3-8B draft shape** (one Llama layer, H 4,096, 32/8 heads of 128, "
            "intermediate 12,288, Vd 32,000, K = 7, one record of T tokens, 75% response, soft CE, "
            f"bf16 autocast {res['train'][0].get('autocast_bf16')}, {res['threads']} threads, one child process per "
            f"length with `MALLOC_MMAP_THRESHOLD_=131072`). This CPU's matmul roofline, measured in the same run: "
            f"bf16 {roof['bf16']:.0f} GFLOP/s, fp32 {roof['fp32']:.0f}.",
            "",
            "| T | chain starts | step s | trained tokens/s | GFLOP/token: matmuls / + attention / sizing.md "
            "formula | GFLOP/s | of roofline | step MiB (peak − before) | peak RSS MiB |",
            "|---:|---:|---:|---:|---|---:|---:|---:|---:|",
        ]
        for r in res["train"]:
            if "failed" in r:
                lines.append(f"| {r['tokens']:,} | did not finish (exit {r['failed']}: killed for memory) |")
                continue
            lines.append(
                f"| {r['tokens']:,} | {r['chain_starts']:,} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | "
                f"{r['gflop_per_token_matmul']:.2f} / {r['gflop_per_token_with_attention']:.2f} / "
                f"{r['gflop_per_token_formula']:.2f} | {r['gflops']:.0f} | **{r['roofline_fraction']:.2f}** | "
                f"{_mib(r['step_bytes'])} | {_mib(r['peak_rss'])} |"
            )
        lines.append("")
    if res.get("projection"):
        lines += [
            "**Projected to a GPU** (not measured: the CPU's measured roofline fraction at each T times the GPU's "
            "dense bf16 peak, H100 / H200 989 TFLOP/s, GB200 2,500, divided by the measured GFLOP per token with "
            "attention; docs/sizing.md assumed 0.35 of peak and 15.7 GFLOP):",
            "",
            "| T | fraction (measured) | GFLOP/token (measured) | "
            + " | ".join(f"{g} tokens/s (projected)" for g in GPU_PEAK_TFLOPS)
            + " |",
            "|---:|---:|---:|" + "---:|" * len(GPU_PEAK_TFLOPS),
        ]
        by_t: dict[int, dict[str, Any]] = {}
        for p in res["projection"]:
            by_t.setdefault(p["tokens"], {})[p["gpu"]] = p
        for t, d in by_t.items():
            first = next(iter(d.values()))
            lines.append(
                f"| {t:,} | {first['fraction']:.2f} | {first['gflop_per_token']:.2f} | "
                + " | ".join(f"{d[g]['tokens_per_s']:,.0f}" for g in GPU_PEAK_TFLOPS)
                + " |"
            )
        lines.append("")
    if res.get("peer"):
        from benchmarks.peer_step import render_peer

        lines += [
            "**The train step against speculators'** (same machine, same run):",
            "",
            render_peer(res["peer"]),
        ]
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--parts",
        nargs="+",
        default=["wire", "headsync", "train", "project", "peer"],
        choices=["wire", "headsync", "train", "project", "peer"],
    )
    ap.add_argument("--senders", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--transports", nargs="+", default=["tcp", "ipc"], choices=["tcp", "ipc"])
    ap.add_argument("--phase-s", type=float, default=15.0, help="seconds of each saturated phase")
    ap.add_argument("--raw-s", type=float, default=8.0, help="seconds of each raw ZeroMQ phase")
    ap.add_argument(
        "--message-tokens", type=int, default=4096, help="tokens per TapBatch (tap.max_tokens_per_message)"
    )
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--buffer-tokens", type=int, default=65_536, help="sidecar.buffer.tokens")
    ap.add_argument("--budget-ranks", type=int, default=4)
    ap.add_argument("--budget-steps", type=int, default=3)
    ap.add_argument(
        "--budget-queue-mb", type=int, default=1536, help="wire.queue_mb of the second budget phase"
    )
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--cap", type=int, default=None, help="the trainer's max_seq_tokens (default: its own)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-reps", type=int, default=5)
    ap.add_argument("--no-results-md", action="store_true")
    # child roles
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--raw", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--override", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--phase", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="saturate", help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--step-s", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--messages-per-step", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--close-s", type=float, default=4.0, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    roles = {
        "prepare": role_prepare,
        "sidecar": role_sidecar,
        "sender": role_sender,
        "headsync": role_headsync,
        "raw": role_raw,
        "train": role_train,
    }
    if a.role is not None:
        roles[a.role](a)
        return 0
    res: dict[str, Any] = json.loads(OUT_JSON.read_text()) if OUT_JSON.exists() else {}
    command = " ".join(["python benchmarks/scale.py", *sys.argv[1:]])
    res.update(command=command, date=time.strftime("%Y-%m-%d"), threads=a.threads)
    for part in a.parts:  # a part re-run alone replaces its figures; each part says which command made them
        res.setdefault("commands", {})[part] = [command, time.strftime("%Y-%m-%d %H:%M")]
    work = Path(tempfile.mkdtemp(prefix="scale-"))
    try:
        if "wire" in a.parts or "headsync" in a.parts:
            subprocess.run([*_me(), "--role", "prepare"], check=True)
            part_wire(a, work, res)
        if "train" in a.parts:
            part_train(a, work, res)
        if "project" in a.parts:
            part_project(res)
        if "peer" in a.parts:
            from benchmarks.peer_step import measure_peer

            res["peer"] = measure_peer((3, 7), reps=a.peer_reps, threads=a.threads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
    OUT_JSON.write_text(json.dumps(res, indent=2))
    text = render(res)
    if not a.no_results_md:
        from benchmarks.common.results_md import replace_section

        replace_section(ROOT / "benchmarks" / "RESULTS.md", HEAD, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
