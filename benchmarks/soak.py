"""Soak: a real sidecar trains and publishes for ``--minutes`` while a legit RL-side sender and a hostile
sender run beside it, the sidecar is killed (-9) and restarted at random, and its disk fills up for a while.

Three processes besides the sidecar (``draft-align sidecar``, started exactly as ``cotrain`` starts it):

- **legit** (``--role legit``): the RL side.  SmolLM2-135M's own log-prob forward over ShareGPT prompt +
  reply pairs, the real ``HFPolicyTap`` and ``TapSender`` (the receiver's size limit given), one StepReport per
  step with slash- and dash-named metrics as TRL/wandb jobs send them, a HeadSync every few steps.
- **hostile** (``--role hostile``): ≥ ``--hostile-rate`` messages/s of every category the wire must survive
  (no key, a wrong key, junk frames, bit flips, forged MACs, truncations, 401-digit numbers, headers that
  claim huge tensors, frames over the limit, replays and stale sequence numbers, another run's id) and, at a
  low rate, signed insider input (thousands of metric names, taps of steps never reported, poisoned and
  non-finite heads, a HeadSync with a huge policy version).
- **the orchestrator** (this process): samples the sidecar's RSS every second, scrapes its Prometheus page for
  rejections by reason, kills and restarts it at random, fills its disk (a tmpfs mounted for the run, when
  the process may mount one) for ``--full-disk-s`` seconds, verifies every visible draft version (sha256
  manifests) after every kill and every 30 s, and writes ``benchmarks/out/soak.json`` and RESULTS.md's section.
  Before each kill it sends ``--replay-probes`` signed StepReports under a fresh sender id and, once the
  restarted sidecar is up, replays every probe captured so far: the restarted sidecar must accept none again
  (each probe step must have exactly one monitoring row).  At ``--second-sidecar-at`` of the run it starts a
  second ``draft-align sidecar`` on the same run folder, which must be refused (exit 2, one line naming the
  live sidecar's pid) while the first keeps serving.
  The sidecar records the wire (``sidecar.recording.enabled``) onto a small disk: a tmpfs of ``--record-disk-mb`` MiB
  bind-mounted at ``<run>/sidecar/wire.rec`` when the process may mount one (else the recording is capped at
  that size by ``sidecar.recording.max_mb``).  The recording must stop with one error line per sidecar
  incarnation, training and publishing must go on, and the recording must read back whole (a torn last entry
  at most).

Round three (issue 38) adds four cases: (a) at ``--sender-flood-at`` of the run the hostile side signs
``--sender-flood`` messages from as many fresh sender ids (another run's: the sidecar ingests none of them, but
its sequence guard sees each), and shortly after the legit RL side restarts its sender (a new id, as a restarted
RL job has): it must go on being accepted; (b) every 20 s the task reward scores completions with tens of
thousands of spaces after ``Answer:`` (what SmolLM2's 64-space token can produce): each call must stay bounded;
(c) an RL-side ``DraftSource`` follows the run's published versions all along and at a quarter of the run is
handed 100,000 bogus notifications: no poll may stall, its log stays a few lines, and it keeps following
``latest``; (d) at the end the wire recording is read back while it is cut shorter and shorter: every read ends.

    python benchmarks/soak.py --minutes 10 --draft checkpoints/smollm2-demo

Run it alone on the machine (it uses both cores).  Drops of legit batches are split into those while the
sidecar was down (killed, restarting: the RL side must not wait, so these are expected and counted) and those
while it was up (the goal: 0).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
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

RUN = "soak"
LEGIT_SEND_TIMEOUT_S = 0.5  # the legit sender waits this long for a peer before it drops a message
SECTION = "## Soak: hostile input, kills and a full disk (`benchmarks/soak.py`)"


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _recipe(disk: Path, draft: str, extra: list[str]):
    from draft_align.config import CotrainRecipe, load_recipe

    overrides = [
        f"run={RUN}",
        f"output_dir={disk}",
        f"draft={draft}",
        "logging.wandb=false",
        "sidecar.publish.keep_versions=3",
        "sidecar.train.checkpoint_every_s=20",
        "sidecar.publish.every_s=10",
        "sidecar.publish.min_train_steps=1",
        "sidecar.buffer.min_tokens=1024",
        "sidecar.train.batch_tokens=512",
        "sidecar.gate.tolerance=64",
        "sidecar.monitor.prometheus_port=0",
        "wire.max_message_mb=16",
        "tap.tokens_per_step=1024",
        *extra,
    ]
    return load_recipe(ROOT / "recipes" / "smollm2_cotrain.yaml", overrides, CotrainRecipe)


# ----------------------------------------------------------------------------------------------- legit side
def role_legit(a: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draft_align import assets, data
    from draft_align.publish import load_draft
    from draft_align.rl.policy import Sequences
    from draft_align.tap.hf import HFPolicyTap
    from draft_align.wire import channel
    from draft_align.wire.messages import StepReport

    torch.set_num_threads(1)
    recipe = _recipe(Path(a.disk), a.draft, a.override)
    draft, _ = load_draft(Path(a.start))
    path = assets.resolve_model(recipe.target.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    convs = [
        c
        for c in data.load_conversations(assets.resolve_data("sharegpt"), limit=400)
        if any(m.role == "assistant" for m in c.messages)
    ]
    pairs = []
    for c in convs:
        reply = next(m.content for m in c.messages if m.role == "assistant")
        p = data.encode_prompt(tok, c)[-96:]
        r = torch.tensor(tok.encode(reply, add_special_tokens=False)[:64], dtype=torch.long)
        if p.numel() and r.numel():
            pairs.append((p, r))
    key = channel.resolve_key(None, recipe.run_dir, create=False)
    sender = channel.TapSender(
        channel.default_endpoint(recipe.run_dir, "tap"),
        key,
        max_message_bytes=recipe.wire.max_message_mb << 20,
        send_timeout_s=LEGIT_SEND_TIMEOUT_S,
    )
    tap = HFPolicyTap(
        model,
        tuple(draft.cfg.aux_layer_ids),
        sender,
        run_id=recipe.run,
        tokens_per_step=recipe.tap.tokens_per_step,
    )
    stop_file = Path(a.work) / "legit.stop"
    stats_file = Path(a.work) / "legit.json"
    restart_file = Path(a.work) / "legit.restart-sender"  # the orchestrator asks for a restarted sender
    restarted_at_step: int | None = None
    drops: list[dict[str, Any]] = []  # every drop with its wall-clock time (the orchestrator attributes them)
    dropped_before: dict[str, int] = {}  # the first sender's drop counters, carried over a restart

    def watch_drops() -> None:
        last = sender.stats()
        watched = sender
        while not stop_file.exists():
            time.sleep(0.01)
            if watched is not sender:  # restarted: a new sender counts from 0
                watched, last = sender, sender.stats()
            cur = sender.stats()
            for k, v in cur.items():
                if k.startswith("dropped") and v > last.get(k, 0):
                    drops.append({"t": time.time(), "key": k, "n": v - last.get(k, 0)})
            last = cur

    threading.Thread(target=watch_drops, daemon=True).start()
    step = version = 0
    offered_steps = 0
    t0 = time.monotonic()
    while not stop_file.exists():
        t_step = time.monotonic()
        if restarted_at_step is None and restart_file.exists():  # as a restarted RL job: a new sender id
            for k, v in sender.stats().items():
                if k.startswith("dropped"):
                    dropped_before[k] = dropped_before.get(k, 0) + v
            sender.close()
            sender = channel.TapSender(
                channel.default_endpoint(recipe.run_dir, "tap"),
                key,
                max_message_bytes=recipe.wire.max_message_mb << 20,
                send_timeout_s=LEGIT_SEND_TIMEOUT_S,
            )
            tap = HFPolicyTap(
                model,
                tuple(draft.cfg.aux_layer_ids),
                sender,
                run_id=recipe.run,
                tokens_per_step=recipe.tap.tokens_per_step,
            )
            restarted_at_step = step
        if step % 5 == 0 or step == restarted_at_step:
            version = step // 5
            tap.head_sync(version, draft.draft_to_target)
        batch = [pairs[(step * 4 + i) % len(pairs)] for i in range(4)]
        seqs = Sequences.pack(batch, pad_id=tok.pad_token_id or 0)
        with torch.no_grad(), tap.capturing():
            logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
            tap.submit(
                input_ids=seqs.input_ids,
                attention_mask=seqs.attention_mask,
                loss_mask=seqs.loss_mask,
                logits=logits,
                policy_version=version,
                step=step,
                temperature=1.0,
            )
        tap.end_step()
        sender.offer(
            StepReport(
                run_id=recipe.run,
                step=step,
                policy_version=version,
                metrics={
                    "reward/mean": 0.01 * step,
                    "kl-to-initial": 0.001 * step,
                    "accept len": 1.5,
                    "tap/dropped": 0.0,
                },
            )
        )
        offered_steps += 1
        step += 1
        _write_json(
            stats_file,
            {
                "time": time.time(),
                "steps": offered_steps,
                "sender": _summed(sender.stats(), dropped_before),
                "tap": tap.stats(),
                "drops": list(drops),
                "restarted_at_step": restarted_at_step,
            },
        )
        time.sleep(max(0.0, a.step_s - (time.monotonic() - t_step)))
    sender.offer(StepReport(run_id=recipe.run, step=step, policy_version=version, metrics={"final": 1.0}))
    sender.close()  # flushes what is queued (bounded by its close timeout)
    _write_json(
        stats_file,
        {
            "time": time.time(),
            "steps": offered_steps,
            "sender": _summed(sender.stats(), dropped_before),
            "restarted_at_step": restarted_at_step,
            "seconds": time.monotonic() - t0,
            "final_sent": True,
            "drops": list(drops),
            "send_timeout_s": LEGIT_SEND_TIMEOUT_S,
        },
    )


def _summed(stats: dict[str, Any], before: dict[str, int]) -> dict[str, Any]:
    """The sender's counters plus the drops of the sender it replaced."""
    return {k: v + before.get(k, 0) if k in before else v for k, v in stats.items()}


