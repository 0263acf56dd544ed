"""Device run, one GPU (sized for one H200, at most 8 minutes); NOT YET RUN ON A GPU: verl 0.9 GRPO on a small
model with EAGLE-3 speculative rollouts in verl's vLLM servers, draft_align beside it (the Tap on the actor's
old-log-prob pass, the sidecar as a Ray actor, verified drafts loaded into the servers in place), acceptance
measured by verl's own spec-decode counters, the draft kept through every hybrid sleep and wake-up.

Needs on the machine (it reaches nothing outside): ``pip install 'verl[vllm]==0.9.1'`` and this checkout
(``pip install -e .`` without the ``vllm`` extra: verl pins its own vLLM), a local HF model (``--model``, e.g.
SmolLM2-135M-Instruct) and an EAGLE-3 draft for it published by draft_align (``--draft``, e.g. the folder
``draft-align warmstart recipes/smollm2_task_warmstart.yaml`` writes).

    python benchmarks/device/verl_grpo_eagle3.py --model PATH --draft PATH [--out /tmp/verl_grpo_eagle3] [--steps 6]

Writes the task data (sums of two numbers, docs/tasks.md's ``add`` task), the reward function and the
co-training recipe under ``--out``, runs verl's TransferQueue trainer as ``draft_align_sync``
(:func:`draft_align.integrations.verl.worker.register_trainer_mode`) with draft_align's rollout servers, and
prints one JSON line: per step verl's spec-decode acceptance (``rollout/spec_accept_length``) and draft_align's metrics (draft version served,
sidecar status), and the sidecar's final status.  Exit code 1 when verl failed or no step logged acceptance.

Sleep: verl's hybrid default sleeps its servers at level 2 between rollouts, which discards an EAGLE-3 draft
(verl's weight sync restores only the target); draft_align's server sleeps at level 1 (weights, the draft's
included, kept in host memory) and the start-up checks refuse level 2.  What this run shows is the draft
surviving a sleep and wake-up every step: acceptance after step 1 does not collapse.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REWARD = '''
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last integer of the answer is the sum, else 0."""
    found = re.findall(r"-?\\d+", solution_str or "")
    return 1.0 if found and found[-1] == str(ground_truth) else 0.0
'''


def write_data(out: Path, n: int, seed: int) -> tuple[Path, Path]:
    import pandas as pd

    rng = random.Random(seed)

    def rows(k: int) -> list[dict]:
        out_rows = []
        for i in range(k):
            a, b = rng.randrange(10, 1000), rng.randrange(10, 1000)
            out_rows.append(
                {
                    "data_source": "add",
                    "prompt": [
                        {"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}
                    ],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                    "extra_info": {"index": i},
                }
            )
        return out_rows

    train, val = out / "train.parquet", out / "val.parquet"
    pd.DataFrame(rows(n)).to_parquet(train)
    pd.DataFrame(rows(16)).to_parquet(val)
    return train, val


def write_recipe(out: Path, model: str, draft: str) -> Path:
    recipe = out / "draft_align.yaml"
    recipe.write_text(
        "\n".join(
            [
                "kind: cotrain",
                "run: verl-grpo-eagle3",
                f"output_dir: {out / 'runs'}",
                "target:",
                f"  model: {model}",
                f"draft: {draft}",
                "tap:",
                "  tokens_per_step: 8192",
                "sidecar:",
                "  host: ray",
                "  buffer: {tokens: 60000, min_tokens: 1024}",
                "  train: {batch_tokens: 2048}",
                "  publish: {min_train_steps: 2, every_s: 20}",
                "wire:",
                f"  key_file: {out / 'wire.key'}",
                "  allow_remote: true",  # the sidecar binds its node's address (Ray's), not 127.0.0.1
                "ray:",
                "  num_cpus: 4",
                "  num_gpus: 0",  # verl's pool holds the one GPU; the sidecar trains the small draft on CPU
                "logging: {wandb: false}",
                "",
            ]
        )
    )
    return recipe


def verl_config(args: argparse.Namespace, out: Path, train: Path, val: Path, recipe: Path, reward: Path):
    import verl
    from hydra import compose, initialize_config_dir

    spec = f"{{method:eagle3,model:'{args.draft}',num_speculative_tokens:{args.k}}}"
    overrides = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.train_batch_size=16",
        "data.max_prompt_length=64",
        "data.max_response_length=64",
        f"actor_rollout_ref.model.path={args.model}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.35",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config={spec}",
        f"+actor_rollout_ref.draft_align.recipe={recipe}",
        "+actor_rollout_ref.draft_align.sleep_level=1",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.v1.trainer_mode=draft_align_sync",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        "trainer.project_name=draft_align",
        "trainer.experiment_name=verl_grpo_eagle3",
    ]
    with initialize_config_dir(str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", default="/tmp/verl_grpo_eagle3")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=256)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["VERL_FILE_LOGGER_PATH"] = str(out / "metrics.jsonl")
    train, val = write_data(out, args.prompts, seed=0)
    reward = out / "reward.py"
    reward.write_text(REWARD)
    recipe = write_recipe(out, args.model, args.draft)
    config = verl_config(args, out, train, val, recipe, reward)

    import ray
    from verl.trainer import main_ppo

    class Runner(main_ppo.TaskRunnerV1.__ray_actor_class__):
        def run(self, config):
            from draft_align.integrations.verl.worker import register_trainer_mode

            register_trainer_mode("sync")  # in the TaskRunner's process, where verl looks trainers up
            return super().run(config)

    t0 = time.monotonic()
    error = None
    try:
        main_ppo.run_ppo(config, task_runner_class=ray.remote(num_cpus=1)(Runner))
    except Exception as e:  # reported in the JSON line
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - t0
    steps = []
    if (out / "metrics.jsonl").exists():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            data = row.get("data", row)
            keep = {
                k: v
                for k, v in data.items()
                if k.startswith(("rollout/spec_", "draft_align/", "critic/score"))
            }
            steps.append({"step": row.get("step"), **keep})
    acceptance = [s for s in steps if any(k.startswith("rollout/spec_") for k in s)]
    print(json.dumps({"seconds": round(seconds, 1), "error": error, "steps": steps}))
    return 0 if error is None and acceptance else 1


if __name__ == "__main__":
    sys.exit(main())
