"""Which verifiable-reward task can SmolLM2-135M-Instruct learn? The initial policy's reward per task, sampled
as GRPO samples it (T = 1, chat template).

A task is learnable by GRPO when its initial reward is neither about 0 (no group has a positive advantage) nor
about 1 (nothing to learn), and when groups disagree (a group whose rewards are all equal gives no gradient):
the table reports the mean reward, the format and correctness rates, the share of groups with a non-zero
reward spread, and the mean response length.  Sampling is the KV-cached HF loop (the same distribution vLLM
samples; it stays usable on a shared CPU).

    python benchmarks/task_probe.py --prompts 16 --group 8 --max-new-tokens 64 --threads 1
    python benchmarks/task_probe.py --model checkpoints/smollm2-total-sft --tasks total --max-new-tokens 256 --name total-sft

``--model``: any policy folder (an SFT'd policy, a run's merged policy); ``--name`` writes ``task_probe_NAME.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from draft_align import assets
from draft_align.conventions import float_dtype
from draft_align.data import encode_prompt
from draft_align.data.tasks import TASK_NAMES, make_problems, score
from draft_align.hf.generate import generate_responses
from draft_align.monitor.evaluate import eos_ids
from draft_align.rl.rewards import task_reward_value

OUT = Path(__file__).resolve().parent / "out"


def probe(model, tok, task: str, prompts: int, group: int, max_new_tokens: int, seed: int) -> dict:
    problems = make_problems(task, prompts, seed=10_000 + seed)  # not a training pool's seed
    ids = [encode_prompt(tok, p.conversation()) for p in problems for _ in range(group)]
    eos = eos_ids(model, tok)
    t0 = time.perf_counter()
    outs = generate_responses(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        eos_ids=eos,
        pad_id=tok.pad_token_id if tok.pad_token_id is not None else min(eos),
        batch_size=64,
        seed=seed,
    )
    seconds = time.perf_counter() - t0
    rewards, fmt, correct, lengths, spread, texts = [], [], [], [], 0, []
    for j, p in enumerate(problems):
        group_r = []
        for r in outs[j * group : (j + 1) * group]:
            finished = r is not None and r.numel() > 0 and int(r[-1]) in eos
            text = tok.decode(r.tolist(), skip_special_tokens=True)
            s = score(p.answer, text, finished)
            group_r.append(task_reward_value(s))
            fmt.append(s.format)
            correct.append(s.correct)
            lengths.append(r.numel())
            texts.append(text)
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
        "examples": texts[:3],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tasks", default=",".join(TASK_NAMES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m", help="the policy: the embedded default or a folder")
    ap.add_argument("--name", default="", help="write task_probe_NAME.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = assets.load_target(args.model, float_dtype("float32"), "cpu")
    rows = [
        probe(model, tok, t, args.prompts, args.group, args.max_new_tokens, args.seed)
        for t in args.tasks.split(",")
    ]
    OUT.mkdir(exist_ok=True)
    (OUT / f"task_probe{'_' + args.name if args.name else ''}.json").write_text(
        json.dumps({"args": vars(args), "rows": rows}, indent=1)
    )
    print("| task | reward | format | correct | groups with spread | tokens | generate s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['task']} | {r['reward_mean']:.3f} | {r['format_rate']:.3f} | {r['correct_rate']:.3f} "
            f"| {r['groups_with_spread']:.2f} | {r['mean_tokens']:.1f} | {r['generate_s']:.0f} |"
        )
    for r in rows:
        print(f"--- {r['task']}: {r['examples']!r}")


if __name__ == "__main__":
    main()