# --------------------------------------------------------------------------------------------- hostile side
class _Hostile:
    """Every category of bad input, as frames; ``sent`` counts each category's attempts."""

    def __init__(self, recipe: Any, key: bytes, draft: Any) -> None:
        import zmq

        from draft_align.wire import channel

        self.recipe = recipe
        self.key = key
        self.draft = draft
        self.ctx = zmq.Context()
        ep = channel.default_endpoint(recipe.run_dir, "tap")
        # the unauthenticated sockets never pass the handshake: a tiny queue bounds this process's own memory
        self.noauth = self._sock(ep, None, hwm=4)
        self.wrongkey = self._sock(ep, os.urandom(32), hwm=4)
        self.keyed = self._sock(ep, key, hwm=200)
        self.sent: dict[str, int] = {}
        self.blocked: dict[str, int] = {}
        self.rng = random.Random(1)
        self.seq = 0
        self.limit = recipe.wire.max_message_mb << 20

    def _sock(self, ep: str, key: bytes | None, hwm: int) -> Any:
        import zmq

        from draft_align.wire import channel

        s = self.ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, hwm)
        if key is not None:
            channel.authenticate(s, key)
        s.connect(ep)
        return s

    def _send(self, cat: str, sock: Any, frames: list[bytes]) -> None:
        import zmq

        self.sent[cat] = self.sent.get(cat, 0) + 1
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer is down or its queue full: counted as attempted, not delivered
            self.blocked[cat] = self.blocked.get(cat, 0) + 1

    def _signed(self, msg: Any, sender: str = "hostile", seq: int | None = None) -> list[bytes]:
        from draft_align.wire.codec import encode

        if seq is None:
            seq = self.seq = self.seq + 1
        return encode(msg, self.key, sender=sender, seq=seq)

    def _resign(self, frames: list[bytes]) -> list[bytes]:
        from draft_align.wire.codec import frame_mac

        return frames[:-1] + [frame_mac(self.key, frames[:-1])]

    def _report(self, step: int, **metrics: float) -> Any:
        from draft_align.wire.messages import StepReport

        return StepReport(run_id=self.recipe.run, step=step, policy_version=0, metrics=metrics or {"x": 0.0})

    def flood_one(self) -> None:
        """One message of a random rejected category."""
        r = self.rng.random()
        valid = self._signed(self._report(10**6 + self.rng.randrange(10**6)))
        if r < 0.12:
            self._send("no_key", self.noauth, [os.urandom(64)])
        elif r < 0.22:
            self._send("wrong_key", self.wrongkey, valid)
        elif r < 0.32:
            self._send(
                "junk_frames",
                self.keyed,
                [os.urandom(self.rng.randrange(1, 300)) for _ in range(self.rng.randrange(1, 14))],
            )
        elif r < 0.42:
            frames = [bytearray(f) for f in valid]
            i = self.rng.randrange(len(frames))
            if frames[i]:
                j = self.rng.randrange(len(frames[i]))
                frames[i][j] ^= 1 << self.rng.randrange(8)
            self._send("bit_flip", self.keyed, [bytes(f) for f in frames])
        elif r < 0.50:
            self._send("forged_mac", self.keyed, valid[:-1] + [os.urandom(32)])
        elif r < 0.58:
            self._send("truncated", self.keyed, [valid[0][: self.rng.randrange(len(valid[0]))]] + valid[1:])
        elif r < 0.66:
            head = json.loads(valid[0])
            head["fields"]["metrics"] = {"x": 10**400}
            self._send("huge_number", self.keyed, self._resign([json.dumps(head).encode(), valid[-1]]))
        elif r < 0.74:
            self._send("bomb_header", self.keyed, self._bomb())
        elif r < 0.82:  # the same signed message again: the first copy was accepted, the rest are replays
            if not hasattr(self, "_replayed"):
                self._replayed = self._signed(self._report(999_999), sender="hostile-replay", seq=5)
            self._send("replay", self.keyed, self._replayed)
        elif r < 0.88:
            self._send("stale_seq", self.keyed, self._signed(self._report(999_998), sender="hostile", seq=1))
        elif r < 0.94:
            from dataclasses import replace

            self._send("other_run", self.keyed, self._signed(replace(self._report(3), run_id="someone-else")))
        else:
            self._send("big_unauth", self.noauth, [b"\0" * (15 << 20)] * 2)

    def _bomb(self) -> list[bytes]:
        """A TapBatch header whose tensors claim ~10^9 tokens, with tiny frames, correctly signed."""
        from draft_align.wire.messages import TapBatch

        cfg = self.draft.cfg
        dummy = TapBatch.make_dummy(
            2,
            hidden_size=cfg.target_hidden_size,
            vocab_size=cfg.vocab_size,
            aux_layer_ids=tuple(cfg.aux_layer_ids),
        )
        frames = self._signed(dummy)
        head = json.loads(frames[0])
        for t in head["tensors"]:
            t["shape"] = [10**9] + t["shape"][1:]
        return self._resign([json.dumps(head).encode(), *frames[1:-1], b""])

    def insider_one(self) -> None:
        """One signed, well-formed message an insider could send (low rate)."""
        import torch

        from draft_align.wire.messages import HeadSync, TapBatch

        cfg = self.draft.cfg
        r = self.rng.random()
        if r < 0.4:  # a hundred new metric names per report: the Prometheus families stay bounded
            names = {f"junk/{self.rng.randrange(10**9)}": 1.0 for _ in range(100)}
            self._send(
                "insider_metric_names", self.keyed, self._signed(self._report(2_000_000 + self.seq, **names))
            )
        elif r < 0.75:  # taps of a step never reported: the held records stay bounded
            tb = TapBatch.make_dummy(
                4,
                min_len=64,
                max_len=128,
                hidden_size=cfg.target_hidden_size,
                vocab_size=cfg.vocab_size,
                aux_layer_ids=tuple(cfg.aux_layer_ids),
                topk=1,
            )
            from dataclasses import replace

            tb = replace(tb, run_id=self.recipe.run, step=3_000_000 + self.seq)
            self._send("insider_unreported_taps", self.keyed, self._signed(tb))
        else:  # a poisoned (finite, 3e38) head
            d2t = self.draft.draft_to_target
            hs = HeadSync(
                run_id=self.recipe.run,
                policy_version=0,
                hidden_size=cfg.target_hidden_size,
                vocab_size=cfg.vocab_size,
                norm_eps=1e-5,
                norm_weight=torch.ones(cfg.target_hidden_size),
                draft_to_target=d2t,
                rows=torch.full((d2t.numel(), cfg.target_hidden_size), 3e38).bfloat16(),
            )
            self._send("insider_poisoned_head", self.keyed, self._signed(hs))

    def sender_flood(self, n: int) -> None:
        """``n`` signed messages from as many fresh sender ids (another run's StepReports: the sidecar ingests
        none, its sequence guard sees each): 4,096 of them used to lock a new legit sender out for an hour."""
        from dataclasses import replace

        msg = replace(self._report(4), run_id="someone-else")
        for i in range(n):
            self._send("sender_flood", self.keyed, self._signed(msg, sender=f"flood-{i}", seq=0))

    def huge_version(self) -> None:
        """A HeadSync with a huge policy version (once): the RL side's lower versions become a restart."""
        import torch

        from draft_align.wire.messages import HeadSync

        cfg = self.draft.cfg
        d2t = self.draft.draft_to_target
        hs = HeadSync(
            run_id=self.recipe.run,
            policy_version=10**12,
            hidden_size=cfg.target_hidden_size,
            vocab_size=cfg.vocab_size,
            norm_eps=1e-5,
            norm_weight=torch.ones(cfg.target_hidden_size),
            draft_to_target=d2t,
            rows=torch.zeros(d2t.numel(), cfg.target_hidden_size).bfloat16(),
        )
        self.sent["insider_huge_policy_version"] = 1
        self.keyed.send_multipart(self._signed(hs))  # blocks until queued: this one must arrive


