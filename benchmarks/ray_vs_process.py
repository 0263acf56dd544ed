"""The sidecar in Ray mode (``draft_align/integrations/ray``: a ``SidecarHost`` actor on a local Ray cluster) vs
process mode (a child ``draft-align sidecar`` process, spawned as ``draft_align.cotrain`` spawns it), on the
same SmolLM2-135M setup, trials of the two modes interleaved (``--repeats`` each, the order alternating).

Each trial starts from a fresh run folder (the same recipe, the same starting draft, the tap on
``tcp://127.0.0.1`` in both modes, so that only the hosting differs) and measures:

- **start-up**: seconds from the spawn (process) or the actor's creation (Ray) to the sidecar's ``ready.json``
  naming its pid (its sockets bound, its loop started); Ray mode also records the local cluster's own start
  (``ray.init``) and when ``RaySidecar.ready()`` returned.
- **memory**: the sidecar process's RSS (max over the feed phase), and in Ray mode the summed RSS of Ray's
  own processes (every descendant of this process but the sidecar actor's: GCS, raylet, workers; RSS counts
  shared pages in each process).
- **tap throughput and train-step rate**: a ``TapSender`` in this process feeds synthetic ``TapBatch``es
  (``TapBatch.make_dummy`` with the draft's shapes, one HeadSync first, a StepReport after every
  ``--batches-per-step`` batches) as fast as the sidecar takes them (it waits while its own queue holds 4);
  the rates are the growth of the sidecar's ``sidecar_ingested_tokens`` and ``sidecar_train_steps`` counters
  from the first to the last of its ``monitor.jsonl`` rows (one per StepReport, by each row's own time) written
  in the ``--feed-s`` seconds after ``--warm-s``.
- **kill → next publish**: the feeder paced (one step of one batch every ``--step-s``, a new policy version
  and its HeadSync every step), SIGKILL of the sidecar's process; in process mode it is spawned again at
  once (what a supervisor does), in Ray mode Ray restarts the actor (``ray.max_restarts``).  Seconds until
  the restarted sidecar's ``ready.json`` and until ``latest`` names a version newer than the one before the
  kill.

Results: medians per mode and Ray / process ratios, to ``benchmarks/out/ray_vs_process.json`` and the section
at the end of RESULTS.md.

    python benchmarks/ray_vs_process.py --repeats 5 --draft checkpoints/smollm2-demo

Run it alone on the machine.  Ray stays on 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, a private temp
folder, no dashboard, no usage statistics, RAY_worker_niceness=0; docs/ray.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

# before Ray is imported anywhere in this process (Ray reads them at import; docs/ray.md)
os.environ.update(
    {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.results_md import replace_section, repo_relative  # noqa: E402

SECTION = "## Sidecar on Ray vs as a child process (`benchmarks/ray_vs_process.py`)"
MODES = ("process", "ray")
QUEUE_AHEAD = 4  # the feeder offers while its sender's queue holds fewer messages than this


@dataclass
class Trial:
    """One trial of one mode (seconds, MiB, per-second rates; None where not measured)."""

    mode: str
    repeat: int
    startup_s: float | None = None
    ray_cluster_start_s: float | None = None
    ray_ready_call_s: float | None = None
    sidecar_rss_mib: float | None = None
    ray_rss_mib: float | None = None
    ray_processes: int | None = None
    ingest_tokens_per_s: float | None = None
    train_steps_per_s: float | None = None
    train_tokens_per_s: float | None = None
    sidecar_ingest_tokens_per_s: float | None = None  # the sidecar's own: tokens / seconds spent ingesting
    feed_rows: int = 0  # monitoring rows in the feed window (the rates need 2)
    kill_to_ready_s: float | None = None
    kill_to_publish_s: float | None = None
    version_before_kill: int | None = None
    version_after_kill: int | None = None
    sender: dict[str, int] = field(default_factory=dict)
    error: str | None = None


# ---------------------------------------------------------------------------------------------- the feeder
class Feeder:
    """The policy side: a TapSender to the sidecar's tap endpoint offering synthetic TapBatches of the draft's
    shapes, a HeadSync per policy version and a StepReport per step, on its own thread."""

    def __init__(self, recipe: Any, draft: Any, endpoint: str, key: bytes, tokens: int) -> None:
        import torch

        from draft_align.wire import channel
        from draft_align.wire.messages import TapBatch

        self.recipe = recipe
        self.sender = channel.TapSender(
            endpoint, key, max_message_bytes=recipe.wire.max_message_mb << 20, send_timeout_s=0.5
        )
        cfg = draft.cfg
        n = max(1, tokens // 128)  # sequences of 64..192 tokens: about ``tokens`` per batch
        self.pool = [
            TapBatch.make_dummy(
                n,
                min_len=64,
                max_len=192,
                hidden_size=cfg.target_hidden_size,
                vocab_size=cfg.vocab_size,
                aux_layer_ids=tuple(cfg.aux_layer_ids),
                topk=4,
                seed=i,
            )
            for i in range(4)
        ]
        self.d2t = draft.draft_to_target
        g = torch.Generator().manual_seed(0)
        self.rows = (torch.randn(self.d2t.numel(), cfg.target_hidden_size, generator=g) * 0.05).bfloat16()
        self.hidden, self.vocab = cfg.target_hidden_size, cfg.vocab_size
        self.step = self.version = 0
        self.batches_per_step, self.pace_s, self.head_every = 1, None, 0
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def configure(self, batches_per_step: int, pace_s: float | None, head_every: int) -> None:
        """``pace_s`` None: as fast as the sidecar takes them; ``head_every``: a new policy version (and its
        HeadSync) every that many steps (0: only the first)."""
        self.batches_per_step, self.pace_s, self.head_every = batches_per_step, pace_s, head_every

    def _offer(self, msg: Any) -> None:
        while (
            self.pace_s is None
            and self.sender.stats()["queue_depth"] >= QUEUE_AHEAD
            and not self.stop_event.is_set()
        ):
            time.sleep(0.002)
        self.sender.offer(msg)

    def _head(self) -> None:
        import torch

        from draft_align.wire.messages import HeadSync

        self._offer(
            HeadSync(
                run_id=self.recipe.run,
                policy_version=self.version,
                hidden_size=self.hidden,
                vocab_size=self.vocab,
                norm_eps=1e-5,
                norm_weight=torch.ones(self.hidden),
                draft_to_target=self.d2t,
                rows=self.rows,
            )
        )

    def _run(self) -> None:
        from draft_align.wire.messages import StepReport

        self._head()
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            if self.head_every and self.step % self.head_every == 0 and self.step:
                self.version += 1
                self._head()
            for i in range(self.batches_per_step):
                b = self.pool[(self.step + i) % len(self.pool)]
                self._offer(
                    replace(
                        b,
                        run_id=self.recipe.run,
                        step=self.step,
                        policy_version=self.version,
                        batch_id=i,
                    )
                )
            self._offer(
                StepReport(
                    run_id=self.recipe.run,
                    step=self.step,
                    policy_version=self.version,
                    metrics={"bench": 1.0},
                )
            )
            self.step += 1
            if self.pace_s is not None:
                self.stop_event.wait(max(0.0, self.pace_s - (time.monotonic() - t0)))

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="bench-feeder", daemon=True)
        self.thread.start()

    def close(self) -> dict[str, int]:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(30)
        self.sender.close()
        return self.sender.stats()


# ---------------------------------------------------------------------------------------------- measuring
def _rss_mib(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


def _descendants_rss(exclude: set[int]) -> tuple[float, int]:
    """(summed RSS MiB, count) of this process's descendants but ``exclude``."""
    import psutil

    total, n = 0.0, 0
    for p in psutil.Process().children(recursive=True):
        if p.pid in exclude:
            continue
        try:
            total += p.memory_info().rss / 2**20
            n += 1
        except psutil.Error:
            pass
    return total, n


