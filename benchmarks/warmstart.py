"""Warm-start benchmark: SmolLM2-135M target, ShareGPT prompts, a fixed CPU budget, 64 held-out prompts.

    .venv/bin/python benchmarks/warmstart.py [--budget-s 1200] [--eval-every-s 240] [--out benchmarks/out]

1. Data (shared by both drafts, timed separately): greedy self-distillation of train prompts + capture.
2. (a) TTT draft, K=7, trained for ``--budget-s`` seconds of training wall-clock; every
   ``--eval-every-s`` the learning curve gets a point: T=0 acceptance on 64 held-out prompts, engine replay
   of the target's own greedy continuations (at T=0 this equals what the reference decoder measures:
   acceptance is deterministic, and tests assert the equality).
   (b) K=1 draft (NeMo RL's single-step objective) trained on the same batches, same number of steps.
3. Final evaluation of both at k=3: T=0 (greedy), T=1 greedy_draft and T=1 probabilistic, estimated and
   measured by the reference speculative decoder on 64 held-out prompts.
4. Train-step FLOP/s as a fraction of this CPU's bf16 matmul roofline (measured here, not assumed).

Writes ``<out>/warmstart.json`` and the section in ``benchmarks/RESULTS.md``.
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

from benchmarks.common.results_md import replace_section  # noqa: E402
from draft_align.config import load_recipe  # noqa: E402
from draft_align.engines.reference.reference_eval import evaluate  # noqa: E402
from draft_align.hf.generate import generate_responses  # noqa: E402
from draft_align.monitor.estimator import estimate  # noqa: E402
from draft_align.monitor.evaluate import eos_ids, format_table  # noqa: E402
from draft_align.warmstart import build_draft, heldout_prompts, prepare, train, vocab_report  # noqa: E402

log = logging.getLogger("bench")


def matmul_roofline(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """Measured GFLOP/s of an n×n×n matmul in ``dtype`` (median of reps)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    ts.sort()
    return 2 * n**3 / ts[len(ts) // 2] / 1e9


def train_step_flops(cfg, targets: int, tokens: int, steps: int) -> float:
    """Matmul FLOPs of one TTT train step (forward + backward ≈ 3× forward), per the module shapes.

    Every position: fc (3H_t→H) and k/v projections (2H→2·kv·d).  Every chain start and step: q (2H→h·d),
    o (h·d→H), MLP (3·H·I), lm_head (H→Vd); attention ≈ 2·h·d·(context) per start-step, ignored here
    (context-dependent; it makes the figure a lower bound).  Soft-target logits: H·Vd per scored position
    (≈ ``targets``: the trainer computes them only where some TTT step scores), forward only.  The RESULTS.md
    warm-start table predates that and counted them at every position.
    """
    h, i, vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    d, nh, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    per_pos = 2 * (cfg.fc_in_features * h + 2 * h * 2 * kv * d)
    per_start_step = 2 * (2 * h * nh * d + nh * d * h + 3 * h * i + h * vd + 2 * h * 2 * kv * d)
    fwd = tokens * per_pos + targets * steps * per_start_step
    return 3 * fwd + targets * 2 * h * vd


def _f(x, nd=3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def render(result: dict) -> str:
    """The RESULTS.md section for one benchmark run."""
    lines = ["## Warm-start (benchmarks/warmstart.py)", "", "```", result["command"], "```", ""]
    d = result["data"]
    lines += [
        f"Machine: this 2-core CPU; measured matmul roofline bf16 {result['roofline_gflops']['bf16']:.0f} GFLOP/s, "
        f"fp32 {result['roofline_gflops']['fp32']:.0f} GFLOP/s.",
        f"Data: {d['train_sequences']} training sequences (the recipe's greedy self-distilled answers of "
        f"SmolLM2-135M-Instruct to ShareGPT first-turn prompts, plus `data.extra_original_conversations` ShareGPT "
        f"conversations with their own responses), {d['train_tokens']} tokens, {d['train_targets']} trainable "
        f"response positions; prepare {d['prepare_seconds']:.0f} s in this run (cached generation and capture are "
        f"reused). "
        f"Training budget: {result['budget_s']:.0f} s of training wall-clock for the TTT draft "
        f"(data preparation and evaluation not counted).",
        "",
    ]
    if "vocab" in result:
        v = result["vocab"]
        lines += [
            f"Draft vocab: target probability mass outside it {v['vocab_lost_mass']:.4f}; out-of-vocab target "
            f"argmax rate {v['vocab_oov_argmax_rate']:.4f} (held-out greedy responses, {v['vocab_eval_tokens']} positions).",
            "",
        ]
    lines += [
        "| draft | steps | train s | positions | positions/s | token-steps/s | GFLOP/s | of bf16 roofline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tag in ("ttt", "k1"):
        if tag in result:
            r = result[tag]
            lines.append(
                f"| {tag} (K={r['ttt_steps']}) | {r['steps']} | {r['train_seconds']:.0f} | {r['targets_seen']} | "
                f"{r['targets_per_s']:.0f} | {r['token_steps_per_s']:.0f} | {r['train_gflops']:.0f} | "
                f"{r['roofline_fraction_bf16']:.2f} |"
            )
    lines += [
        "",
        "Mean acceptance length at k=3 on held-out prompts (est = engine replay estimate; all-starts = "
        "per-start average; measured = reference speculative decoder):",
        "",
        "| draft | mode | T | est | all-starts | measured | est/measured | r1..r3 measured | prompts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tag in ("ttt", "k1"):
        for r in result.get(f"eval_{tag}", []):
            est, meas = r["acceptance_length_est"], r["acceptance_length_measured"]
            pm = ", ".join(f"{x:.3f}" for x in r["per_position_measured"])
            lines.append(
                f"| {tag} | {r['verify_mode']} | {r['temperature']:g} | {_f(est)} | "
                f"{_f(r['acceptance_length_all_starts'])} | {_f(meas)} | {_f(est / meas if meas else None)} | "
                f"{pm} | {r['num_prompts']} |"
            )
    for tag in ("ttt", "k1"):
        if tag in result and result[tag]["curve"]:
            lines += [
                "",
                f"Learning curve ({tag}): T=0 mean acceptance length at k=3 (engine replay on the target's "
                "greedy held-out continuations; exact at T=0) vs training positions:",
                "",
                "| step | train s | positions | acceptance length | r1, r2, r3 |",
                "|---|---|---|---|---|",
            ]
            seen = set()
            for c in result[tag]["curve"]:
                if c["step"] in seen:  # the final point can repeat the last periodic one
                    continue
                seen.add(c["step"])
                pp = ", ".join(f"{x:.3f}" for x in c["per_position"])
                lines.append(
                    f"| {c['step']} | {c['train_seconds']:.0f} | {c['targets_seen']} | "
                    f"{c['acceptance_length_T0']:.3f} | {pp} |"
                )
    return "\n".join(lines) + "\n"


def write_results(result: dict, path: Path) -> None:
    """Replace this benchmark's section of RESULTS.md (other benchmarks' sections are kept)."""
    replace_section(path, "## Warm-start (benchmarks/warmstart.py)", render(result))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(ROOT / "recipes/smollm2_bench.yaml"))
    ap.add_argument("--budget-s", type=float, default=1200.0)
    ap.add_argument("--eval-every-s", type=float, default=240.0)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--eval-max-new", type=int, default=128)
    ap.add_argument("--eval-prompts-t1", type=int, default=32, help="prompts decoded at T=1 (slower)")
    ap.add_argument("--gen-budget-s", type=float, default=None)
    ap.add_argument("--skip-k1", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "  ".join(["python benchmarks/warmstart.py", *sys.argv[1:]])
    ov = [f"train.time_budget_s={args.budget_s}", "logging.progress_bar=false", *args.overrides]
    if args.gen_budget_s is not None:
        ov.append(f"data.gen_time_budget_s={args.gen_budget_s}")
    recipe = load_recipe(args.recipe, ov)
    result: dict = {"command": command, "recipe": recipe.run, "budget_s": args.budget_s}

    roof_bf16 = matmul_roofline(torch.bfloat16)
    roof_fp32 = matmul_roofline(torch.float32)
    result["roofline_gflops"] = {"bf16": roof_bf16, "fp32": roof_fp32}
    log.info("matmul roofline: bf16 %.0f GFLOP/s, fp32 %.0f GFLOP/s", roof_bf16, roof_fp32)

    t0 = time.time()
    prep = prepare(recipe)
    result["data"] = {**prep.stats, "prepare_seconds": time.time() - t0}
    aux = tuple(prep.stats["aux_layer_ids"])

    # Held-out sequences for the learning curve: the target's own greedy continuations.
    prompts = heldout_prompts(prep, args.eval_prompts, recipe.data.max_prompt_tokens)
    eos = eos_ids(prep.target, prep.tokenizer)
    pad = prep.tokenizer.pad_token_id if prep.tokenizer.pad_token_id is not None else min(eos)
    t = time.time()
    greedy = generate_responses(
        prep.target,
        prompts,
        max_new_tokens=args.eval_max_new,
        temperature=0.0,
        eos_ids=eos,
        pad_id=pad,
        batch_size=32,
        seed=0,
    )
    curve_seqs = list(zip(prompts, greedy, strict=True))
    log.info("held-out greedy continuations: %.0f s", time.time() - t)

    def curve_point(trainer, curve: list, tag: str) -> None:
        trainer.draft.eval()
        with torch.no_grad():
            r = estimate(prep.target, trainer.draft, curve_seqs, k=3, mode="greedy", temperature=0.0)
        pr = trainer.progress
        curve.append(
            {
                "step": pr.step,
                "train_seconds": pr.seconds,
                "targets_seen": pr.targets_seen,
                "acceptance_length_T0": r["acceptance_length_est"],
                "per_position": r["per_position_est"],
            }
        )
        log.info(
            "[%s] step %d, %.0f s, %d positions: T=0 acceptance length %.3f",
            tag,
            pr.step,
            pr.seconds,
            pr.targets_seen,
            r["acceptance_length_est"],
        )
        trainer.draft.train()

    def run_one(tag: str, overrides: list[str]) -> tuple:
        rc = load_recipe(args.recipe, ov + [f"run={recipe.run}-{tag}", *overrides])
        torch.manual_seed(rc.seed)
        draft = build_draft(prep.target, rc, aux, prep)
        curve: list = []
        next_eval = [args.eval_every_s]

        def hook(trainer) -> None:
            if trainer.progress.seconds >= next_eval[0]:
                next_eval[0] += args.eval_every_s
                curve_point(trainer, curve, tag)

        import shutil

        shutil.rmtree(rc.run_dir, ignore_errors=True)  # a benchmark run starts from scratch
        trainer = train(rc, prep, draft, sink=None, eval_hook=hook)
        curve_point(trainer, curve, tag)
        pr = trainer.progress
        flops = train_step_flops(draft.cfg, pr.targets_seen, pr.tokens_seen, rc.train.objective.ttt_steps)
        stats = {
            "ttt_steps": rc.train.objective.ttt_steps,
            "steps": pr.step,
            "train_seconds": pr.seconds,
            "tokens_seen": pr.tokens_seen,
            "targets_seen": pr.targets_seen,
            "tokens_per_s": pr.tokens_seen / pr.seconds,
            "targets_per_s": pr.targets_seen / pr.seconds,
            "token_steps_per_s": pr.targets_seen * rc.train.objective.ttt_steps / pr.seconds,
            "train_gflops": flops / pr.seconds / 1e9,
            "roofline_fraction_bf16": flops / pr.seconds / 1e9 / roof_bf16,
            "curve": curve,
        }
        return draft, stats

    draft_ttt, st_ttt = run_one("ttt", [])
    result["ttt"] = st_ttt
    result["vocab"] = vocab_report(prep, draft_ttt)
    (out / "warmstart.json").write_text(json.dumps(result, indent=2))
    drafts = {"ttt": draft_ttt}
    if not args.skip_k1:
        draft_k1, st_k1 = run_one(
            "k1",
            ["train.objective.ttt_steps=1", f"train.max_steps={st_ttt['steps']}", "train.time_budget_s=null"],
        )
        result["k1"] = st_k1
        drafts["k1"] = draft_k1
        (out / "warmstart.json").write_text(json.dumps(result, indent=2))

    for tag, d in drafts.items():
        d.eval()
        rows = []
        for mode, temp in (("greedy", 0.0), ("greedy_draft", 1.0), ("probabilistic", 1.0)):
            ps = prompts if temp == 0 else prompts[: args.eval_prompts_t1]
            r = evaluate(
                prep.target,
                prep.tokenizer,
                d,
                ps,
                k=3,
                mode=mode,
                temperature=temp,
                max_new_tokens=args.eval_max_new,
                seed=0,
            )
            rows.append(r)
            log.info(
                "[%s] %s T=%g: est %.3f, all-starts %.3f, measured %.3f",
                tag,
                mode,
                temp,
                r["acceptance_length_est"],
                r["acceptance_length_all_starts"],
                r["acceptance_length_measured"],
            )
            result[f"eval_{tag}"] = rows
            (out / "warmstart.json").write_text(json.dumps(result, indent=2))
            write_results(result, ROOT / "benchmarks/RESULTS.md")
        print(f"\n[{tag}]\n" + format_table(rows))
    result["total_seconds"] = time.time() - t0
    (out / "warmstart.json").write_text(json.dumps(result, indent=2))
    write_results(result, ROOT / "benchmarks/RESULTS.md")
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
