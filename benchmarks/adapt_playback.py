"""Sidecar settings compared on the same taps: a recorded co-training run played back into one sidecar per arm.

    .venv/bin/python benchmarks/adapt_playback.py --run checkpoints/smollm2-drift-vllm_oracle \
        [--arms base,cap16,old,noramp,nofresh] [--train-tokens-per-step 9216] [--threads 2] [--name NAME]

The run must have been made with ``sidecar.recording.enabled=true`` (``<run>/sidecar/wire.rec``, wire/recording.py).
Every arm is a fresh sidecar with the run's resolved recipe (``<run>/cotrain_recipe.yaml``) plus the arm's
overrides, starting from the run's starting draft.  The recording's messages are handed to it in their
recorded order (``Sidecar.handle``, the path ``drain`` takes); after each RL step's ``StepReport`` the arm
trains up to ``--train-tokens-per-step`` tokens (what the run's sidecar could have trained during one RL step
had it never waited; the arm's own rules — replay cap, minimum buffer — may stop it sooner, counted), trying a
publish after each optimizer step as its loop does and once more at the end of the step.  So the taps of step
s are scored (the row's ``accept_est_adapted*``) by the draft published when they arrived, trained on steps
< s: the run's staleness of 1.

What differs between arms is only their settings: same records, same order, same compute budget, same seeds.

Update cadence (``--arms every1,every5,drift,never``): ``every1`` trains and publishes after every RL step (the
run's settings), ``every5`` only after every fifth step (steps 4, 9, …; the same per-update budget, so about a fifth
of the training: verl-SpeCo's default interval), ``drift*`` lets ``sidecar.trigger.when: drift`` decide (idle while
the published draft's estimate holds), ``never`` never trains (the frozen draft; its CPU is ingest and estimates
alone).  Each arm's process CPU seconds are measured (``time.process_time``, all of the arm's threads): in
total and in training (``next_batch``, ``train_on``, publishes).
Acceptance is the sidecar's estimate on each step's fresh taps (greedy draft and probabilistic at the run's
temperature, k = ``sidecar.gate.k``), not vLLM's counters; the drift benchmark validates that estimate
against them.  Differences are paired by step against the first arm.

Writes ``benchmarks/out/adapt_playback[_NAME].json`` and its section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.results_md import replace_section, repo_relative  # noqa: E402
from draft_align.config import CotrainRecipe, load_recipe  # noqa: E402
from draft_align.config.recipe_files import RESOLVED_RECIPE  # noqa: E402

log = logging.getLogger("bench.adapt_playback")

# name → (overrides, what it tests); "base" is the recorded run's own settings
ARMS: dict[str, tuple[list[str], str]] = {
    "base": ([], "the run's settings"),
    "cap16": (["sidecar.buffer.max_replay_ratio=16"], "replay cap 16 instead of the run's"),
    "cap2": (["sidecar.buffer.max_replay_ratio=2"], "replay cap 2 instead of the run's"),
    "old": (
        ["sidecar.buffer.min_tokens=8192", "sidecar.train.lr_ramp_tokens=0"],
        "the earlier defaults: an 8,192-token minimum buffer, no lr ramp",
    ),
    "noramp": (["sidecar.train.lr_ramp_tokens=0"], "full lr from the first batch (no ramp)"),
    "nofresh": (["sidecar.buffer.fresh_first=false"], "recency-weighted sampling only (no newest-first)"),
    "anchor": (
        ["sidecar.train.lr_ramp_tokens=0", "sidecar.train.anchor_decay=10"],
        "no lr ramp; each step pulled toward the starting draft (anchor_decay 10)",
    ),
    "lora": (
        ["sidecar.train.adapt=lora", "sidecar.train.lr_ramp_tokens=0"],
        "LoRA adapters (r 8, lr 2e-3) on the starting draft instead of full weights, no lr ramp",
    ),
    # update cadence (the RL step interval between training rounds is TRAIN_EVERY's; 0 = never)
    "every1": ([], "train and publish after every RL step"),
    "every5": (
        [],
        "train and publish after every fifth RL step (verl-SpeCo's interval), the same budget per update",
    ),
    "never": ([], "never train: the frozen starting draft"),
    "drift": (
        ["sidecar.trigger.when=drift"],
        "the drift trigger at its defaults (sidecar.trigger)",
    ),
    "drift_g10": (
        ["sidecar.trigger.when=drift", "sidecar.trigger.drift_min_gain=0.1"],
        "the drift trigger, a burst ends once its publishes gain < 0.1",
    ),
    "drift_g20": (
        ["sidecar.trigger.when=drift", "sidecar.trigger.drift_min_gain=0.2"],
        "the drift trigger, a burst ends once its publishes gain < 0.2",
    ),
    "drift_min3": (
        ["sidecar.trigger.when=drift", "sidecar.trigger.drift_min_gain=1000"],
        "the drift trigger, every burst its minimum of 3 publishes (min gain 1000)",
    ),
    "drift_t05": (
        ["sidecar.trigger.when=drift", "sidecar.trigger.drift_tolerance=0.05"],
        "the drift trigger, tolerance 0.05",
    ),
    "drift_t20": (
        ["sidecar.trigger.when=drift", "sidecar.trigger.drift_tolerance=0.2"],
        "the drift trigger, tolerance 0.2",
    ),
    "drift_h10": (
        ["sidecar.trigger.when=drift", "sidecar.trigger.drift_head_threshold=0.10"],
        "the drift trigger, head threshold 0.10",
    ),
    "drift_h02": (
        ["sidecar.trigger.when=drift", "sidecar.trigger.drift_head_threshold=0.02"],
        "the drift trigger, head threshold 0.02",
    ),
}
TRAIN_EVERY = {"every5": 5, "never": 0}  # arms not named here train after every step
KEYS = {"greedy_draft": "accept_est_adapted", "probabilistic": "accept_est_adapted_prob"}


def playback_arm(
    run: Path, arm: str, overrides: list[str], messages: list, budget: int, out: Path
) -> dict[str, Any]:
    """One arm: a fresh sidecar fed the recording; its monitor rows, publishes and waits."""
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar
    from draft_align.wire.messages import StepReport

    arm_dir = out / arm
    shutil.rmtree(arm_dir, ignore_errors=True)
    recipe = load_recipe(
        run / RESOLVED_RECIPE,
        [
            f"output_dir={arm_dir}",
            "sidecar.recording.enabled=false",
            "sidecar.monitor.prometheus_port=0",
            "logging.wandb=false",
            *overrides,
        ],
        CotrainRecipe,
    )
    torch.manual_seed(recipe.seed)
    sc = Sidecar(recipe, starting_draft(recipe)).setup()
    waits: Counter[str] = Counter()
    per_step: list[dict[str, Any]] = []
    every = TRAIN_EVERY.get(arm, 1)
    t0, cpu0 = time.perf_counter(), time.process_time()
    train_cpu = 0.0
    try:
        for msg in messages:
            sc.handle(msg)
            if not isinstance(msg, StepReport) or msg.metrics.get("final"):
                continue
            trained = steps = 0
            c0 = time.process_time()
            if every == 0 or (int(msg.step) + 1) % every:
                per_step.append(
                    {
                        "step": int(msg.step),
                        "trained_tokens": 0,
                        "optimizer_steps": 0,
                        "stopped_by": "cadence",
                        "published_version": sc.state.published_version,
                    }
                )
                continue
            while trained < budget:
                batch = sc.next_batch()
                if batch is None:
                    waits[sc.waiting or "no trainable record"] += 1
                    break
                sc.train_on(batch)
                trained += batch.num_tokens
                steps += 1
                sc.maybe_publish()
            sc.maybe_publish(force=True)
            train_cpu += time.process_time() - c0
            per_step.append(
                {
                    "step": int(msg.step),
                    "trained_tokens": trained,
                    "optimizer_steps": steps,
                    "stopped_by": None if trained >= budget else sc.waiting,
                    "published_version": sc.state.published_version,
                }
            )
            log.info(
                "%s: step %d trained %d tokens (%s), draft v%d",
                arm,
                msg.step,
                trained,
                per_step[-1]["stopped_by"] or "budget",
                sc.state.published_version,
            )
    finally:
        sc.close()
    rows = [json.loads(x) for x in (sc.dir / "monitor.jsonl").read_text().splitlines() if x.strip()]
    return {
        "arm": arm,
        "overrides": overrides,
        "rows": rows,
        "per_step": per_step,
        "waits": dict(waits),
        "published": sc.state.published_version,
        "gate_refused": sc.state.gate_rejections,
        "trained_tokens": sc.state.trained_tokens,
        "buffered_tokens": sc.state.buffered_tokens,
        "seconds": time.perf_counter() - t0,
        "cpu_s": time.process_time() - cpu0,
        "train_cpu_s": train_cpu,
    }


def _by_step(rows: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key) is not None}


def paired(a: dict[int, float], b: dict[int, float], steps: list[int]) -> dict[str, float] | None:
    """mean of b − a over ``steps`` with its standard error (paired by step)."""
    d = [b[s] - a[s] for s in steps if s in a and s in b]
    if not d:
        return None
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    return {"mean": statistics.fmean(d), "se": se, "n": len(d), "positive": sum(x > 0 for x in d)}


def summarise(result: dict[str, Any]) -> None:
    arms = result["arms"]
    base = arms[0]
    steps = sorted(_by_step(base["rows"], KEYS["greedy_draft"]))
    half = steps[len(steps) // 2 :]
    early = [s for s in steps if s < 10]
    for a in arms:
        a["summary"] = {}
        for mode, key in KEYS.items():
            mine, ref = _by_step(a["rows"], key), _by_step(base["rows"], key)
            frozen = _by_step(a["rows"], key.replace("adapted", "frozen"))
            a["summary"][mode] = {
                "mean_all": statistics.fmean(mine.values()) if mine else None,
                "mean_last_half": statistics.fmean([mine[s] for s in half if s in mine]) if mine else None,
                "over_frozen_last_half": paired(frozen, mine, half),
                "vs_first_arm_all": paired(ref, mine, steps) if a is not base else None,
                "vs_first_arm_first_10": paired(ref, mine, early) if a is not base else None,
                "vs_first_arm_last_half": paired(ref, mine, half) if a is not base else None,
            }


def _f(x: float | None, d: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


def _pm(p: dict[str, float] | None) -> str:
    return "–" if p is None else f"{p['mean']:+.3f} ± {_f(p['se'])} ({p['positive']}/{p['n']} > 0)"


def cadence_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per arm, against ``every1``: the last-half gain over the frozen draft (greedy-draft estimate, paired by
    step), its share of every1's gain, and the training CPU seconds and their share of every1's."""
    arms = {a["arm"]: a for a in result["arms"]}
    ref = arms.get("every1")
    if ref is None:
        return []
    ref_gain = (ref["summary"]["greedy_draft"]["over_frozen_last_half"] or {}).get("mean")
    rows = []
    for a in result["arms"]:
        g = a["summary"]["greedy_draft"]
        over = g["over_frozen_last_half"] or {}
        gain = 0.0 if a["arm"] == "never" else over.get("mean")
        rows.append(
            {
                "arm": a["arm"],
                "mean_last_half": g["mean_last_half"],
                "gain_last_half": gain,
                "gain_se": over.get("se"),
                "gain_share": gain / ref_gain if gain is not None and ref_gain else None,
                "train_cpu_s": a["train_cpu_s"],
                "cpu_s": a["cpu_s"],
                "cpu_share": a["train_cpu_s"] / ref["train_cpu_s"] if ref["train_cpu_s"] else None,
                "trained_tokens": a["trained_tokens"],
                "published": a["published"],
            }
        )
    return rows