def role_hostile(a: argparse.Namespace) -> None:
    import torch

    from draft_align.publish import load_draft
    from draft_align.wire import channel

    torch.set_num_threads(1)
    recipe = _recipe(Path(a.disk), a.draft, a.override)
    draft, _ = load_draft(Path(a.start))
    key = channel.resolve_key(None, recipe.run_dir, create=False)
    h = _Hostile(recipe, key, draft)
    stop_file = Path(a.work) / "hostile.stop"
    stats_file = Path(a.work) / "hostile.json"
    t0 = time.monotonic()
    n = 0
    huge_sent = False
    flooded = False
    last_write = 0.0
    while not stop_file.exists():
        now = time.monotonic() - t0
        h.flood_one()
        n += 1
        if n % max(1, int(a.hostile_rate)) == 0:  # ~1 insider message per second
            h.insider_one()
        if not huge_sent and now > a.huge_version_at_s:
            h.huge_version()
            huge_sent = True
        if not flooded and now > a.sender_flood_at_s:
            h.sender_flood(a.sender_flood)
            flooded = True
            (Path(a.work) / "sender_flood.done").write_text(str(time.time()))
        if now - last_write > 1.0:
            _write_json(stats_file, {"seconds": now, "sent": h.sent, "blocked": h.blocked})
            last_write = now
        ahead = n / a.hostile_rate - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    _write_json(stats_file, {"seconds": time.monotonic() - t0, "sent": h.sent, "blocked": h.blocked})
    h.ctx.destroy(linger=0)


# ----------------------------------------------------------------------------------------------- orchestrator
def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    except OSError:
        return None
    return None


def _scrape(run_dir: Path) -> dict[str, float] | None:
    from draft_align.monitor.sinks import REJECTED
    from draft_align.sidecar.layout import PORT_FILE, SIDECAR_DIR

    try:
        port = int((run_dir / SIDECAR_DIR / PORT_FILE).read_text())
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except (OSError, ValueError):
        return None
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith(REJECTED + "_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out["rejected:" + reason] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("draft_align_") and not line.startswith("#") and "{" not in line:
            name, _, v = line.partition(" ")
            try:
                out[name] = float(v)
            except ValueError:
                pass
    return out


def _verify_versions(run_dir: Path) -> tuple[int, list[str]]:
    """(versions verified, problems): every visible ``v*`` folder's manifest and files, and ``latest``."""
    from draft_align.publish.folder import CorruptCheckpointError, read_manifest
    from draft_align.publish.versions import read_latest

    ok, problems = 0, []
    for d in sorted((run_dir / "drafts").glob("v*")):
        try:
            read_manifest(d, verify=True)
            ok += 1
        except CorruptCheckpointError as e:
            if d.exists():  # (deleted by retention while being read is fine)
                problems.append(f"{d.name}: {e}")
    try:
        latest = read_latest(run_dir)
        if latest is not None:
            read_manifest(latest, verify=True)
    except Exception as e:  # noqa: BLE001 - any failure is a finding
        problems.append(f"latest: {e}")
    return ok, problems


def _mount_disk(size_mb: int) -> tuple[Path, bool]:
    d = Path(tempfile.mkdtemp(prefix="draft-align-soak-"))
    if os.geteuid() == 0 and shutil.which("mount"):
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(d)], capture_output=True
        )
        if done.returncode == 0:
            return d, True
    return d, False


