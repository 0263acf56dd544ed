"""Objectives × verify modes: EAGLE-3 drafts that differ only in the training objective
(``train.objective.loss``, ``train.objective.soft_ce_weight``, ``train.objective.accept_mode``), trained on the same tokens for the same
wall-clock, then measured by vLLM's spec-decode counters and estimated by engine replay, side by side.

    .venv/bin/python benchmarks/objectives.py [--arms soft,tv,expected_length,tv+ce0.1] [--budget-s 360]
        [--eval-prompts 32] [--eval-max-new 96] [overrides ...]

An arm is ``LOSS[@ACCEPT_MODE][+ceWEIGHT]``: ``tv``, ``expected_length@greedy_draft``, ``tv+ce0.1`` (TV plus
0.1 × soft CE), checked by the recipe's own rule (``conventions.check_loss``) before anything runs.

One data preparation (the recipe's, cached: the same capture serves every arm), then per arm: a fresh draft
(same seed), ``--budget-s`` seconds of TTT training, the draft published to its run folder, and on
``--eval-prompts`` held-out prompts at k = 3 what ``draft-align eval --engine vllm --json`` reports
(:func:`draft_align.engines.vllm.vllm_eval.evaluate_vllm`, one engine per draft and mode): T = 0 greedy,
T = 1 greedy_draft and T = 1 probabilistic, each the measured mean acceptance length (vLLM's counters) beside
the engine-replay estimate on the same outputs.  Writes ``benchmarks/out/objectives.json`` and the section in
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common.arms import (  # noqa: E402
    K,
    LastMetrics,
    add_common_args,
    finish,
    measure,
    prepare_shared,
    section_intro,
    setup,
    train_arm,
    train_stats,
)
from benchmarks.common.results_md import repo_relative  # noqa: E402
from draft_align.conventions import check_loss  # noqa: E402

log = logging.getLogger("bench.objectives")
HEAD = "## Objectives × verify modes (benchmarks/objectives.py)"
DEFAULT_ARMS = "soft,tv,expected_length,tv+ce0.1"
_SPEC = re.compile(r"(?P<loss>[a-z_]+)(?:@(?P<mode>[a-z_]+))?(?:\+ce(?P<w>[0-9]*\.?[0-9]+(?:e-?[0-9]+)?))?")


def parse_arm(spec: str) -> dict[str, Any]:
    """``LOSS[@ACCEPT_MODE][+ceWEIGHT]`` → the arm's name and recipe fields; ValueError (one line, naming the
    spec) for a malformed spec or a combination the recipe would refuse."""
    m = _SPEC.fullmatch(spec.strip())
    if m is None:
        raise ValueError(
            f"arm {spec!r}: expected LOSS[@ACCEPT_MODE][+ceWEIGHT], e.g. tv, "
            f"expected_length@greedy_draft, tv+ce0.1"
        )
    loss, mode, w = m["loss"], m["mode"], float(m["w"]) if m["w"] else 0.0
    try:
        check_loss(loss, mode, w, 1.0)
    except ValueError as e:
        raise ValueError(f"arm {spec!r}: {e}") from None
    return {"name": spec.strip(), "loss": loss, "accept_mode": mode, "soft_ce_weight": w}


def parse_arms(specs: str) -> list[dict[str, Any]]:
    """A comma list of arm specs (at least one, no name twice)."""
    arms = [parse_arm(s) for s in specs.split(",") if s.strip()]
    names = [a["name"] for a in arms]
    if not arms or len(set(names)) != len(names):
        raise ValueError(f"--arms {specs!r}: give one or more distinct arm specs, comma-separated")
    return arms


def arm_overrides(arm: dict[str, Any], run: str) -> list[str]:
    """The recipe overrides of one arm: its own run folder, the objective, every step's metrics kept."""
    slug = re.sub(r"[^A-Za-z0-9_]+", "-", arm["name"]).strip("-")
    ov = [
        f"run={run}-obj-{slug}",
        f"train.objective.loss={arm['loss']}",
        f"train.objective.soft_ce_weight={arm['soft_ce_weight']}",
        "logging.log_every=1",
    ]
    return ov + ([f"train.objective.accept_mode={arm['accept_mode']}"] if arm["accept_mode"] else [])


def _cell(row: dict[str, Any]) -> str:
    if "error" in row:
        return "— (vLLM failed)"
    return f"{row['acceptance_length_measured']:.3f} / {row['acceptance_length_est']:.3f}"


