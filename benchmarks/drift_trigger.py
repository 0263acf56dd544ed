"""Drift-triggered training against always-on training, same run recipe (issue: profile and advise, item 2).

    .venv/bin/python benchmarks/drift_trigger.py [--steps 12] [--draft checkpoints/advise-draft] [overrides…]

Runs the drift benchmark (benchmarks/drift.py, vLLM rollouts, no oracle points, no Tap A/B) twice, one after
the other with nothing else on the machine: ``sidecar.trigger.when=always`` then ``=drift``, the same seeds,
prompts and starting draft.  Per run: the sidecar's compute (its process CPU seconds, optimizer steps, trained
tokens) and the acceptance the RL job measured on its own rollouts (vLLM's counters, pooled over the steps,
rounds-weighted; the frozen draft's beside it, as the control for the different rollouts), the steps the
trigger spent idle.  Compute saved = 1 − drift / always; acceptance lost = always − drift (adapted, pooled).

Writes ``<out>/drift_trigger.json`` (the two runs' JSON stay in ``drift_trigger_{always,drift}.json``) and the
section in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.pooled import pooled_acceptance as pooled  # noqa: E402
from benchmarks.common.results_md import replace_section, repo_relative  # noqa: E402

HEAD = "## Drift-triggered training vs always-on (benchmarks/drift_trigger.py)"
MODES = ("always", "drift")


def run_summary(r: dict[str, Any]) -> dict[str, Any]:
    steps, mon = r["steps"], r["monitor"]
    last = mon[-1] if mon else {}
    half = len(steps) // 2
    return {
        "sidecar_cpu_s": r.get("sidecar_cpu_s"),
        "train_steps": last.get("sidecar_train_steps"),
        "trained_tokens": last.get("sidecar_trained_tokens"),
        "publishes": len(r["publishes"]),
        "drift_triggers": last.get("drift_triggers"),
        "idle_rows": sum(1 for m in mon if m.get("sidecar_train_state") in ("idle", "settling")),
        "rows": len(mon),
        "final_kl": steps[-1].get("kl_to_initial") if steps else None,
        "adapted": pooled(steps, "adapted"),
        "frozen": pooled(steps, "frozen"),
        "adapted_second_half": pooled(steps, "adapted", half),
        "frozen_second_half": pooled(steps, "frozen", half),
        "run_seconds": r.get("run_seconds"),
        "states": [m.get("sidecar_train_state") for m in mon],
    }


def _f(x: Any, nd: int = 3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def render(res: dict[str, Any]) -> str:
    a, d = res["runs"]["always"], res["runs"]["drift"]
    lines = [
        HEAD,
        "",
        f"Command (one run each, {res['date']}): `{res['command']}`; each run is "
        f"`python benchmarks/drift.py {' '.join(res['drift_args'])} sidecar.trigger.when=<mode>`.",
        "",
        f"Setup: the drift benchmark's recipe (recipes/smollm2_drift.yaml: SmolLM2-135M LoRA policy, reward "
        f"`uppercase`, 4×4 rollouts of ≤ 48 tokens at T=1) for {res['steps']} steps, rollouts by vLLM (k=3, "
        f"greedy_draft; half on the frozen draft, half on the newest published one); starting draft "
        f"`{res['draft']}`; RL job and sidecar one core each. All numbers measured.",
        "",
        "| | always | drift | drift / always |",
        "|---|---:|---:|---:|",
    ]

    def row(name: str, key: str, nd: int = 3) -> None:
        x, y = a.get(key), d.get(key)
        ratio = (y / x) if isinstance(x, int | float) and isinstance(y, int | float) and x else None
        lines.append(f"| {name} | {_f(x, nd)} | {_f(y, nd)} | {_f(ratio, 2)} |")

    row("sidecar CPU seconds (its process, user + system)", "sidecar_cpu_s", 0)
    row("sidecar optimizer steps", "train_steps", 0)
    row("sidecar trained tokens", "trained_tokens", 0)
    row("drafts published", "publishes", 0)
    row("steps the trigger idled (idle or settling rows)", "idle_rows", 0)
    row("drift triggers (idle → training)", "drift_triggers", 0)
    row("KL to initial at the last step", "final_kl", 4)
    row("measured adapted, all steps (pooled)", "adapted")
    row("measured frozen, all steps (pooled; control)", "frozen")
    row("measured adapted, second half", "adapted_second_half")
    row("measured frozen, second half", "frozen_second_half")
    s = res["summary"]
    lines += [
        "",
        f"Compute saved (sidecar CPU seconds): {_f(s['compute_saved_cpu'], 3)}; (optimizer steps): "
        f"{_f(s['compute_saved_steps'], 3)}. Acceptance lost (adapted, pooled over all steps): "
        f"{_f(s['acceptance_lost'], 3)} tokens per round ({_f(s['acceptance_lost_second_half'], 3)} in the "
        f"second half); the frozen draft's difference between the runs, {_f(s['frozen_difference'], 3)}, "
        f"is the noise of two different rollout sets.",
        "",
        f"Trigger state per step (drift run): {', '.join(str(x) for x in d['states'])}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--draft", default="checkpoints/advise-draft")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    ap.add_argument("--skip-run", action="store_true", help="render from the two runs' JSON only")
    ap.add_argument(
        "overrides", nargs="*", help="recipe overrides for both runs (default: rl.engine.kind=vllm)"
    )
    a = ap.parse_args()
    out = Path(a.out)
    overrides = a.overrides or ["rl.engine.kind=vllm"]
    drift_args = [
        "--draft",
        a.draft,
        "--steps",
        str(a.steps),
        "--oracle-at",
        "",
        "--overhead-reps",
        "0",
        "--no-results-md",
        *overrides,
    ]
    if not a.skip_run:
        for mode in MODES:
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "benchmarks" / "drift.py"),
                    "--name",
                    f"trigger_{mode}",
                    *drift_args,
                    f"sidecar.trigger.when={mode}",
                ],
                check=True,
                cwd=ROOT,
            )
    runs = {m: run_summary(json.loads((out / f"drift_trigger_{m}.json").read_text())) for m in MODES}
    al, dr = runs["always"], runs["drift"]

    def saved(key: str) -> float | None:
        return 1 - dr[key] / al[key] if al.get(key) and dr.get(key) is not None else None

    def lost(key: str) -> float | None:
        return al[key] - dr[key] if al.get(key) is not None and dr.get(key) is not None else None

    res = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/drift_trigger.py " + " ".join(sys.argv[1:]),
        "drift_args": ["--name", "trigger_<mode>", *drift_args],
        "steps": a.steps,
        "draft": repo_relative(a.draft),
        "runs": runs,
        "summary": {
            "compute_saved_cpu": saved("sidecar_cpu_s"),
            "compute_saved_steps": saved("train_steps"),
            "acceptance_lost": lost("adapted"),
            "acceptance_lost_second_half": lost("adapted_second_half"),
            "frozen_difference": lost("frozen"),
        },
    }
    (out / "drift_trigger.json").write_text(json.dumps(res, indent=1))
    replace_section(ROOT / "benchmarks" / "RESULTS.md", HEAD, render(res))
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