def _ready_pid(run_dir: Path) -> tuple[int | None, str | None]:
    """(pid, tap endpoint) of the sidecar's ``ready.json``; (None, None) before it exists."""
    from draft_align.sidecar.layout import READY_FILE, SIDECAR_DIR

    try:
        r = json.loads((run_dir / SIDECAR_DIR / READY_FILE).read_text())
        return int(r["pid"]), str(r["tap_endpoint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def _latest_version(run_dir: Path) -> int:
    """The version ``latest`` names (0 before the first publish)."""
    try:
        name = (run_dir / "latest").read_text().strip()
        return int(Path(name).name.lstrip("v"))
    except (OSError, ValueError):
        return 0


def _rows(run_dir: Path, t_from: float, t_to: float) -> list[dict[str, Any]]:
    """The sidecar's monitoring rows written between wall-clock times ``t_from`` and ``t_to`` (its own clock,
    the row's ``time``)."""
    from draft_align.sidecar.layout import MONITOR_FILE, SIDECAR_DIR

    try:
        lines = (run_dir / SIDECAR_DIR / MONITOR_FILE).read_text(errors="replace").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row.get("time"), (int, float)) and t_from <= row["time"] <= t_to:
            rows.append(row)
    return rows


def _rate(first: dict[str, Any], last: dict[str, Any], key: str) -> float | None:
    """Growth per second of the counter ``key`` from row ``first`` to row ``last``."""
    dt = last["time"] - first["time"]
    a, b = first.get(key), last.get(key)
    if dt <= 0 or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    return (b - a) / dt


def _wait(cond: Any, timeout_s: float, every_s: float = 0.02) -> float | None:
    """Seconds until ``cond()`` is true, None after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(every_s)
    return None


# ---------------------------------------------------------------------------------------------- one trial
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _recipe(out: Path, draft: str, extra: list[str]):
    """The trial's recipe: a fixed free port on 127.0.0.1, so that a sidecar spawned again after a kill binds the
    port the feeder is connected to (Ray mode binds the node's address, here 127.0.0.1, and its previous port
    itself: ``integrations/ray/host.py``)."""
    from draft_align.config import CotrainRecipe, load_recipe

    overrides = [
        "run=rvp",
        f"output_dir={out}",
        f"draft={draft}",
        "logging.wandb=false",
        f"wire.endpoint=tcp://127.0.0.1:{_free_port()}",
        "wire.max_message_mb=64",
        "sidecar.publish.keep_versions=3",
        "sidecar.train.checkpoint_every_s=30",
        "sidecar.publish.every_s=10",
        "sidecar.publish.min_train_steps=1",
        "sidecar.buffer.min_tokens=1024",
        "sidecar.train.batch_tokens=512",
        "sidecar.gate.tolerance=64",
        "sidecar.monitor.prometheus_port=0",
        "ray.num_cpus=1",
        "ray.max_restarts=3",
        *extra,
    ]
    return load_recipe(ROOT / "recipes" / "smollm2_cotrain.yaml", overrides, CotrainRecipe)


class _Host:
    """One mode's way to start, kill and stop the sidecar."""

    def __init__(self, mode: str, a: argparse.Namespace, recipe: Any, resolved: Path, start: Path) -> None:
        self.mode, self.a, self.recipe, self.resolved, self.start_draft = mode, a, recipe, resolved, start
        self.proc: subprocess.Popen | None = None
        self.ray_sidecar: Any = None
        self.tmp_ray: str | None = None
        self.t_request = 0.0  # when the sidecar was asked for (after the Ray cluster's own start)

    def start(self, trial: Trial) -> None:
        from draft_align.cotrain import spawn_sidecar

        if self.mode == "process":
            self.t_request = time.monotonic()
            self.proc = spawn_sidecar(self.resolved, self.start_draft, self.recipe.run_dir / "sidecar.log")
            return
        import ray

        from draft_align.integrations.ray.client import RaySidecar

        self.tmp_ray = tempfile.mkdtemp(prefix="rvp-", dir="/tmp")  # short: Ray's socket paths
        t0 = time.monotonic()
        ray.init(
            num_cpus=2,
            object_store_memory=80 << 20,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            _temp_dir=self.tmp_ray,
            namespace=self.recipe.ray.namespace,
            log_to_driver=False,
            runtime_env={
                "env_vars": {
                    "PYTHONPATH": str(ROOT),
                    "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                }
            },
        )
        trial.ray_cluster_start_s = time.monotonic() - t0
        self.t_request = time.monotonic()
        self.ray_sidecar = RaySidecar.start(self.recipe, self.start_draft, self.resolved)

    def after_ready(self, trial: Trial, t0: float) -> None:
        if self.ray_sidecar is not None:
            eps = self.ray_sidecar.ready(timeout_s=self.a.timeout_s)
            trial.ray_ready_call_s = time.monotonic() - t0 if eps else None

    def kill(self, pid: int) -> None:
        from draft_align.cotrain import spawn_sidecar

        os.kill(pid, signal.SIGKILL)
        if self.proc is not None:  # process mode: a supervisor spawns it again at once
            self.proc.wait()
            self.proc = spawn_sidecar(self.resolved, self.start_draft, self.recipe.run_dir / "sidecar.log")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.mode == "ray":
            import ray

            if self.ray_sidecar is not None:
                self.ray_sidecar.stop(timeout_s=30)
                self.ray_sidecar = None
            if ray.is_initialized():
                ray.shutdown()
        if self.tmp_ray:
            shutil.rmtree(self.tmp_ray, ignore_errors=True)


def _print_logs(run_dir: Path, ray_tmp: str | None) -> None:
    """The last lines of a failed trial's sidecar logs (the run folder's, and Ray's worker logs)."""
    logs = [run_dir / "sidecar.log"]
    if ray_tmp:
        logs += sorted(Path(ray_tmp).glob("session_*/logs/worker-*.err"))
    for p in logs:
        try:
            tail = p.read_text(errors="replace").splitlines()[-15:]
        except OSError:
            continue
        if tail:
            print(f"ray_vs_process: --- {p.name}", *tail, sep="\n", file=sys.stderr, flush=True)


def run_trial(mode: str, repeat: int, a: argparse.Namespace, out: Path) -> Trial:
    from draft_align.cotrain import write_resolved
    from draft_align.publish import load_draft
    from draft_align.sidecar.launch import starting_draft
    from draft_align.wire import channel

    trial = Trial(mode=mode, repeat=repeat)
    run_root = out / f"{mode}-{repeat}"
    shutil.rmtree(run_root, ignore_errors=True)
    recipe = _recipe(run_root, a.draft, a.override)
    resolved = write_resolved(recipe)
    start = starting_draft(recipe)
    key = channel.resolve_key(None, recipe.run_dir, create=True)
    draft, _ = load_draft(start)
    host = _Host(mode, a, recipe, resolved, start)
    feeder: Feeder | None = None
    try:
        host.start(trial)
        t_actor = host.t_request
        waited = _wait(lambda: _ready_pid(recipe.run_dir)[0] is not None, a.timeout_s, 0.05)
        if waited is None:
            trial.error = "not ready"
            return trial
        trial.startup_s = time.monotonic() - t_actor
        host.after_ready(trial, t_actor)
        pid, endpoint = _ready_pid(recipe.run_dir)
        assert pid is not None and endpoint is not None

        # tap throughput and train-step rate
        feeder = Feeder(recipe, draft, endpoint, key, a.tokens_per_batch)
        feeder.configure(a.batches_per_step, None, 0)
        feeder.start()
        rss: list[float] = []

        def sample_until(deadline: float) -> None:
            while time.monotonic() < deadline:
                r = _rss_mib(pid)
                if r is not None:
                    rss.append(r)
                time.sleep(0.5)

        sample_until(time.monotonic() + a.warm_s)
        wall_a = time.time()
        sample_until(time.monotonic() + a.feed_s)
        wall_b = time.time()
        trial.sidecar_rss_mib = max(rss) if rss else None
        if mode == "ray":
            trial.ray_rss_mib, trial.ray_processes = _descendants_rss({pid})
        rows = _rows(recipe.run_dir, wall_a, wall_b)
        trial.feed_rows = len(rows)
        if len(rows) >= 2:  # the first and last rows of the window: the sidecar's counters and clock
            trial.ingest_tokens_per_s = _rate(rows[0], rows[-1], "sidecar_ingested_tokens")
            trial.train_steps_per_s = _rate(rows[0], rows[-1], "sidecar_train_steps")
            trial.train_tokens_per_s = _rate(rows[0], rows[-1], "sidecar_trained_tokens")
            trial.sidecar_ingest_tokens_per_s = rows[-1].get("sidecar_ingest_tokens_per_s")

        # kill → next publish, the feeder paced as an RL job's steps
        feeder.configure(1, a.step_s, 1)
        if _wait(lambda: _latest_version(recipe.run_dir) >= 1, a.timeout_s, 0.1) is None:
            trial.error = "nothing published before the kill"
            return trial
        time.sleep(a.step_s * 2)
        before = _latest_version(recipe.run_dir)
        trial.version_before_kill = before
        t_kill = time.monotonic()
        host.kill(pid)
        trial.kill_to_ready_s = _wait(
            lambda: _ready_pid(recipe.run_dir)[0] not in (None, pid), a.timeout_s, 0.02
        )
        if trial.kill_to_ready_s is None:  # e.g. Ray gave up starting its worker (a starved machine)
            trial.error = f"not ready again within {a.timeout_s:.0f} s of the kill"
            trial.version_after_kill = _latest_version(recipe.run_dir)
            return trial
        got = _wait(
            lambda: _latest_version(recipe.run_dir) > before, a.timeout_s - (time.monotonic() - t_kill)
        )
        trial.kill_to_publish_s = None if got is None else time.monotonic() - t_kill
        trial.version_after_kill = _latest_version(recipe.run_dir)
        if got is None:
            trial.error = "no publish after the kill"
        return trial
    finally:
        if feeder is not None:
            trial.sender = feeder.close()
        if trial.error:
            _print_logs(recipe.run_dir, host.tmp_ray)
        host.stop()
        shutil.rmtree(run_root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- summary
METRICS = (  # (key, what, unit, better)
    ("startup_s", "start-up to ready (spawn / actor creation → sockets bound)", "s", "lower"),
    ("ray_cluster_start_s", "the local Ray cluster's own start (`ray.init`)", "s", "lower"),
    ("sidecar_rss_mib", "sidecar process RSS (max while fed)", "MiB", "lower"),
    ("ray_rss_mib", "Ray's own processes, summed RSS", "MiB", "lower"),
    ("total_rss_mib", "sidecar + Ray's processes", "MiB", "lower"),
    ("ingest_tokens_per_s", "tap throughput: tokens ingested / s", "tok/s", "higher"),
    ("train_steps_per_s", "train steps / s while fed", "1/s", "higher"),
    ("train_tokens_per_s", "tokens trained / s while fed", "tok/s", "higher"),
    ("kill_to_ready_s", "SIGKILL → restarted sidecar ready", "s", "lower"),
    ("kill_to_publish_s", "SIGKILL → next version published", "s", "lower"),
)


def _values(trials: list[Trial], mode: str, key: str) -> list[float]:
    out = []
    for t in trials:
        if t.mode != mode:
            continue
        if key == "total_rss_mib":
            v = None if t.sidecar_rss_mib is None else t.sidecar_rss_mib + (t.ray_rss_mib or 0.0)
        else:
            v = getattr(t, key)
        if v is not None:
            out.append(float(v))
    return out


def summarize(trials: list[Trial]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for key, *_ in METRICS:
        med = {m: (statistics.median(v) if (v := _values(trials, m, key)) else None) for m in MODES}
        ratio = med["ray"] / med["process"] if med["ray"] is not None and med["process"] else None
        summary[key] = {
            "median_process": med["process"],
            "median_ray": med["ray"],
            "ratio_ray_over_process": ratio,
            "n_process": len(_values(trials, "process", key)),
            "n_ray": len(_values(trials, "ray", key)),
        }
    return summary


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "–"
    if unit in ("tok/s", "MiB"):
        return f"{v:,.0f}"
    return f"{v:.2f}"


def markdown(r: dict[str, Any]) -> str:
    s = r["summary"]
    lines = [
        SECTION,
        "",
        f"`{r['command']}` ({r['date']}; this 2-core CPU, run alone): SmolLM2-135M's starting draft "
        f"`{r['draft']}`, the sidecar with one torch thread in both modes, its tap on tcp://127.0.0.1; "
        f"{r['repeats']} trials per mode, interleaved (order alternating), each from a fresh run folder; "
        f"synthetic TapBatches of ≈ {r['tokens_per_batch']} tokens ({r['batches_per_step']} per step), fed "
        f"as fast as the sidecar takes them for {r['feed_s']:.0f} s after {r['warm_s']:.0f} s; then one step "
        f"every {r['step_s']} s, a new policy version each, and a SIGKILL of the sidecar's process (process "
        "mode: spawned again at once; Ray mode: restarted by Ray). Medians; ratio = Ray / process.",
        "",
        "| figure | process | Ray | Ray / process |",
        "|---|---:|---:|---:|",
    ]
    for key, what, unit, better in METRICS:
        m = s[key]
        ratio = m["ratio_ray_over_process"]
        lines.append(
            f"| {what} ({unit}; {better} is better) | {_fmt(m['median_process'], unit)} | "
            f"{_fmt(m['median_ray'], unit)} | {'–' if ratio is None else f'{ratio:.2f}×'} |"
        )
    errors = [f"{t['mode']} #{t['repeat']}: {t['error']}" for t in r["trials"] if t.get("error")]
    lines += [
        "",
        "Ray's processes: every descendant of the benchmark process but the actor's (GCS server, raylet, the "
        "registry actor's worker, idle workers, …), RSS summed (shared pages counted in each); the cluster's "
        "start is not in the Ray start-up figure (on a cluster it is already running). Kill → ready: until the restarted sidecar's "
        "`ready.json`; kill → publish: until `latest` names a newer version (the restarted sidecar needs the "
        "next step's HeadSync and one train step first). Per-trial figures: `benchmarks/out/ray_vs_process.json`.",
        "",
        f"Trials that failed: {'; '.join(errors) if errors else 'none'}.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="trials per mode")
    ap.add_argument("--draft", default=str(ROOT / "checkpoints" / "smollm2-demo"))
    ap.add_argument("--tokens-per-batch", type=int, default=1024)
    ap.add_argument("--batches-per-step", type=int, default=4)
    ap.add_argument("--warm-s", type=float, default=10.0)
    ap.add_argument("--feed-s", type=float, default=40.0)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--override", action="append", default=[], help="extra recipe key=value (repeatable)")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "out" / "ray_vs_process.json")
    ap.add_argument("--no-results-md", action="store_true")
    ap.add_argument(
        "--keep", type=Path, default=None, help="keep the trials' run folders here (to inspect them)"
    )
    a = ap.parse_args()
    if a.repeats < 1 or a.feed_s <= 0 or a.warm_s < 0 or a.step_s <= 0 or a.tokens_per_batch < 64:
        ap.error("--repeats ≥ 1, --feed-s > 0, --warm-s ≥ 0, --step-s > 0, --tokens-per-batch ≥ 64")
    try:
        import psutil  # noqa: F401
        import ray  # noqa: F401
    except ImportError as e:
        print(f"ray_vs_process: needs Ray and psutil ({e}): pip install 'draft-align[ray]'", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    out = Path(tempfile.mkdtemp(prefix="draft-align-rvp-")) if a.keep is None else a.keep
    trials: list[Trial] = []
    try:
        for rep in range(a.repeats):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                try:
                    t = run_trial(mode, rep, a, out)
                except Exception as e:  # noqa: BLE001 - one failed trial is recorded, the others run
                    t = Trial(mode=mode, repeat=rep, error=f"{type(e).__name__}: {e}"[:300])
                trials.append(t)
                print(f"ray_vs_process: {json.dumps(asdict(t))}", flush=True)
    finally:
        if a.keep is None:
            shutil.rmtree(out, ignore_errors=True)
    result = {
        "command": "python benchmarks/ray_vs_process.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "draft": repo_relative(a.draft),
        "repeats": a.repeats,
        "tokens_per_batch": a.tokens_per_batch,
        "batches_per_step": a.batches_per_step,
        "warm_s": a.warm_s,
        "feed_s": a.feed_s,
        "step_s": a.step_s,
        "summary": summarize(trials),
        "trials": [asdict(t) for t in trials],
        "total_seconds": time.time() - t0,
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1))
    md = markdown(result)
    print(md)
    if not a.no_results_md:
        replace_section(ROOT / "benchmarks" / "RESULTS.md", SECTION, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