def render(result: dict) -> str:
    """The RESULTS.md section for one run."""
    lines = section_intro(HEAD, result)
    lines[-1] += (
        " with "
        "its objective (`loss[@accept_mode][+ce λ]`: `train.objective.loss`, `train.objective.accept_mode`, `train.objective.soft_ce_weight`). "
        f"Acceptance at k = {K} on {result['eval_prompts']} held-out prompts, ≤ {result['eval_max_new']} new "
        "tokens, each cell **measured / estimated** mean acceptance length: measured by vLLM's spec-decode "
        "counters (the published bf16 draft as vLLM's EAGLE-3 drafter, `draft-align eval --engine vllm`), "
        "estimated by engine replay of the same draft on vLLM's own outputs. Final loss / ce_0 / acc_0: the last "
        "training step's objective, step-0 soft CE and step-0 argmax agreement (teacher-forced). Of bf16 roofline: "
        "the soft-CE step's matmul FLOPs on the arm's tokens (benchmarks/warmstart.py's model, soft targets at the "
        f"scored positions) per second over this CPU's measured bf16 matmul rate "
        f"({result['roofline_gflops_bf16']:.0f} GFLOP/s); the acceptance objectives' extra target logits per "
        "step are not counted, so their fraction is a lower bound."
    )
    lines += [
        "",
        "| arm | optimizer steps | positions trained | positions/s | of bf16 roofline | final loss / ce_0 / acc_0 "
        "| T=0 greedy | T=1 greedy_draft | T=1 probabilistic | prompts |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for a in result["arms"]:
        final = " / ".join(
            f"{a['final_metrics'].get(m, float('nan')):.3f}" for m in ("loss", "ce_0", "acc_0")
        )
        prompts = sorted({r["num_prompts"] for r in a["eval"] if "num_prompts" in r})
        lines.append(
            f"| `{a['name']}` | {a['steps']} | {a['targets_seen']} | {a['targets_per_s']:.0f} | "
            f"{a['train_gflops'] / result['roofline_gflops_bf16']:.2f} | {final} | "
            + " | ".join(_cell(r) for r in a["eval"])
            + f" | {', '.join(map(str, prompts)) or '—'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default=DEFAULT_ARMS, help="comma list of LOSS[@ACCEPT_MODE][+ceWEIGHT]")
    add_common_args(ap)
    args = ap.parse_args()
    try:
        arms = parse_arms(args.arms)
    except ValueError as e:
        ap.error(str(e))
    from draft_align.engines.vllm.start import set_cpu_env
    from draft_align.publish.compat import tokenizer_fingerprint
    from draft_align.publish.versions import publish_version
    from draft_align.warmstart import heldout_prompts

    set_cpu_env()  # before vLLM is imported: the in-process engine, a small KV cache, no OpenMP pinning
    ov, recipe, result = setup(args, "objectives.py")
    from benchmarks.warmstart import matmul_roofline

    result["roofline_gflops_bf16"] = matmul_roofline(
        torch.bfloat16
    )  # measured here, as benchmarks/warmstart.py
    out = Path(args.out) / "objectives.json"
    t0 = time.time()
    prep = prepare_shared(recipe, result)
    prompts = heldout_prompts(prep, args.eval_prompts, recipe.data.max_prompt_tokens)
    for arm in arms:
        sink = LastMetrics()
        rc, draft, trainer = train_arm(args, ov, prep, arm_overrides(arm, recipe.run), sink)
        stats = train_stats(trainer)
        draft_dir = publish_version(
            rc.run_dir,
            draft,
            target_config=prep.target.config,
            target_name=prep.target_name,
            tokenizer_fingerprint=tokenizer_fingerprint(prep.tokenizer),
            metrics=stats,
            policy_version=0,
        ).path
        t_eval = time.time()
        rows = measure(prep, draft_dir, prompts, str(recipe.target.dtype), args.eval_max_new)
        result["arms"].append(
            {
                **arm,
                **stats,
                "final_metrics": sink.metrics,
                "draft": repo_relative(draft_dir),
                "eval_seconds": time.time() - t_eval,
                "eval": rows,
            }
        )
        log.info(
            "arm %s: %d steps, %.0f positions/s; %s",
            arm["name"],
            stats["steps"],
            stats["targets_per_s"],
            ", ".join(f"{r['verify_mode']} T={r['temperature']:g} {_cell(r)}" for r in rows),
        )
        out.write_text(json.dumps(result, indent=2))
    return finish(args, result, out, HEAD, render, t0)


if __name__ == "__main__":
    sys.exit(main())
