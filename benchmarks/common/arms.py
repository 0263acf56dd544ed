"""Shared by the same-tokens, same-wall-clock comparisons (benchmarks/draft_vocab.py, benchmarks/objectives.py):
the command-line options, one data preparation for every arm, and one arm's fresh draft trained for the budget."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is benchmarks/common/…)
log = logging.getLogger("bench.arms")
K = 3  # draft tokens per round in every measurement
MODES: tuple[tuple[str, float], ...] = (("greedy", 0.0), ("greedy_draft", 1.0), ("probabilistic", 1.0))


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """Recipe, training budget per arm, held-out evaluation size, output folder, recipe overrides."""
    ap.add_argument("--recipe", default=str(ROOT / "recipes/smollm2_bench.yaml"))
    ap.add_argument("--budget-s", type=float, default=360.0, help="training wall-clock per arm")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--eval-max-new", type=int, default=96)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out"))
    ap.add_argument("--no-results-md", action="store_true")
    ap.add_argument("overrides", nargs="*")


def setup(args: argparse.Namespace, script: str) -> tuple[list[str], Any, dict[str, Any]]:
    """Logging, the output folder, the overrides every arm shares, the base recipe and the result's header."""
    from draft_align.config import load_recipe

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("httpx", "urllib3", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    ov = [
        f"train.time_budget_s={args.budget_s}",
        "logging.progress_bar=false",
        "logging.wandb=false",
        *args.overrides,
    ]
    recipe = load_recipe(args.recipe, ov)
    result: dict[str, Any] = {
        "command": "  ".join([f"python benchmarks/{script}", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "recipe": Path(args.recipe).name,
        "budget_s": args.budget_s,
        "eval_prompts": args.eval_prompts,
        "eval_max_new": args.eval_max_new,
        "seed": recipe.seed,
        "ttt_steps": recipe.train.objective.ttt_steps,
        "target_dtype": recipe.target.dtype,
        "arms": [],
    }
    return ov, recipe, result


def prepare_shared(recipe: Any, result: dict[str, Any]) -> Any:
    """The one data preparation (cached capture) every arm trains on; its stats go to ``result["data"]``."""
    from draft_align.warmstart import prepare

    t0 = time.time()
    prep = prepare(recipe)
    result["data"] = {**prep.stats, "prepare_seconds": time.time() - t0}
    return prep


class LastMetrics:
    """A training sink that keeps the last step's metrics (the run's own sinks are off in a benchmark)."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.metrics = dict(metrics)


def train_arm(
    args: argparse.Namespace,
    ov: list[str],
    prep: Any,
    arm_overrides: list[str],
    sink: LastMetrics | None = None,
) -> tuple[Any, Any, Any]:
    """A fresh draft (the recipe's seed, its run folder emptied first) trained for the budget with the shared
    overrides plus ``arm_overrides``: (the arm's recipe, the draft in eval mode, the trainer)."""
    from draft_align.config import load_recipe
    from draft_align.warmstart import build_draft, train

    rc = load_recipe(args.recipe, [*ov, *arm_overrides])
    shutil.rmtree(rc.run_dir, ignore_errors=True)  # every arm starts from scratch
    torch.manual_seed(rc.seed)
    draft = build_draft(prep.target, rc, tuple(prep.stats["aux_layer_ids"]), prep)
    trainer = train(rc, prep, draft, sink=sink)
    draft.eval()
    return rc, draft, trainer


def train_stats(trainer: Any) -> dict[str, Any]:
    """Optimizer steps, training seconds, response positions trained and their rate, and the matmul GFLOP/s of
    the soft-CE step on those tokens (benchmarks/warmstart.train_step_flops: an acceptance objective's extra
    target logits per step are not counted)."""
    from benchmarks.warmstart import train_step_flops

    pr = trainer.progress
    flops = train_step_flops(
        trainer.draft.cfg, pr.targets_seen, pr.tokens_seen, trainer.loss_settings.ttt_steps
    )
    return {
        "steps": pr.step,
        "train_seconds": pr.seconds,
        "targets_seen": pr.targets_seen,
        "targets_per_s": pr.targets_seen / max(pr.seconds, 1e-9),
        "train_gflops": flops / max(pr.seconds, 1e-9) / 1e9,
    }


def section_intro(head: str, result: dict[str, Any], arms: bool = True) -> list[str]:
    """The first lines of a RESULTS.md section: the heading, the exact command, and the shared setup up to the
    training budget (the caller continues the paragraph with its arms and its measurement); ``arms`` False:
    worded for a run of one draft."""
    d = result["data"]
    who = (
        "one capture shared by every arm; each arm a fresh EAGLE-3 draft"
        if arms
        else "one fresh EAGLE-3 draft"
    )
    return [
        head,
        "",
        f"Command: `{result['command']}` (one run; {result['date']}; 2-core CPU).",
        "",
        f"SmolLM2-135M-Instruct target ({result['target_dtype']}); recipe `{result['recipe']}`: "
        f"{d['train_sequences']} training sequences, {d['train_targets']} trainable response positions; {who} "
        f"(seed {result['seed']}, K = {result['ttt_steps']} TTT unroll) trained for {result['budget_s']:.0f} s of "
        "training wall-clock",
    ]


def finish(
    args: argparse.Namespace, result: dict[str, Any], path: Path, head: str, render: Any, t0: float
) -> int:
    """The total time, the JSON at ``path``, the RESULTS.md section (unless ``--no-results-md``), printed."""
    from benchmarks.common.results_md import replace_section

    result["total_seconds"] = time.time() - t0
    path.write_text(json.dumps(result, indent=2))
    text = render(result)
    if not args.no_results_md:
        replace_section(ROOT / "benchmarks" / "RESULTS.md", head, text)
    print(text)
    return 0


def measure(prep: Any, draft_dir: Path, prompts: list, dtype: str, max_new: int) -> list[dict[str, Any]]:
    """``draft-align eval --engine vllm`` of the published draft at k = 3 for every (mode, T) of MODES."""
    from draft_align.engines.vllm.start import EngineError
    from draft_align.engines.vllm.vllm_eval import evaluate_vllm
    from draft_align.monitor.evaluate import eos_ids
    from draft_align.publish import load_draft

    draft, _ = load_draft(draft_dir)  # the exported (bf16) weights vLLM serves: the estimate replays the same
    eos = eos_ids(prep.target, prep.tokenizer)
    rows = []
    for mode, temp in MODES:
        row: dict[str, Any] = {"verify_mode": mode, "temperature": temp}
        try:
            r = evaluate_vllm(
                prep.target_name,
                draft_dir,
                prep.target,
                draft.eval(),
                prompts,
                eos,
                k=K,
                mode=mode,
                temperature=temp,
                max_new_tokens=max_new,
                seed=0,
                dtype=dtype,
            )
        except (EngineError, ValueError) as e:
            log.error("%s T=%g: vLLM could not measure (%s)", mode, temp, e)
            rows.append({**row, "error": str(e).splitlines()[0]})
            continue
        keep = (
            "acceptance_length_measured",
            "acceptance_length_est",
            "per_position_measured",
            "per_position_est",
            "rounds_measured",
            "num_tokens",
            "num_prompts",
            "seconds_engine_start",
            "seconds",
        )
        rows.append({**row, **{k: r[k] for k in keep}})
        log.info(
            "%s T=%g: measured %.3f, estimated %.3f",
            mode,
            temp,
            r["acceptance_length_measured"],
            r["acceptance_length_est"],
        )
    return rows


def target_samples(prep: Any, prompts: list, max_new: int, temperature: float) -> list[tuple[Any, Any]]:
    """(prompt, the target's own continuation at ``temperature``, seed 0) pairs: what engine-replay estimates
    (``monitor.estimator.estimate``) score a draft on."""
    from draft_align.hf.generate import generate_responses
    from draft_align.monitor.evaluate import eos_ids

    eos = eos_ids(prep.target, prep.tokenizer)
    pad = prep.tokenizer.pad_token_id if prep.tokenizer.pad_token_id is not None else min(eos)
    out = generate_responses(
        prep.target,
        prompts,
        max_new_tokens=max_new,
        temperature=temperature,
        eos_ids=eos,
        pad_id=pad,
        batch_size=32,
        seed=0,
    )
    return list(zip(prompts, out, strict=True))
