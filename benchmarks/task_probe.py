"""Which verifiable-reward task can SmolLM2-135M-Instruct learn? The initial policy's reward per task, sampled
as GRPO samples it (T = 1, chat template), by vLLM.

A task is learnable by GRPO when its initial reward is neither about 0 (no group has a positive advantage) nor
about 1 (nothing to learn), and when groups disagree (a group whose rewards are all equal gives no gradient):
the table reports the mean reward, the format and correctness rates, the share of groups with a non-zero
reward spread, and the mean response length.

    python benchmarks/task_probe.py --prompts 48 --group 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from draft_align import assets
from draft_align.data import encode_prompt
from draft_align.data.tasks import TASK_NAMES, make_problems, score
from draft_align.engines.vllm.start import import_vllm, set_cpu_env, start_plain_engine
from draft_align.rl.rewards import task_reward_value

OUT = Path(__file__).resolve().parent / "out"


def probe(llm, tok, task: str, prompts: int, group: int, max_new_tokens: int, seed: int) -> dict:
    vllm = import_vllm()
    problems = make_problems(task, prompts, seed=10_000 + seed)
    ids = [encode_prompt(tok, p.conversation()).tolist() for p in problems]
    # one request per sample, drawn from the engine's seeded sampler (vLLM-CPU's seeded per-request generators
    # fail when a chunked prefill discards a sampled token)
    params = vllm.SamplingParams(temperature=1.0, max_tokens=max_new_tokens)
    t0 = time.perf_counter()
    reqs = [{"prompt_token_ids": i} for i in ids for _ in range(group)]
    outs = llm.generate(reqs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    rewards, fmt, correct, lengths, spread = [], [], [], [], 0
    for j, p in enumerate(problems):
        group_r = []
        for c in (o.outputs[0] for o in outs[j * group : (j + 1) * group]):
            finished = c.finish_reason == "stop"
            s = score(p.answer, c.text, finished)
            r = task_reward_value(s)
            group_r.append(r)
            fmt.append(s.format)
            correct.append(s.correct)
            lengths.append(len(c.token_ids))
        rewards += group_r
        spread += len(set(group_r)) > 1
    return {
        "task": task,
        "reward_mean": statistics.fmean(rewards),
        "format_rate": statistics.fmean(fmt),
        "correct_rate": statistics.fmean(correct),
        "groups_with_spread": spread / len(problems),
        "mean_tokens": statistics.fmean(lengths),
        "generate_s": seconds,
        "example": outs[0].outputs[0].text,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tasks", default=",".join(TASK_NAMES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    set_cpu_env(1.0)
    target = assets.resolve_model("smollm2-135m")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    llm = start_plain_engine(target, max_model_len=512, dtype=args.dtype, seed=args.seed)
    rows = [
        probe(llm, tok, t, args.prompts, args.group, args.max_new_tokens, args.seed)
        for t in args.tasks.split(",")
    ]
    OUT.mkdir(exist_ok=True)
    (OUT / "task_probe.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print("| task | reward | format | correct | groups with spread | tokens | generate s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['task']} | {r['reward_mean']:.3f} | {r['format_rate']:.3f} | {r['correct_rate']:.3f} "
            f"| {r['groups_with_spread']:.2f} | {r['mean_tokens']:.1f} | {r['generate_s']:.0f} |"
        )
    for r in rows:
        print(f"--- {r['task']}: {r['example']!r}")


if __name__ == "__main__":
    main()
