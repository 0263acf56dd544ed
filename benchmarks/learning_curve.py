"""Learning curve to saturation: one EAGLE-3 draft, the recipe's objective, trained for a long budget
(≥ 60 minutes) on one data preparation, with a point every ``--eval-every-s`` and vLLM's measurement at the
goal's budget and at the end.

    .venv/bin/python benchmarks/learning_curve.py [--budget-s 3600] [--eval-every-s 600] [--measure-at-s 1200]
        [--curve-prompts 64] [--eval-prompts 32] [--eval-max-new 96] [--name VARIANT] [overrides ...]

1. Data: the recipe's preparation (self-distillation within ``data.gen_time_budget_s``, capture; cached and
   resumable), timed and reported apart from training.
2. Training: a fresh draft (the recipe's seed) for ``--budget-s`` seconds of training wall-clock (evaluation
   not counted).  Every ``--eval-every-s``: the T = 0 mean acceptance length at k = 3 on ``--curve-prompts``
   held-out prompts, engine replay of the target's own greedy continuations (exact at T = 0: acceptance is
   deterministic there).  At ``--measure-at-s`` (the goal's 20 minutes) the draft is published as a version.
3. The published drafts at ``--measure-at-s`` and at the end are measured by vLLM's spec-decode counters
   (``draft-align eval --engine vllm``) at k = 3: T = 0 greedy, T = 1 greedy_draft, T = 1 probabilistic, each
   beside the engine-replay estimate on vLLM's own outputs.

Writes ``benchmarks/out/learning_curve.json`` and its section in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common.arms import (  # noqa: E402
    K,
    add_common_args,
    finish,
    measure,
    prepare_shared,
    section_intro,
    setup,
    target_samples,
    train_stats,
)
from benchmarks.common.results_md import repo_relative  # noqa: E402
from benchmarks.warmstart import matmul_roofline  # noqa: E402

log = logging.getLogger("bench.learning_curve")
HEAD = "## Learning curve to saturation (benchmarks/learning_curve.py)"


def head(name: str) -> str:
    """The RESULTS.md heading of a run (``--name``: a variant, e.g. a shorter run after a change)."""
    return HEAD if not name else f"{HEAD[:-1]}, variant {name})"


def render(result: dict[str, Any]) -> str:
    """The RESULTS.md section: the curve (T = 0, engine replay) and vLLM's measurements of the snapshots."""
    lines = section_intro(head(result.get("name", "")), result, arms=False)
    d = result["data"]
    lines[-1] += (
        f", objective `{result['loss']}`, a curve point every {result['eval_every_s']:.0f} s. "
        f"Data preparation {d['prepare_seconds']:.0f} s (not in the budget; generation and capture are cached). "
        f"Curve: T = 0 mean acceptance length at k = {K} on {result['curve_prompts']} held-out prompts, engine "
        "replay of the target's greedy continuations (exact at T = 0). Of bf16 roofline: the step's matmul FLOPs "
        "(benchmarks/warmstart.py's model) per second over this CPU's measured bf16 matmul rate "
        f"({result['roofline_gflops_bf16']:.0f} GFLOP/s)."
    )
    lines += [
        "",
        "| step | train s | positions trained | epochs | T=0 acceptance length | r1, r2, r3 |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for c in result["curve"]:
        pp = ", ".join(f"{x:.3f}" for x in c["per_position"])
        lines.append(
            f"| {c['step']} | {c['train_seconds']:.0f} | {c['targets_seen']} | "
            f"{c['targets_seen'] / d['train_targets']:.1f} | {c['acceptance_length_T0']:.3f} | {pp} |"
        )
    s = result.get("stats")
    if s:
        lines += [
            "",
            f"Throughput over the run: {s['targets_per_s']:.0f} positions/s, {s['steps']} optimizer "
            f"steps, {s['train_gflops']:.0f} GFLOP/s = {s['train_gflops'] / result['roofline_gflops_bf16']:.2f} "
            "of the bf16 roofline.",
        ]
    if result.get("measured"):
        lines += [
            "",
            f"Measured by vLLM's counters at k = {K} on {result['eval_prompts']} held-out prompts, ≤ "
            f"{result['eval_max_new']} new tokens (each cell **measured / estimated**; the published bf16 "
            "draft as vLLM's EAGLE-3 drafter):",
            "",
            "| draft | train s | T=0 greedy | T=1 greedy_draft | T=1 probabilistic |",
            "|---|---:|---:|---:|---:|",
        ]
        for m in result["measured"]:
            cells = [
                "— (vLLM failed)"
                if "error" in r
                else f"{r['acceptance_length_measured']:.3f} / {r['acceptance_length_est']:.3f}"
                for r in m["eval"]
            ]
            lines.append(f"| `{m['draft']}` | {m['train_seconds']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    add_common_args(ap)
    ap.set_defaults(budget_s=3600.0)
    ap.add_argument("--eval-every-s", type=float, default=600.0)
    ap.add_argument(
        "--measure-at-s", type=float, default=1200.0, help="also publish and measure the draft here"
    )
    ap.add_argument("--curve-prompts", type=int, default=64)
    ap.add_argument("--name", default="", help="a variant's name: its own JSON and RESULTS.md section")
    args = ap.parse_args()
    from draft_align.config import load_recipe
    from draft_align.engines.vllm.start import set_cpu_env
    from draft_align.monitor.estimator import estimate
    from draft_align.publish.compat import tokenizer_fingerprint
    from draft_align.publish.versions import publish_version
    from draft_align.warmstart import build_draft, heldout_prompts, train

    set_cpu_env()  # before vLLM is imported: the in-process engine, a small KV cache, no OpenMP pinning
    ov, recipe, result = setup(args, "learning_curve.py")
    result.update(
        name=args.name,
        eval_every_s=args.eval_every_s,
        curve_prompts=args.curve_prompts,
        loss=str(recipe.train.objective.loss),
        curve=[],
        measured=[],
    )
    result["roofline_gflops_bf16"] = matmul_roofline(torch.bfloat16)
    out = Path(args.out) / f"learning_curve{'_' + args.name if args.name else ''}.json"
    t0 = time.time()
    prep = prepare_shared(recipe, result)
    out.write_text(json.dumps(result, indent=2))

    curve_prompts = heldout_prompts(prep, args.curve_prompts, recipe.data.max_prompt_tokens)
    curve_seqs = target_samples(prep, curve_prompts, args.eval_max_new, 0.0)

    rc = load_recipe(args.recipe, [*ov, f"run={recipe.run}-curve{'-' + args.name if args.name else ''}"])
    shutil.rmtree(rc.run_dir, ignore_errors=True)  # the run starts from scratch
    torch.manual_seed(rc.seed)
    draft = build_draft(prep.target, rc, tuple(prep.stats["aux_layer_ids"]), prep)
    snapshots: list[tuple[Path, float]] = []

    def publish(trainer: Any) -> None:
        path = publish_version(
            rc.run_dir,
            trainer.draft,
            target_config=prep.target.config,
            target_name=prep.target_name,
            tokenizer_fingerprint=tokenizer_fingerprint(prep.tokenizer),
            metrics=train_stats(trainer),
            policy_version=0,
        ).path
        snapshots.append((path, trainer.progress.seconds))

    def point(trainer: Any) -> None:
        trainer.draft.eval()
        with torch.no_grad():
            r = estimate(prep.target, trainer.draft, curve_seqs, k=K, mode="greedy", temperature=0.0)
        pr = trainer.progress
        result["curve"].append(
            {
                "step": pr.step,
                "train_seconds": pr.seconds,
                "targets_seen": pr.targets_seen,
                "acceptance_length_T0": r["acceptance_length_est"],
                "per_position": r["per_position_est"],
            }
        )
        log.info(
            "step %d, %.0f s, %d positions: T=0 acceptance length %.3f",
            pr.step,
            pr.seconds,
            pr.targets_seen,
            r["acceptance_length_est"],
        )
        out.write_text(json.dumps(result, indent=2))
        trainer.draft.train()

    next_point, measure_due = [args.eval_every_s], [args.measure_at_s]

    def hook(trainer: Any) -> None:
        if trainer.progress.seconds >= next_point[0]:
            next_point[0] += args.eval_every_s
            point(trainer)
        if trainer.progress.seconds >= measure_due[0]:
            measure_due[0] = float("inf")
            publish(trainer)

    trainer = train(rc, prep, draft, sink=None, eval_hook=hook)
    if not result["curve"] or result["curve"][-1]["step"] != trainer.progress.step:
        point(trainer)
    publish(trainer)
    result["stats"] = train_stats(trainer)
    out.write_text(json.dumps(result, indent=2))

    prompts = heldout_prompts(prep, args.eval_prompts, recipe.data.max_prompt_tokens)
    for path, seconds in snapshots:
        rows = measure(prep, path, prompts, str(recipe.target.dtype), args.eval_max_new)
        result["measured"].append({"draft": repo_relative(path), "train_seconds": seconds, "eval": rows})
        out.write_text(json.dumps(result, indent=2))
    return finish(args, result, out, head(args.name), render, t0)


if __name__ == "__main__":
    sys.exit(main())