class _SmallDiskRecording:
    """``sidecar.recording.enabled`` onto a small disk: a tmpfs of ``size_mb`` MiB whose one file is bind-mounted at
    ``<run>/sidecar/wire.rec`` (root, ``mount``), else the recording capped at ``size_mb`` by
    ``sidecar.recording.max_mb``.  :meth:`watch` follows the sidecar's log for the recorder's stop lines;
    :meth:`result` reads the recording back."""

    STOP = "wire recording "  # … "<path> stopped: <why>" (wire/recording.py, WireRecorder._fail)

    def __init__(self, run_dir: Path, size_mb: int, log_file: Path) -> None:
        from draft_align.sidecar.layout import SIDECAR_DIR, WIRE_RECORDING

        self.size_mb = size_mb
        self.path = run_dir / SIDECAR_DIR / WIRE_RECORDING
        self.log_file = log_file
        self.small: Path | None = None
        self.bound = False
        self.stops: list[dict[str, Any]] = []  # each stop line: seconds into the run, its reason
        self._log_pos = 0
        if os.geteuid() == 0 and shutil.which("mount"):
            small = Path(tempfile.mkdtemp(prefix="draft-align-soak-rec-"))
            ok = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(small)],
                capture_output=True,
            )
            if ok.returncode == 0:
                self.small = small
                self.path.parent.mkdir(parents=True, exist_ok=True)
                for f in (small / WIRE_RECORDING, self.path):
                    f.touch(mode=0o600)
                bind = subprocess.run(
                    ["mount", "--bind", str(small / WIRE_RECORDING), str(self.path)], capture_output=True
                )
                self.bound = bind.returncode == 0
            else:
                small.rmdir()

    def overrides(self) -> list[str]:
        """Bound: no reserve beyond its floor (32 bytes per draft parameter, free on the run folder's disk, which
        the default 2048 MiB would exceed on the soak's disk and stop the recording at its first message), so
        that the small disk itself fills up; else the cap."""
        if self.bound:
            return ["sidecar.recording.enabled=true", "sidecar.recording.reserve_mb=0"]
        return ["sidecar.recording.enabled=true", f"sidecar.recording.max_mb={self.size_mb}"]

    def watch(self, t_run: float) -> None:
        """New stop lines in the sidecar's log (``t_run``: seconds into the run, for each one found)."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(self._log_pos)
                text = f.read()
        except OSError:
            return
        cut = text.rfind(b"\n") + 1  # whole lines only
        self._log_pos += cut
        for line in text[:cut].decode(errors="replace").splitlines():
            if self.STOP in line and " stopped: " in line:
                self.stops.append({"t_s": round(t_run, 1), "why": line.split(" stopped: ", 1)[1][:200]})

    def result(self, run_dir: Path, t_first_stop_wall: float | None, incarnations: int) -> dict[str, Any]:
        """After the sidecar exited: the recording read back, what trained and published after the first stop,
        then the mounts removed."""
        from draft_align.sidecar.layout import MONITOR_FILE, PUBLISH_FILE, SIDECAR_DIR
        from draft_align.wire.recording import Recording, RecordingError

        out: dict[str, Any] = {
            "disk": f"tmpfs {self.size_mb} MiB bound at wire.rec"
            if self.bound
            else "none (record_wire_mb cap)",
            "size_mb": self.size_mb,
            "stop_lines": len(self.stops),
            "incarnations": incarnations,
            "stops": self.stops[:20],
        }
        try:
            out["file_bytes"] = self.path.stat().st_size
            rec = Recording(self.path, skip_damaged=True)
            out["read_error"] = None
            out["entries"] = sum(1 for _ in rec)
            out["damaged"], out["truncated_bytes"] = rec.damaged, rec.truncated_bytes
        except (OSError, RecordingError) as e:
            out["read_error"] = f"{type(e).__name__}: {e}"[:300]

        def after(name: str) -> list[dict[str, Any]]:
            rows = []
            try:
                lines = (run_dir / SIDECAR_DIR / name).read_text(errors="replace").splitlines()
            except OSError:
                return rows
            for line in lines:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                t = row.get("time")
                if t_first_stop_wall is not None and isinstance(t, (int, float)) and t > t_first_stop_wall:
                    rows.append(row)
            return rows

        pubs, rows = after(PUBLISH_FILE), after(MONITOR_FILE)
        steps = [r["sidecar_train_steps"] for r in rows if isinstance(r.get("sidecar_train_steps"), int)]
        out["published_after_first_stop"] = len(pubs)
        out["monitor_rows_after_first_stop"] = len(rows)
        out["train_steps_after_first_stop"] = (max(steps) - min(steps)) if steps else 0
        out["goal_met"] = (
            1 <= out["stop_lines"] <= incarnations
            and out.get("read_error") is None
            and out.get("damaged") == 0
            and out["published_after_first_stop"] > 0
            and out["train_steps_after_first_stop"] > 0
        )
        if self.bound:
            subprocess.run(["umount", str(self.path)], capture_output=True)
        if self.small is not None:
            subprocess.run(["umount", "-l", str(self.small)], capture_output=True)
            shutil.rmtree(self.small, ignore_errors=True)
        return out


def _fill(disk: Path) -> int:
    """Fill the disk until ENOSPC; returns the bytes written."""
    n = 0
    chunk = b"\0" * (1 << 20)
    with open(disk / "filler.bin", "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
                n += len(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return n


PROBE_STEP = 7_000_000  # probe i of kill n reports step PROBE_STEP + 100·n + i


class _Prober:
    """Signed StepReports sent before each kill and replayed after each restart (a key holder's raw socket:
    it passes the handshake, and the envelope alone must stop the replays)."""

    def __init__(self, recipe: Any, key: bytes, per_kill: int) -> None:
        import zmq

        from draft_align.wire import channel

        self.recipe, self.key, self.per_kill = recipe, key, per_kill
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        channel.authenticate(self.sock, key)
        self.sock.connect(channel.default_endpoint(recipe.run_dir, "tap"))
        self.captured: list[list[bytes]] = []
        self.steps: list[int] = []
        self.sent = self.replayed = self.blocked = 0

    def _send(self, frames: list[bytes]) -> bool:
        import zmq

        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.blocked += 1
            return False

    def probe(self, n: int) -> None:
        """This kill's probes (sender ``soak-probe-<n>``, seq 0..)."""
        from draft_align.wire.codec import encode
        from draft_align.wire.messages import StepReport

        for i in range(self.per_kill):
            step = PROBE_STEP + 100 * n + i
            msg = StepReport(
                run_id=self.recipe.run, step=step, policy_version=0, metrics={"soak_replay_probe": 1.0}
            )
            frames = encode(msg, self.key, sender=f"soak-probe-{n}", seq=i)
            if self._send(frames):
                self.captured.append(frames)
                self.steps.append(step)
                self.sent += 1

    def replay(self) -> None:
        """Every probe captured so far, exactly as sent."""
        for frames in self.captured:
            self.replayed += self._send(frames)

    def result(self, monitor_file: Path) -> dict[str, Any]:
        """How often each probe step became a monitoring row (1: accepted once; more: a replay accepted)."""
        rows = dict.fromkeys(self.steps, 0)
        try:
            lines = monitor_file.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                step = json.loads(line).get("step")
            except ValueError:
                continue
            if step in rows:
                rows[step] += 1
        self.ctx.destroy(linger=0)
        return {
            "probes_sent": self.sent,
            "probe_messages_replayed_after_restarts": self.replayed,
            "not_queued": self.blocked,
            "probe_rows_seen": sum(1 for c in rows.values() if c),
            "accepted_again": sum(max(0, c - 1) for c in rows.values()),
        }


