"""Draft vocabulary size: acceptance and train speed of EAGLE-3 drafts that differ only in
``draft.draft_vocab_size``, trained on the same tokens for the same wall-clock.

    .venv/bin/python benchmarks/draft_vocab.py [--vocabs 16384,32768,49152] [--budget-s 360] [--eval-prompts 32]
        [overrides ...]

One data preparation (the recipe's, cached: the same capture serves every arm), then per vocabulary size:
a fresh draft (same seed), ``--budget-s`` seconds of TTT training, and on held-out prompts

- T = 0: mean acceptance length at k = 3 by engine replay on the target's greedy continuations (exact at T = 0:
  acceptance is deterministic there, and tests assert replay = the reference decoder);
- T = 1, probabilistic draft sampling: the engine-replay estimate on the target's own T = 1 samples
  (α = Σ_x min(p, q) per position; estimated, not decoded);
- the target's probability mass outside the draft vocabulary and its out-of-vocab argmax rate;
- training throughput (response positions per second, optimizer steps in the budget).

Writes ``benchmarks/out/draft_vocab.json`` and the section in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.arms import (  # noqa: E402
    add_common_args,
    finish,
    prepare_shared,
    section_intro,
    setup,
    target_samples,
    train_arm,
    train_stats,
)
from draft_align.monitor.estimator import estimate  # noqa: E402
from draft_align.warmstart import heldout_prompts, vocab_report  # noqa: E402

log = logging.getLogger("bench.vocab")
HEAD = "## Draft vocabulary size (benchmarks/draft_vocab.py)"


def render(result: dict) -> str:
    """The RESULTS.md section for one run."""
    lines = section_intro(HEAD, result)
    lines[-1] += (
        ". "
        f"Acceptance at k = 3 on {result['eval_prompts']} held-out prompts, ≤ {result['eval_max_new']} new tokens: "
        "T = 0 is engine replay on the target's greedy continuations (exact at T = 0); T = 1 probabilistic is the "
        "engine-replay estimate on the target's own T = 1 samples (projected from α = Σ min(p, q), not decoded). "
        "Vocabulary columns: the target's probability mass outside the draft vocabulary and the share of its "
        "argmax tokens outside it, on held-out greedy responses."
    )
    lines += [
        "",
        "| draft vocab | optimizer steps | positions/s | T=0 acceptance length | r1, r2, r3 (T=0) "
        "| T=1 probabilistic (estimated) | mass outside | argmax outside | draft MB (bf16) |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for a in result["arms"]:
        pp = ", ".join(f"{x:.3f}" for x in a["per_position_T0"])
        lines.append(
            f"| {a['draft_vocab_size']} | {a['steps']} | {a['targets_per_s']:.0f} | {a['acceptance_length_T0']:.3f} "
            f"| {pp} | {a['acceptance_length_T1_probabilistic']:.3f} | {a['vocab_lost_mass']:.4f} "
            f"| {a['vocab_oov_argmax_rate']:.4f} | {a['draft_mb_bf16']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabs", default="16384,32768,49152", help="comma-separated draft vocabulary sizes")
    add_common_args(ap)
    args = ap.parse_args()
    vocabs = [int(v) for v in args.vocabs.split(",") if v]
    ov, recipe, result = setup(args, "draft_vocab.py")
    out = Path(args.out)
    t0 = time.time()
    prep = prepare_shared(recipe, result)
    vocab = int(prep.target.config.vocab_size)
    if any(not 1 <= v <= vocab for v in vocabs):
        raise SystemExit(f"--vocabs: each size must be in 1..{vocab} (the target's vocabulary)")

    prompts = heldout_prompts(prep, args.eval_prompts, recipe.data.max_prompt_tokens)
    samples = {temp: target_samples(prep, prompts, args.eval_max_new, temp) for temp in (0.0, 1.0)}

    for v in vocabs:
        _, draft, trainer = train_arm(
            args, ov, prep, [f"run={recipe.run}-vocab{v}", f"draft.draft_vocab_size={v}"]
        )
        with torch.no_grad():
            t0_est = estimate(prep.target, draft, samples[0.0], k=3, mode="greedy", temperature=0.0)
            t1_est = estimate(prep.target, draft, samples[1.0], k=3, mode="probabilistic", temperature=1.0)
        arm = {
            "draft_vocab_size": v,
            **train_stats(trainer),
            "acceptance_length_T0": t0_est["acceptance_length_est"],
            "per_position_T0": t0_est["per_position_est"],
            "acceptance_length_T1_probabilistic": t1_est["acceptance_length_est"],
            "draft_mb_bf16": sum(p.numel() for p in draft.parameters()) * 2 / 1e6,
            **vocab_report(prep, draft),
        }
        result["arms"].append(arm)
        log.info(
            "vocab %d: %d steps, %.0f positions/s, T=0 %.3f, T=1 probabilistic %.3f, argmax outside %.4f",
            v,
            arm["steps"],
            arm["targets_per_s"],
            arm["acceptance_length_T0"],
            arm["acceptance_length_T1_probabilistic"],
            arm["vocab_oov_argmax_rate"],
        )
        (out / "draft_vocab.json").write_text(json.dumps(result, indent=2))
    return finish(args, result, out / "draft_vocab.json", HEAD, render, t0)


if __name__ == "__main__":
    sys.exit(main())
