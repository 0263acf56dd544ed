"""TRL GRPO on SmolLM2-135M (CPU, a LoRA, a rule-based reward, prompts from the embedded ShareGPT) with
draft_align keeping the speculative-decoding draft aligned beside it.  The lines marked ``# draft_align`` are
all a working TRL script needs (docs/trl.md); ``--plain`` runs the same script without them (TRL generates
with transformers).

    python examples/trl_grpo.py --steps 5                   # the demo's warm-start runs first if not published
    python examples/trl_grpo.py --steps 5 rl.engine.kind=reference sidecar.publish.every_s=5
    python examples/trl_grpo.py --task task:add --steps 20  # the verifiable add task, reward 0.2·format + 0.8·correct
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from draft_align import assets, data
from draft_align.integrations.trl import DraftAlign  # draft_align
from draft_align.integrations.trl.reward_funcs import task_dataset, task_reward
from draft_align.rl.rewards import reward_fn


def sharegpt_prompts(tokenizer, n: int, max_tokens: int) -> Dataset:
    """The first user turns of ``n`` ShareGPT conversations whose chat-templated prompt fits ``max_tokens``."""
    train, _ = data.split_heldout(data.load_conversations("sharegpt", limit=4 * n + 64), 64, 0)
    rows = []
    for conv in train:
        msgs = [{"role": m.role, "content": m.content} for m in conv.prompt]
        # the chat-templated prompt's token count (apply_chat_template returns a BatchEncoding in transformers 5)
        if msgs and data.encode_prompt(tokenizer, conv).numel() <= max_tokens:
            rows.append({"prompt": msgs})
        if len(rows) == n:
            break
    return Dataset.from_list(rows)


def uppercase_reward(completions, **_):
    score = reward_fn("uppercase")
    return [score(c[0]["content"] if isinstance(c, list) else c, True) for c in completions]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--recipe", default="recipes/trl_smollm2.yaml")
    ap.add_argument("--output-dir", default="checkpoints/smollm2-trl-grpo")
    ap.add_argument("--plain", action="store_true", help="TRL alone, without draft_align")
    ap.add_argument(
        "--task", default=None, help="a verifiable task source (task:add): its problems and reward"
    )
    ap.add_argument("--batch", type=int, default=4, help="completions per step (per_device_train_batch_size)")
    ap.add_argument("--completion-tokens", type=int, default=32, help="max_completion_length")
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument(
        "--beta",
        type=float,
        default=0.0,
        help="TRL's KL coefficient (> 0: TRL logs the KL to the initial policy as `kl`)",
    )
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the draft_align recipe")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16
    torch.set_num_threads(1)  # a shared 2-core CPU: the sidecar gets the other core

    model = str(assets.fetch_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model)
    args = GRPOConfig(
        output_dir=a.output_dir,
        max_steps=a.steps,
        per_device_train_batch_size=a.batch,
        num_generations=4,
        max_completion_length=a.completion_tokens,
        learning_rate=a.learning_rate,
        beta=a.beta,
        temperature=1.0,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
        seed=0,
    )
    da = None if a.plain else DraftAlign(a.recipe, a.overrides)  # draft_align
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=uppercase_reward if a.task is None else task_reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=sharegpt_prompts(tokenizer, a.prompts, 160)
        if a.task is None
        else Dataset.from_list(task_dataset(a.task, a.prompts)),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        rollout_func=None if da is None else da.rollout_func,  # draft_align
    )
    if da is not None:
        trainer.add_callback(da.callback(trainer))  # draft_align
    trainer.train()
    return {"log_history": trainer.state.log_history, "run_dir": None if da is None else str(da.run_dir)}


if __name__ == "__main__":
    main()