class _Queue:
    """DraftPublished notifications handed to the RL side's DraftSource (the Subscriber's interface)."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.pos = 0

    def poll(self, timeout_ms: int | None = 0) -> Any:
        if self.pos >= len(self.items):
            return None
        self.pos += 1
        return self.items[self.pos - 1]


class _RoundThree:
    """Issue 38's cases beside the sidecar (see the module docstring): the reward on long whitespace, an RL-side
    DraftSource under a notification flood, the legit sender restarted after the sender flood, a shrinking
    recording read back."""

    FLOOD = 100_000

    def __init__(self, recipe: Any, start: Path, work: Path) -> None:
        import logging

        from draft_align.rl.drafts import DraftSource

        self.recipe, self.work = recipe, work
        self.queue = _Queue()
        self.drafts = DraftSource(recipe.run_dir, start, notifications=self.queue)
        self.log_lines = 0
        outer = self

        class Count(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                outer.log_lines += 1

        logging.getLogger("draft_align.rl.drafts").addHandler(Count(level=logging.WARNING))
        self.polls = 0
        self.poll_max_s = 0.0
        self.flooded_at: float | None = None
        self.reward_calls = 0
        self.reward_max_s = 0.0
        self.reward_errors: list[str] = []
        self.next_reward = 0.0
        self.sender_restarted_at: float | None = None

    def tick(self, t: float, run_s: float) -> None:
        from draft_align.wire.messages import DraftPublished

        if self.flooded_at is None and t > 0.25 * run_s:
            bogus = DraftPublished(
                run_id="someone-else",
                draft_version=9,
                policy_version=0,
                path="/x/drafts/v0009",
                sha256="0" * 64,
            )
            self.queue.items += [bogus] * self.FLOOD
            self.flooded_at = t
        t0 = time.perf_counter()
        self.drafts.poll()
        self.poll_max_s = max(self.poll_max_s, time.perf_counter() - t0)
        self.polls += 1
        if t >= self.next_reward:
            self.next_reward = t + 20.0
            self.rewards()
        done = self.work / "sender_flood.done"
        if self.sender_restarted_at is None and done.exists() and time.time() - float(done.read_text()) > 3.0:
            (self.work / "legit.restart-sender").touch()
            self.sender_restarted_at = round(t, 1)

    def rewards(self) -> None:
        from draft_align.rl.rewards import safe_reward, task

        texts = [
            "Answer:" + " " * 32_768 + "x",
            "Answer: **" + " \t" * 20_000 + "7",
            "so 3 + 4 = 7\n" + "1" + ",000" * 20_000 + ",9\nAnswer:" + " " * 50_000,
        ]
        for text in texts:
            t0 = time.perf_counter()
            _, error = safe_reward(task, text, True, 7)
            self.reward_max_s = max(self.reward_max_s, time.perf_counter() - t0)
            self.reward_calls += 1
            if error is not None:
                self.reward_errors.append(error)

    def shrinking_recording(self) -> dict[str, Any]:
        """The wire recording read back while a copy of it is cut shorter and shorter, five times."""
        import threading

        from draft_align.sidecar.layout import SIDECAR_DIR, WIRE_RECORDING
        from draft_align.wire.recording import Recording

        src = self.recipe.run_dir / SIDECAR_DIR / WIRE_RECORDING
        if not src.is_file() or src.stat().st_size < 1024:
            return {"skipped": f"no recording at {src}"}
        copy = self.work / "shrinking.rec"
        out = {"reads": 0, "ended": 0, "entries": []}
        for trial in range(5):
            shutil.copyfile(src, copy)
            size = copy.stat().st_size
            got: dict[str, Any] = {}

            def read(got: dict[str, Any] = got) -> None:
                try:
                    got["n"] = sum(1 for _ in Recording(copy, skip_damaged=True))
                except Exception as e:  # one clear error is an ending too
                    got["error"] = type(e).__name__
                    got["n"] = 0

            th = threading.Thread(target=read, daemon=True)
            th.start()
            for k in range(1, 11):  # cut while it is read
                os.truncate(copy, max(8, size * (10 - k) // (10 + trial)))
                time.sleep(0.01)
            th.join(20.0)
            out["reads"] += 1
            out["ended"] += 0 if th.is_alive() else 1
            out["entries"].append(got.get("n"))
        copy.unlink(missing_ok=True)
        return out

    def result(
        self, run_dir: Path, restarted_at_step: int | None, rejected: dict[str, float]
    ) -> dict[str, Any]:
        from draft_align.monitor.live import iter_jsonl
        from draft_align.publish.versions import folder_version, read_latest
        from draft_align.sidecar.layout import MONITOR_FILE, SIDECAR_DIR

        monitor = run_dir / SIDECAR_DIR / MONITOR_FILE
        rows = (
            list(iter_jsonl(monitor)) if monitor.exists() else []  # a line torn by a kill -9 is skipped
        )
        latest = read_latest(run_dir)
        after = [r for r in rows if restarted_at_step is not None and r.get("step", -1) >= restarted_at_step]
        return {
            "reward": {
                "calls": self.reward_calls,
                "max_s": round(self.reward_max_s, 4),
                "errors": self.reward_errors[:3],
            },
            "notification_flood": {
                "notifications": self.FLOOD,
                "at_s": None if self.flooded_at is None else round(self.flooded_at, 1),
                "polls": self.polls,
                "poll_max_s": round(self.poll_max_s, 3),
                "log_lines": self.log_lines,
                "left_unread": len(self.queue.items) - self.queue.pos,
                "following": self.drafts.current_version,
                "latest": folder_version(latest) if latest is not None else None,
            },
            "sender_restart": {
                "restarted_at_s": self.sender_restarted_at,
                "restarted_at_step": restarted_at_step,
                "rows_after_restart": len(after),
                "rejected_senders": int(rejected.get("senders", 0)),
                "rejected_sequence": int(rejected.get("sequence", 0)),
            },
            "log_bytes": {
                "sidecar_log": (self.work / "sidecar.log").stat().st_size
                if (self.work / "sidecar.log").exists()
                else None,
                "monitor_jsonl": monitor.stat().st_size if monitor.exists() else None,
            },
        }


def orchestrate(a: argparse.Namespace) -> dict[str, Any]:
    from draft_align.cotrain import spawn_sidecar, write_resolved
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.layout import READY_FILE, SIDECAR_DIR, STATE_FILE

    disk, mounted = _mount_disk(a.disk_mb)
    work = Path(tempfile.mkdtemp(prefix="draft-align-soak-work-"))
    rng = random.Random(a.seed)
    log_file = work / "sidecar.log"
    small = None  # record_wire on a small disk (--record-disk-mb)
    if a.record_disk_mb > 0:
        small = _SmallDiskRecording(_recipe(disk, a.draft, a.override).run_dir, a.record_disk_mb, log_file)
    recipe = _recipe(disk, a.draft, [*a.override, *(small.overrides() if small else [])])
    resolved = write_resolved(recipe)
    start = starting_draft(recipe)
    from draft_align.wire import channel

    key = channel.resolve_key(None, recipe.run_dir, create=True)
    prober = _Prober(recipe, key, a.replay_probes)
    round3 = _RoundThree(recipe, start, work)
    replay_pending = False
    second: subprocess.Popen | None = None
    second_info: dict[str, Any] = {"started": False}
    common = [
        "--disk",
        str(disk),
        "--draft",
        a.draft,
        "--start",
        str(start),
        "--work",
        str(work),
        *sum((["--override", o] for o in a.override), []),
    ]
    print(
        f"soak: run folder {recipe.run_dir} ({f'tmpfs {a.disk_mb} MiB' if mounted else 'no tmpfs'}), "
        f"work {work}",
        flush=True,
    )
    sidecar = spawn_sidecar(resolved, start, log_file)
    time.sleep(a.warmup_s)
    legit = subprocess.Popen(
        [sys.executable, __file__, "--role", "legit", "--step-s", str(a.step_s), *common],
        stdout=open(work / "legit.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    hostile = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "hostile",
            "--hostile-rate",
            str(a.hostile_rate),
            "--huge-version-at-s",
            str(a.minutes * 60 * 0.6),
            "--sender-flood-at-s",
            str(a.minutes * 60 * a.sender_flood_at),
            "--sender-flood",
            str(a.sender_flood),
            *common,
        ],
        stdout=open(work / "hostile.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    t0 = time.monotonic()
    wall0 = time.time()
    end = t0 + a.minutes * 60
    kills: list[dict[str, Any]] = []
    next_kill = t0 + rng.uniform(a.kill_every_s * 0.5, a.kill_every_s * 1.5)
    disk_full_at = t0 + a.minutes * 60 * 0.45
    disk_full: dict[str, Any] = {"mounted": mounted}
    filled = False
    rss: list[tuple[float, int]] = []
    incarnations: list[dict[str, float]] = []
    last_scrape: dict[str, float] | None = None
    verified = 0
    problems: list[str] = []
    next_verify = t0 + 30
    down_since: float | None = None
    down_s = 0.0
    legit_windows: list[tuple[bool, dict[str, Any]]] = []  # (sidecar up, legit stats) every second
    # wall-clock intervals the sidecar was not serving: [killed or found dead, its ready file written]
    down_intervals: list[list[float | None]] = []
    crashes = []
    first_stop_wall: float | None = None  # when the recording's first stop line was seen
    up_s = 0.0  # seconds (one-second samples) the sidecar was running with its sockets bound

    def ready() -> bool:
        """The running sidecar has bound its sockets (its ready file names its pid)."""
        try:
            return json.loads((recipe.run_dir / SIDECAR_DIR / READY_FILE).read_text())["pid"] == sidecar.pid
        except (OSError, ValueError, KeyError):
            return False

    def legit_stats() -> dict[str, Any]:
        try:
            return json.loads((work / "legit.json").read_text())
        except (OSError, ValueError):
            return {}

    def restart(reason: str) -> None:
        nonlocal sidecar, last_scrape, down_since, down_s
        if last_scrape:
            incarnations.append(last_scrape)
        last_scrape = None
        sidecar = spawn_sidecar(resolved, start, log_file)
        down_s += time.monotonic() - (down_since or time.monotonic())
        down_since = None

    while time.monotonic() < end:
        now = time.monotonic()
        r = _rss(sidecar.pid)
        if r is not None:
            rss.append((now - t0, r))
        s = _scrape(recipe.run_dir)
        if s is not None:
            last_scrape = s
        up = sidecar.poll() is None and ready()
        if small is not None:
            small.watch(now - t0)
            if small.stops and first_stop_wall is None:
                first_stop_wall = time.time()
        if up and down_intervals and down_intervals[-1][1] is None:
            down_intervals[-1][1] = (recipe.run_dir / SIDECAR_DIR / READY_FILE).stat().st_mtime
        legit_windows.append((up, legit_stats()))
        up_s += 1.0 if up else 0.0
        round3.tick(now - t0, a.minutes * 60)
        if up and replay_pending:  # the restarted sidecar is serving: every captured probe again
            prober.replay()
            replay_pending = False
        if up and second is None and now - t0 >= a.minutes * 60 * a.second_sidecar_at:
            second = spawn_sidecar(resolved, start, work / "second.log")
            second_info = {"started": True, "t": round(now - t0, 1), "first_pid": sidecar.pid}
        if second is not None and "rc" not in second_info:
            if second.poll() is not None:
                second_info["rc"] = second.returncode
                second_info["seconds"] = round(now - t0 - second_info["t"], 1)
                text = (work / "second.log").read_text(errors="replace")
                line = next((x for x in text.splitlines() if "in use by another sidecar" in x), None)
                second_info["refusal"] = line
                second_info["names_first_pid"] = (
                    line is not None and f"pid {second_info['first_pid']}," in line
                )
                second_info["first_still_running"] = sidecar.poll() is None
            elif now - t0 - second_info["t"] > 300:
                second.kill()
                second.wait()
                second_info["rc"] = "killed after 300 s (not refused)"
        if sidecar.poll() is not None:  # it exited by itself: a crash (or a clean stop we did not ask for)
            crashes.append({"t": now - t0, "rc": sidecar.returncode})
            down_since = now
            down_intervals.append([time.time() - 1.0, None])  # it died within the last sample
            restart("crash")
        if now >= next_kill and second is not None and "rc" not in second_info:
            next_kill = now + 5.0  # no kill while the second sidecar is being refused (it would get the lock)
        if now >= next_kill:
            prober.probe(len(kills))
            time.sleep(2.0)  # handled, and the sequence guard saved (at most every 0.5 s)
            down_intervals.append([time.time(), None])
            os.kill(sidecar.pid, signal.SIGKILL)
            sidecar.wait()
            down_since = time.monotonic()
            n, bad = _verify_versions(recipe.run_dir)
            verified += n
            problems += bad
            kills.append(
                {
                    "t": round(now - t0, 1),
                    "versions_visible": n,
                    "problems": bad,
                    "disk_full": filled and "end_s" not in disk_full,
                }
            )
            time.sleep(rng.uniform(0.5, 3.0))  # the RL side runs on while the sidecar is dead
            restart("kill")
            replay_pending = True
            next_kill = time.monotonic() + rng.uniform(a.kill_every_s * 0.5, a.kill_every_s * 1.5)
        if mounted and not filled and now >= disk_full_at:
            disk_full["filled_bytes"] = _fill(disk)
            disk_full["start_s"] = round(now - t0, 1)
            filled = True
        if filled and "end_s" not in disk_full and now >= disk_full_at + a.full_disk_s:
            (disk / "filler.bin").unlink()
            disk_full["end_s"] = round(now - t0, 1)
        if now >= next_verify:
            n, bad = _verify_versions(recipe.run_dir)
            verified += n
            problems += bad
            next_verify = now + 30
        time.sleep(1.0)
    if filled and "end_s" not in disk_full:
        (disk / "filler.bin").unlink()
        disk_full["end_s"] = round(time.monotonic() - t0, 1)
    (work / "hostile.stop").touch()
    hostile.wait(timeout=60)
    time.sleep(3)
    (work / "legit.stop").touch()
    legit.wait(timeout=120)
    try:  # the final StepReport ends the sidecar (--exit-when-done)
        rc = sidecar.wait(timeout=180)
    except subprocess.TimeoutExpired:
        sidecar.kill()
        rc = None
    if last_scrape:
        incarnations.append(last_scrape)
    n, bad = _verify_versions(recipe.run_dir)
    verified += n
    problems += bad
    if second is not None and second.poll() is None:
        second.kill()
        second.wait()
        second_info.setdefault("rc", "still running at the end (not refused)")
    replay_after_restart = prober.result(recipe.run_dir / SIDECAR_DIR / "monitor.jsonl")
    shrinking = round3.shrinking_recording()
    record_small_disk: dict[str, Any] = {"enabled": False}
    if small is not None:
        small.watch(time.monotonic() - t0)
        first_stop_wall = first_stop_wall or (time.time() if small.stops else None)
        record_small_disk = {
            "enabled": True,
            **small.result(recipe.run_dir, first_stop_wall, 1 + len(kills) + len(crashes)),
        }
    tmp_left = [p.name for p in (recipe.run_dir / "drafts").glob(".tmp-*")]
    state = json.loads((recipe.run_dir / SIDECAR_DIR / STATE_FILE).read_text())
    hostile_stats = json.loads((work / "hostile.json").read_text())
    final_legit = legit_stats()

    # legit drops, split by whether the sidecar was up over each one-second window
    drop_keys = [k for k in final_legit.get("sender", {}) if k.startswith("dropped")]
    up_drops = dict.fromkeys(drop_keys, 0)
    down_drops = dict.fromkeys(drop_keys, 0)
    prev: dict[str, Any] = {}
    for up, st in legit_windows:
        cur = st.get("sender", {})
        for k in drop_keys:
            d = cur.get(k, 0) - prev.get(k, 0)
            if d > 0:
                (up_drops if up else down_drops)[k] += d
        if cur:
            prev = cur
    for k in drop_keys:  # after the loop (the final flush): the sidecar was up
        d = final_legit["sender"].get(k, 0) - prev.get(k, 0)
        if d > 0:
            up_drops[k] += d
    # the same drops attributed exactly: each drop's wall-clock time against the down intervals, widened by the
    # sender's timeout (a message offered while the sidecar was down is dropped up to that long after)
    grace = final_legit.get("send_timeout_s", LEGIT_SEND_TIMEOUT_S) + 0.1
    exact_up: dict[str, int] = {}
    exact_down: dict[str, int] = {}
    up_detail = []
    for d in final_legit.get("drops", []):
        iv = next((i for i in down_intervals if i[0] <= d["t"] <= (i[1] or float("inf")) + grace), None)
        (exact_down if iv else exact_up)[d["key"]] = (exact_down if iv else exact_up).get(d["key"], 0) + d[
            "n"
        ]
        if iv is None:
            last_up = max((i[1] for i in down_intervals if i[1] is not None and i[1] <= d["t"]), default=None)
            up_detail.append(
                {
                    "t_s": round(d["t"] - (wall0 or d["t"]), 2),
                    "key": d["key"],
                    "n": d["n"],
                    "s_since_last_restart": None if last_up is None else round(d["t"] - last_up, 2),
                }
            )
    rejected: dict[str, float] = {}
    for inc in incarnations:
        for k, v in inc.items():
            if k.startswith("rejected:"):
                rejected[k.split(":", 1)[1]] = rejected.get(k.split(":", 1)[1], 0) + v
    rss_mb = [v / 2**20 for _, v in rss]
    delivered = sum(hostile_stats["sent"].values()) - sum(hostile_stats["blocked"].values())
    quarter = max(1, len(rss) // 4)
    out = {
        "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
        "minutes": a.minutes,
        "hostile_rate_target": a.hostile_rate,
        "hostile_sent_by_category": hostile_stats["sent"],
        "hostile_sent_total": sum(hostile_stats["sent"].values()),
        "hostile_msgs_per_s": round(
            sum(hostile_stats["sent"].values()) / max(1e-9, hostile_stats["seconds"]), 1
        ),
        "hostile_not_delivered_by_category": hostile_stats["blocked"],
        "hostile_delivered_total": delivered,
        "hostile_delivered_per_s": round(delivered / max(1e-9, hostile_stats["seconds"]), 1),
        "sidecar_rejected_by_reason": rejected,
        "sidecar_state": {
            k: state.get(k)
            for k in (
                "published_version",
                "train_steps",
                "trained_tokens",
                "ingested_messages",
                "restarts",
                "rl_restarts",
                "nonfinite_heads",
                "nonfinite_alarms",
                "held_dropped_records",
                "publish_failures",
                "foreign_messages",
                "mismatched_messages",
                "last_step_report",
                "done",
                "untrainable_records",
                "version_overflows",
            )
        },
        "replay_after_restart": replay_after_restart,
        "second_sidecar": second_info,
        "record_wire_small_disk": record_small_disk,
        "legit": {
            "steps": final_legit.get("steps"),
            "sender": final_legit.get("sender"),
            "dropped_while_up_sampled": up_drops,
            "dropped_while_down_sampled": down_drops,
            "dropped_while_up": exact_up,
            "dropped_while_down": exact_down,
            "dropped_while_up_detail": up_detail,
            "down_intervals_s": [[round(x - wall0, 2) if x else None for x in i] for i in down_intervals],
        },
        "sidecar_down_s": round(down_s, 1),
        "sidecar_ready_s": round(up_s, 1),
        "kills": kills,
        "crashes": crashes,
        "restarts_survived": len(kills),
        "versions_verified": verified,
        "version_problems": problems,
        "tmp_folders_left": tmp_left,
        "rss_mib": {
            "min": round(min(rss_mb), 1),
            "max": round(max(rss_mb), 1),
            "median": round(statistics.median(rss_mb), 1),
            "max_by_quarter": [
                round(max(rss_mb[i : i + quarter]), 1) for i in range(0, len(rss_mb), quarter)
            ][:4],
        },
        "disk_full": disk_full,
        "sidecar_exit": rc,
        "round_three": {
            **round3.result(recipe.run_dir, final_legit.get("restarted_at_step"), rejected),
            "shrinking_recording": shrinking,
        },
    }
    if mounted:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    shutil.rmtree(work / "none", ignore_errors=True)
    print(f"soak: logs in {work}", flush=True)
    return out


def _nonzero(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items() if v) or "0"


def _drop_times(detail: list[dict[str, Any]]) -> str:
    return ", ".join(f"{d['t_s']} s ({d['s_since_last_restart']} s)" for d in detail) or "none"


def _replays(p: dict[str, Any]) -> str:
    keys = ("probes_sent", "probe_messages_replayed_after_restarts", "probe_rows_seen", "accepted_again")
    return " / ".join(str(p.get(k, "–")) for k in keys)


def _second(s: dict[str, Any]) -> str:
    if not s.get("started"):
        return "not started"
    return (
        f"exit {s.get('rc')} after {s.get('seconds')} s; names the pid: {s.get('names_first_pid')}; "
        f"first still running: {s.get('first_still_running')}"
    )


def _recording(d: dict[str, Any]) -> str:
    if not d.get("enabled"):
        return "not run"
    read = (
        f"read back: {d['read_error']}"
        if d.get("read_error")
        else f"read back: {d.get('entries')} whole entries, {d.get('damaged')} damaged, "
        f"{d.get('truncated_bytes')} torn bytes at the end"
    )
    stops = d.get("stops") or []
    first = f" (first at {stops[0]['t_s']} s: {stops[0]['why']})" if stops else ""
    after = (
        f"after the first stop: {d['published_after_first_stop']} publishes, "
        f"{d['train_steps_after_first_stop']} train steps, {d['monitor_rows_after_first_stop']} monitoring rows"
        if stops
        else "the recording never stopped (its disk did not fill)"
    )
    return (
        f"goal met: {'yes' if d.get('goal_met') else 'no'}; {d['disk']}; stop lines {d['stop_lines']} for "
        f"{d['incarnations']} sidecar incarnations{first}; file {d.get('file_bytes', 0) / 2**20:.1f} MiB, "
        f"{read}; {after}"
    )


def _round_three(r3: dict[str, Any] | None) -> list[str]:
    """The round-three cases' table (issue 38)."""
    if not r3:
        return []
    rw, nf, sr, lb, shr = (
        r3["reward"],
        r3["notification_flood"],
        r3["sender_restart"],
        r3["log_bytes"],
        r3["shrinking_recording"],
    )
    shrink = (
        shr["skipped"]
        if "skipped" in shr
        else f"{shr['ended']} of {shr['reads']} reads ended (entries read: {shr['entries']})"
    )
    return [
        "Round three (issue 38):",
        "",
        "| case | goal | measured |",
        "|---|---|---|",
        f"| the task reward on 32k–50k spaces after `Answer:` ({rw['calls']} calls) | bounded, no timeout | "
        f"max {rw['max_s']:.4f} s; errors {len(rw['errors'])} |",
        f"| sender flood ({'then' if sr['restarted_at_s'] is not None else 'no'} the legit sender restarted at "
        f"{sr['restarted_at_s'] if sr['restarted_at_s'] is not None else '-'} s, RL step {sr['restarted_at_step']}) | "
        f"the new sender accepted, no `senders` refusal | rows of its steps {sr['rows_after_restart']}; `senders` "
        f"refusals {sr['rejected_senders']} |",
        f"| {nf['notifications']:,} bogus notifications to the RL side's DraftSource at {nf['at_s']} s | no poll "
        f"stalls, a log line a minute, `latest` followed | {nf['polls']} polls, max {nf['poll_max_s']} s; "
        f"{nf['log_lines']} log lines; {nf['left_unread']:,} still queued at the end; following v{nf['following']} "
        f"(latest v{nf['latest']}) |",
        f"| the wire recording read while cut shorter | every read ends | {shrink} |",
        f"| log size at the end | bounded | sidecar.log {lb['sidecar_log']:,} B; monitor.jsonl {lb['monitor_jsonl']:,} B |",
        "",
    ]


