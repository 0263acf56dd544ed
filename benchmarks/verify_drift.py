"""The drift run with ``rl.engine.verify_mode: auto`` against the same run with vLLM's default greedy draft sampling
(the drift benchmark re-run with the verify mode chosen by measurement, benchmarks/verify_choice.py).

    .venv/bin/python benchmarks/drift.py --name verify_auto --draft checkpoints/advise-draft --steps 12 \\
        --oracle-at "" --overhead-reps 0 --no-results-md rl.engine.kind=vllm target.dtype=float32 rl.policy.lr=5e-4 \\
        sidecar.buffer.min_tokens=2048 rl.engine.verify_mode=auto
    .venv/bin/python benchmarks/verify_drift.py [--auto drift_verify_auto.json] [--greedy drift_trigger_always.json]

The greedy run is drift_trigger.py's ``always`` arm: the same recipe, seeds, prompts, steps and starting draft,
``rl.engine.verify_mode: greedy_draft``.  Both runs decode half of every step's rollouts with the frozen draft and half
with the newest published one, so per step and per draft the acceptance measured by vLLM's counters can be
set side by side (the policies of the two runs drift apart a little: different samples are drawn).  The frozen
draft is the same in both runs, so its difference is the verify mode's alone.  Renders the section in
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.pooled import pooled_acceptance as pooled  # noqa: E402
from benchmarks.common.results_md import replace_section  # noqa: E402

HEAD = "## Drift with the verify mode chosen by measurement (benchmarks/verify_drift.py)"


def paired(
    a: list[dict[str, Any]], b: list[dict[str, Any]], kind: str, first: int = 0
) -> tuple[float, float, int]:
    """Mean and standard error of the per-step difference a − b of ``kind``'s measured acceptance."""
    d = [
        x[f"accept_measured_{kind}"] - y[f"accept_measured_{kind}"]
        for x, y in zip(a[first:], b[first:], strict=False)
        if x.get(f"accept_measured_{kind}") is not None and y.get(f"accept_measured_{kind}") is not None
    ]
    if len(d) < 2:
        return math.nan, math.nan, len(d)
    return statistics.mean(d), statistics.stdev(d) / math.sqrt(len(d)), len(d)


def _f(x: Any, nd: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def render(auto: dict[str, Any], greedy: dict[str, Any], args: argparse.Namespace) -> str:
    sa, sg = auto["steps"], greedy["steps"]
    modes = sorted(
        {
            "probabilistic" if s.get("verify_probabilistic") else "greedy_draft"
            for s in sa
            if s.get("verify_probabilistic") is not None
        }
    )
    lines = [
        HEAD,
        "",
        f"Commands: `{auto['command']}` (the auto run; "
        f"the greedy run is drift_trigger.py's `always` arm, `{Path(args.greedy).name}`), then "
        f"`python benchmarks/verify_drift.py` (2026-12-01, one run each, 2-core CPU).",
        "",
        f"Same recipe, seeds, prompts and starting draft; {len(sa)} vs {len(sg)} GRPO steps, vLLM rollouts, k = 3, "
        f"T = 1. The auto run served: {', '.join(modes) or '–'}. All acceptance numbers are measured by vLLM's "
        "counters on the steps' own rollouts.",
        "",
        "| step | auto: verify mode | auto: probe L greedy_draft | auto: probe L probabilistic | frozen auto | "
        "frozen greedy | adapted auto | adapted greedy | KL auto | KL greedy |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x, y in zip(sa, sg, strict=False):
        mode = "probabilistic" if x.get("verify_probabilistic") else "greedy_draft"
        lines.append(
            f"| {int(x['step'])} | {mode} | {_f(x.get('verify_measured_L_greedy_draft'))} | "
            f"{_f(x.get('verify_measured_L_probabilistic'))} | {_f(x.get('accept_measured_frozen'))} | "
            f"{_f(y.get('accept_measured_frozen'))} | {_f(x.get('accept_measured_adapted'))} | "
            f"{_f(y.get('accept_measured_adapted'))} | {_f(x.get('kl_to_initial'), 4)} | {_f(y.get('kl_to_initial'), 4)} |"
        )
    half = len(sa) // 2
    lines += [
        "",
        "| pooled (rounds-weighted) | auto | greedy_draft | gain | paired by step (mean ± SE, n) |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in ("frozen", "adapted"):
        for label, first in (("all steps", 0), ("second half", half)):
            pa, pg = pooled(sa, kind, first), pooled(sg, kind, first)
            m, se, n = paired(sa, sg, kind, first)
            gain = pa - pg if pa is not None and pg is not None else None
            lines.append(f"| {kind}, {label} | {_f(pa)} | {_f(pg)} | {_f(gain)} | {_f(m)} ± {_f(se)} ({n}) |")
    lines += [
        "",
        "The auto run measured its verify mode once, before step 0's rollouts (`rl.engine.verify_recheck_every` 0), "
        "with the frozen draft on the 4 probe prompts; the probe columns repeat that measurement.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--auto", default=str(ROOT / "benchmarks/out/drift_verify_auto.json"))
    ap.add_argument("--greedy", default=str(ROOT / "benchmarks/out/drift_trigger_always.json"))
    args = ap.parse_args()
    auto, greedy = (json.loads(Path(p).read_text()) for p in (args.auto, args.greedy))
    body = render(auto, greedy, args)
    replace_section(ROOT / "benchmarks/RESULTS.md", HEAD, body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