def cadence_lines(result: dict[str, Any]) -> list[str]:
    rows = cadence_rows(result)
    if not rows:
        return []
    out = [
        "",
        "Update cadence (greedy-draft estimate on each step's fresh taps; gain = adapted − frozen, paired by step, "
        "last half; CPU: the arm's process CPU seconds in training, and in all, ingest and estimates included):",
        "",
        "| cadence | settings | tokens trained | publishes | acceptance, last half | gain over frozen | share of "
        "every-step gain | training CPU s | share of every-step CPU | all CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        se = f" ± {_f(r['gain_se'])}" if r["gain_se"] is not None and r["arm"] != "never" else ""
        out.append(
            f"| {r['arm']} | {ARMS[r['arm']][1]} | {r['trained_tokens']} | {r['published']} | "
            f"{_f(r['mean_last_half'])} | {_f(r['gain_last_half'])}{se} | {_f(r['gain_share'], 2)} | "
            f"{_f(r['train_cpu_s'], 0)} | {_f(r['cpu_share'], 2)} | {_f(r['cpu_s'], 0)} |"
        )
    return out


def section_title(name: str | None) -> str:
    return "## Sidecar settings on the same taps (benchmarks/adapt_playback.py" + (
        f" --name {name})" if name else ")"
    )


def render(result: dict[str, Any]) -> str:
    lines = [
        section_title(result.get("name")),
        "",
        f"Command: `{result['command']}` (one run; {result['date']}).",
        "",
        f"Recording: `{result['recording']}` ({result['messages']} messages, {result['steps']} RL steps) of "
        f"the run `{result['run']}`; every arm a fresh sidecar on the same messages in the same order, "
        f"{result['train_tokens_per_step']} tokens of training budget per RL step, {result['threads']} "
        f"torch threads. Acceptance: the sidecar's estimate on each step's fresh taps (k = {result['eval_k']}, "
        f"T = {result['temperature']}), scored by the draft published when the step's taps arrived. "
        f"Differences are paired by step against `{result['arms'][0]['arm']}`; ± is one standard error.",
        "",
        "| arm | settings | tokens trained | publishes (gate refused) | stopped early by | greedy draft, all steps | "
        "vs first arm, steps < 10 | vs first arm, last half | probabilistic, all steps | "
        "vs first arm (prob.), all steps | over frozen, last half (greedy) |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for a in result["arms"]:
        g, p = a["summary"]["greedy_draft"], a["summary"]["probabilistic"]
        # the trigger's reasons carry figures ("idle: the draft holds 2.111 (…)"): counted by their kind
        stops = Counter(s["stopped_by"].split(":")[0] for s in a["per_step"] if s["stopped_by"])
        lines.append(
            f"| {a['arm']} | {ARMS[a['arm']][1]} | {a['trained_tokens']} | {a['published']} ({a['gate_refused']}) | "
            f"{', '.join(f'{k} ×{v}' for k, v in stops.items()) or '–'} | {_f(g['mean_all'])} | "
            f"{_pm(g['vs_first_arm_first_10'])} | {_pm(g['vs_first_arm_last_half'])} | {_f(p['mean_all'])} | "
            f"{_pm(p['vs_first_arm_all'])} | {_pm(g['over_frozen_last_half'])} |"
        )
    lines += cadence_lines(result)
    lines += [
        "",
        "Per step, greedy-draft estimate of the adapted draft (the frozen draft's beside it):",
        "",
        "| step | frozen | " + " | ".join(a["arm"] for a in result["arms"]) + " |",
        "|---:|---:|" + "---:|" * len(result["arms"]),
    ]
    base = result["arms"][0]
    frozen = _by_step(base["rows"], "accept_est_frozen")
    cols = [_by_step(a["rows"], KEYS["greedy_draft"]) for a in result["arms"]]
    for s in sorted(frozen):
        lines.append(f"| {s} | {_f(frozen[s])} | " + " | ".join(_f(c.get(s)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--run", required=True, help="a co-training run folder made with sidecar.recording.enabled=true"
    )
    ap.add_argument("--arms", default="base,cap16,old,noramp")
    ap.add_argument("--train-tokens-per-step", type=int, default=9216)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out"))
    ap.add_argument("--no-results-md", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO)
    from draft_align.sidecar.layout import SIDECAR_DIR, WIRE_RECORDING
    from draft_align.wire.messages import StepReport
    from draft_align.wire.recording import Recording

    run = Path(args.run)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
    rec = Recording(run / SIDECAR_DIR / WIRE_RECORDING)
    messages = [m for _, m in rec]
    if rec.truncated_bytes:
        log.warning(
            "recording ends in an unfinished entry (%d bytes): playing back the %d whole ones",
            rec.truncated_bytes,
            rec.entries,
        )
    reports = [m for m in messages if isinstance(m, StepReport) and not m.metrics.get("final")]
    if not reports:
        raise SystemExit(
            f"{rec.path}: no StepReport in the recording (was the run made with sidecar.recording.enabled=true?)"
        )
    torch.set_num_threads(args.threads)
    recipe = load_recipe(run / RESOLVED_RECIPE, None, CotrainRecipe)
    work = ROOT / "checkpoints" / f"adapt_playback{'_' + args.name if args.name else ''}"
    result: dict[str, Any] = {
        "command": " ".join(["python benchmarks/adapt_playback.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "run": repo_relative(run),
        "recording": repo_relative(rec.path),
        "messages": len(messages),
        "steps": len(reports),
        "train_tokens_per_step": args.train_tokens_per_step,
        "threads": args.threads,
        "eval_k": recipe.sidecar.gate.k,
        "temperature": recipe.rl.task.temperature,
        "name": args.name,
        "arms": [],
    }
    for arm in arms:
        result["arms"].append(
            playback_arm(run, arm, ARMS[arm][0], messages, args.train_tokens_per_step, work)
        )
    summarise(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"adapt_playback{'_' + args.name if args.name else ''}.json").write_text(
        json.dumps(result, indent=1, default=str)
    )
    rows = cadence_rows(result)
    if rows:  # the run's measured cadence table, which `draft-align advise RUN` reads
        from draft_align.monitor.cadence import CadenceArm, save_table

        save_table(
            run,
            [
                CadenceArm(
                    r["arm"],
                    ARMS[r["arm"]][1],
                    r["gain_last_half"],
                    r["gain_se"],
                    r["train_cpu_s"],
                    r["cpu_s"],
                    r["published"],
                )
                for r in rows
                if r["gain_last_half"] is not None
            ],
        )
    if not args.no_results_md:
        replace_section(ROOT / "benchmarks" / "RESULTS.md", section_title(args.name), render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
