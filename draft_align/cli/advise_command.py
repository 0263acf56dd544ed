"""``advise``: a run's step profile and projected speed-ups, optionally after timing its vLLM engine steps."""

from __future__ import annotations

import argparse
from pathlib import Path


def _calibrate_round_cost(run: Path, args: argparse.Namespace) -> Path:
    """Time plain and speculative vLLM engine steps for ``run`` (its recipe's target, draft, prompts,
    temperature and verify mode) into ``run/round_cost.json``."""
    import torch
    from transformers import AutoTokenizer

    from draft_align import assets, data
    from draft_align.config import RESOLVED_RECIPE, CotrainRecipe, load_recipe
    from draft_align.engines.vllm.round_timing import calibrate_round_cost
    from draft_align.engines.vllm.start import set_cpu_env
    from draft_align.engines.vllm.vllm_rollouts import VERIFY_TO_SAMPLE_METHOD
    from draft_align.monitor.advise import advise_run
    from draft_align.monitor.round_cost import ROUND_COST_FILE
    from draft_align.rl.prompts import build_prompts
    from draft_align.sidecar.launch import starting_draft

    settings = advise_run(run).settings  # the run must be advisable before minutes are spent timing it
    if not (run / RESOLVED_RECIPE).is_file():
        raise ValueError(f"--calibrate needs {run / RESOLVED_RECIPE} (the resolved recipe cotrain writes)")
    recipe = load_recipe(run / RESOLVED_RECIPE, None, CotrainRecipe)
    rl = recipe.rl
    draft = run if (run / "latest").is_file() else starting_draft(recipe, None)
    ks = args.calibrate_k or sorted({1, settings.k if settings.k > 1 else 3})
    sizes = args.batch_sizes or sorted({1, settings.batch_size})
    tok = AutoTokenizer.from_pretrained(assets.resolve_model(recipe.target.model))
    convs, _ = data.split_heldout(
        data.load_conversations(recipe.data.source), recipe.data.heldout, recipe.data.split_seed
    )
    prompts = [
        p.tolist()
        for p in build_prompts(tok, convs[rl.task.first_prompt :], max(sizes), rl.task.max_prompt_tokens)
    ]
    set_cpu_env(rl.engine.kv_cache_gb)
    torch.set_num_threads(rl.num_threads)
    table = calibrate_round_cost(
        recipe.target.model,
        draft,
        prompts,
        ks=ks,
        batch_sizes=sizes,
        temperature=rl.task.temperature,
        draft_sample_method=VERIFY_TO_SAMPLE_METHOD.get(str(rl.engine.verify_mode)),  # type: ignore[arg-type]
        max_tokens=args.calibrate_tokens,
        dtype=recipe.target.dtype,
        max_model_len=rl.engine.max_model_len,
        seed=recipe.seed,
        enforce_eager=True,
    )
    return table.save(run / ROUND_COST_FILE)


def cmd_advise(args: argparse.Namespace) -> int:
    from draft_align.monitor.advise import advise_run
    from draft_align.monitor.advise_text import format_advice

    run = Path(args.run_dir)
    if args.calibrate:
        print(f"round cost measured: {_calibrate_round_cost(run, args)}")
    print(format_advice(advise_run(run)))
    return 0
