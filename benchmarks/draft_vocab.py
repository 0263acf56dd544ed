"""Draft vocabulary size (issue 13, item 4): acceptance and train speed of EAGLE-3 drafts that differ only in
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
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_md import replace_section  # noqa: E402
from draft_align.config import load_recipe  # noqa: E402
from draft_align.hf.generate import generate_responses  # noqa: E402
from draft_align.monitor.estimator import estimate  # noqa: E402
from draft_align.monitor.evaluate import eos_ids  # noqa: E402
from draft_align.warmstart import build_draft, heldout_prompts, prepare, train, vocab_report  # noqa: E402

log = logging.getLogger("bench.vocab")
HEAD = "## Draft vocabulary size (benchmarks/draft_vocab.py)"


def render(result: dict) -> str:
    """The RESULTS.md section for one run."""
    d = result["data"]
    lines = [
        HEAD, "", f"Command: `{result['command']}` (one run; {result['date']}; 2-core CPU).", "",
        f"SmolLM2-135M-Instruct target ({result['target_dtype']}); recipe `{result['recipe']}`: "
        f"{d['train_sequences']} training sequences, {d['train_targets']} trainable response positions, one "
        f"capture shared by every arm; each arm a fresh EAGLE-3 draft (seed {result['seed']}, K = "
        f"{result['ttt_steps']} TTT unroll) trained for {result['budget_s']:.0f} s of training wall-clock. "
        f"Acceptance at k = 3 on {result['eval_prompts']} held-out prompts, ≤ {result['eval_max_new']} new tokens: "
        "T = 0 is engine replay on the target's greedy continuations (exact at T = 0); T = 1 probabilistic is the "
        "engine-replay estimate on the target's own T = 1 samples (projected from α = Σ min(p, q), not decoded). "
        "Vocabulary columns: the target's probability mass outside the draft vocabulary and the share of its "
        "argmax tokens outside it, on held-out greedy responses.",
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
    ap.add_argument("--recipe", default=str(ROOT / "recipes/smollm2_bench.yaml"))
    ap.add_argument("--vocabs", default="16384,32768,49152", help="comma-separated draft vocabulary sizes")
    ap.add_argument("--budget-s", type=float, default=360.0)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--eval-max-new", type=int, default=96)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out"))
    ap.add_argument("--no-results-md", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("httpx", "urllib3", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocabs = [int(v) for v in args.vocabs.split(",") if v]
    ov = [f"train.time_budget_s={args.budget_s}", "logging.progress_bar=false", "logging.wandb=false",
          *args.overrides]
    recipe = load_recipe(args.recipe, ov)
    result: dict = {
        "command": "  ".join(["python benchmarks/draft_vocab.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"), "recipe": Path(args.recipe).name, "budget_s": args.budget_s,
        "eval_prompts": args.eval_prompts, "eval_max_new": args.eval_max_new, "seed": recipe.seed,
        "ttt_steps": recipe.train.ttt_steps, "target_dtype": recipe.target.dtype, "arms": [],
    }
    t0 = time.time()
    prep = prepare(recipe)
    result["data"] = {**prep.stats, "prepare_seconds": time.time() - t0}
    aux = tuple(prep.stats["aux_layer_ids"])
    vocab = int(prep.target.config.vocab_size)
    if any(not 1 <= v <= vocab for v in vocabs):
        raise SystemExit(f"--vocabs: each size must be in 1..{vocab} (the target's vocabulary)")

    prompts = heldout_prompts(prep, args.eval_prompts, recipe.data.max_prompt_tokens)
    eos = eos_ids(prep.target, prep.tokenizer)
    pad = prep.tokenizer.pad_token_id if prep.tokenizer.pad_token_id is not None else min(eos)
    samples = {
        temp: list(zip(prompts, generate_responses(
            prep.target, prompts, max_new_tokens=args.eval_max_new, temperature=temp, eos_ids=eos, pad_id=pad,
            batch_size=32, seed=0), strict=True))
        for temp in (0.0, 1.0)
    }  # fmt: skip

    for v in vocabs:
        rc = load_recipe(args.recipe, [*ov, f"run={recipe.run}-vocab{v}", f"draft.draft_vocab_size={v}"])
        shutil.rmtree(rc.run_dir, ignore_errors=True)  # every arm starts from scratch
        torch.manual_seed(rc.seed)
        draft = build_draft(prep.target, rc, aux, prep)
        trainer = train(rc, prep, draft, sink=None)
        draft.eval()
        with torch.no_grad():
            t0_est = estimate(prep.target, draft, samples[0.0], k=3, mode="greedy", temperature=0.0)
            t1_est = estimate(prep.target, draft, samples[1.0], k=3, mode="probabilistic", temperature=1.0)
        pr = trainer.progress
        arm = {
            "draft_vocab_size": v, "steps": pr.step, "train_seconds": pr.seconds, "targets_seen": pr.targets_seen,
            "targets_per_s": pr.targets_seen / pr.seconds,
            "acceptance_length_T0": t0_est["acceptance_length_est"], "per_position_T0": t0_est["per_position_est"],
            "acceptance_length_T1_probabilistic": t1_est["acceptance_length_est"],
            "draft_mb_bf16": sum(p.numel() for p in draft.parameters()) * 2 / 1e6,
            **vocab_report(prep, draft),
        }
        result["arms"].append(arm)
        log.info("vocab %d: %d steps, %.0f positions/s, T=0 %.3f, T=1 probabilistic %.3f, argmax outside %.4f",
                 v, arm["steps"], arm["targets_per_s"], arm["acceptance_length_T0"],
                 arm["acceptance_length_T1_probabilistic"], arm["vocab_oov_argmax_rate"])
        (out / "draft_vocab.json").write_text(json.dumps(result, indent=2))
    result["total_seconds"] = time.time() - t0
    (out / "draft_vocab.json").write_text(json.dumps(result, indent=2))
    if not args.no_results_md:
        replace_section(ROOT / "benchmarks" / "RESULTS.md", HEAD, render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