def _markdown(r: dict[str, Any]) -> str:
    sent = r["hostile_sent_by_category"]
    rej = r["sidecar_rejected_by_reason"]
    lines = [
        SECTION,
        "",
        f"`{r['command']}` — measured on this 2-core CPU: SmolLM2-135M fp32, the sidecar as `cotrain` starts it "
        f"(one torch thread), for {r['minutes']} minutes.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| hostile messages attempted | {r['hostile_sent_total']:,} ({r['hostile_msgs_per_s']} msgs/s) |",
        f"| hostile messages delivered (the rest stayed in the attacker's own full queue or failed the handshake) | "
        f"{r['hostile_delivered_total']:,} ({r['hostile_delivered_per_s']} msgs/s) |",
        f"| legit RL steps offered | {r['legit']['steps']} |",
        f"| legit drops while the sidecar was up, sockets bound ({r['sidecar_ready_s']:.0f} s; goal 0) | "
        f"{_nonzero(r['legit']['dropped_while_up'])} |",
        f"| legit drops while it was dead or starting (killed: {r['sidecar_down_s']} s before each restart; "
        f"then loading until bound) | {_nonzero(r['legit']['dropped_while_down'])} |",
        "| how drops are attributed | each drop's wall-clock time (the legit sender's counters read every 10 ms) "
        "against the intervals from each kill to the restarted sidecar's ready file, widened by the sender's 0.5 s "
        f"timeout; the old one-second sampling said up {_nonzero(r['legit'].get('dropped_while_up_sampled', {}))}, "
        f"down {_nonzero(r['legit'].get('dropped_while_down_sampled', {}))} |",
        f"| legit drops while up, each (s into the run, s since the last restart) | "
        f"{_drop_times(r['legit'].get('dropped_while_up_detail', []))} |",
        f"| kill -9 and restarts survived | {r['restarts_survived']} (crashes: {len(r['crashes'])}) |",
        f"| draft versions verified (sha256) | {r['versions_verified']} (problems: {len(r['version_problems'])}; "
        f"temp folders left: {len(r['tmp_folders_left'])}) |",
        f"| sidecar RSS MiB min / median / max | {r['rss_mib']['min']} / {r['rss_mib']['median']} / "
        f"{r['rss_mib']['max']} (max by quarter: {r['rss_mib']['max_by_quarter']}) |",
        f"| full disk | {r['disk_full']} |",
        f"| sidecar: published / train steps / publish failures | {r['sidecar_state']['published_version']} / "
        f"{r['sidecar_state']['train_steps']} / {r['sidecar_state']['publish_failures']} |",
        f"| sidecar: poisoned heads refused / RL restarts / held records dropped | "
        f"{r['sidecar_state']['nonfinite_heads']} / {r['sidecar_state']['rl_restarts']} / "
        f"{r['sidecar_state']['held_dropped_records']} |",
        f"| sidecar exit after the final report | {r['sidecar_exit']} |",
        f"| signed probes replayed after restarts: sent / replayed / rows seen / accepted again (goal 0) | "
        f"{_replays(r.get('replay_after_restart', {}))} |",
        f"| a second sidecar on the same run (goal: refused, exit 2, naming the live one's pid) | "
        f"{_second(r.get('second_sidecar', {}))} |",
        "| `record_wire` on a small disk (goal: one stop line per incarnation at most, training and publishing "
        f"go on, the recording reads back) | {_recording(r.get('record_wire_small_disk', {}))} |",
        "",
        *_round_three(r.get("round_three")),
        "Hostile messages by category (`delivered`: taken by the sidecar's socket; the others waited in the attacker's "
        "own queue, bounded by its high-water mark, or failed the handshake):",
        "",
        "| category | attempted | delivered |",
        "|---|---|---|",
        *[
            f"| {k} | {v:,} | {v - r['hostile_not_delivered_by_category'].get(k, 0):,} |"
            for k, v in sorted(sent.items())
        ],
        "",
        "Rejections counted by the sidecar, by reason (summed over its incarnations, from its Prometheus page):",
        "",
        "| reason | count |",
        "|---|---|",
        *[f"| {k} | {int(v):,} |" for k, v in sorted(rej.items())],
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["orchestrate", "legit", "hostile"], default="orchestrate")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--draft", default=str(ROOT / "checkpoints" / "smollm2-demo"))
    ap.add_argument("--hostile-rate", type=float, default=60.0, help="hostile messages per second")
    ap.add_argument("--step-s", type=float, default=2.0, help="seconds per legit RL step")
    ap.add_argument("--kill-every-s", type=float, default=100.0, help="mean seconds between kill -9s")
    ap.add_argument("--full-disk-s", type=float, default=60.0)
    ap.add_argument("--disk-mb", type=int, default=1024)
    ap.add_argument(
        "--record-disk-mb",
        type=int,
        default=16,
        help="record the wire onto a disk this small (0: no recording)",
    )
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay-probes", type=int, default=5, help="signed probes sent before each kill")
    ap.add_argument(
        "--second-sidecar-at",
        type=float,
        default=0.3,
        help="fraction of the run when a second sidecar starts",
    )
    ap.add_argument("--override", action="append", default=[], help="extra recipe key=value (repeatable)")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "out" / "soak.json")
    ap.add_argument("--disk", help=argparse.SUPPRESS)
    ap.add_argument("--start", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--huge-version-at-s", type=float, default=1e9, help=argparse.SUPPRESS)
    ap.add_argument(
        "--sender-flood", type=int, default=6000, help="fresh sender ids the hostile side signs with"
    )
    ap.add_argument(
        "--sender-flood-at", type=float, default=0.35, help="fraction of the run of the sender flood"
    )
    ap.add_argument("--sender-flood-at-s", type=float, default=1e9, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "legit":
        return role_legit(a)
    if a.role == "hostile":
        return role_hostile(a)
    r = orchestrate(a)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    r["draft"] = repo_relative(a.draft)
    a.json.write_text(json.dumps(r, indent=1))
    md = _markdown(r)
    print(md)
    replace_section(ROOT / "benchmarks" / "RESULTS.md", SECTION, md)


if __name__ == "__main__":
    main()
