"""A real TRL GRPOTrainer on the tiny target (tests/conftest.py), with a fixed rollout_func so the sequences
are known: completions of different lengths (right padding) after prompts of different lengths (left
padding)."""

from __future__ import annotations

import random

import pytest

trl = pytest.importorskip("trl")

COMPLETION_LENGTHS = (5, 2, 7, 3)


def fixed_rollouts(tokenizer, seed: int = 0):
    """A rollout_func whose completions are seeded random tokens (ids 3..V−1) of COMPLETION_LENGTHS."""
    rng = random.Random(seed)

    def rollout_func(prompts, trainer):
        ids = trainer._tokenize_prompts(prompts)[0]
        comps = [
            [rng.randrange(3, len(tokenizer)) for _ in range(COMPLETION_LENGTHS[i % len(COMPLETION_LENGTHS)])]
            for i in range(len(prompts))
        ]
        return {
            "prompt_ids": [list(p) for p in ids],
            "completion_ids": comps,
            "logprobs": [[0.0] * len(c) for c in comps],
        }

    return rollout_func


@pytest.fixture
def make_trainer(tiny_world, tmp_path):
    """Factory: ``make_trainer(**grpo_config)`` → a GRPOTrainer on the tiny target with a LoRA whose B is not 0."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    def build(rollout_func=None, lora_targets=("q_proj", "v_proj"), **over):
        tok = AutoTokenizer.from_pretrained(tiny_world.model)
        prompts = ["hello there", "a much longer prompt than that", "hi", "what is up today"] * 4
        kw = dict(
            output_dir=str(tmp_path / "trl"),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=8,
            max_steps=1,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            seed=0,
            temperature=1.0,
            dataloader_num_workers=0,
        )
        kw.update(over)
        trainer = GRPOTrainer(
            model=str(tiny_world.model),
            reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
            args=GRPOConfig(**kw),
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tok,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=list(lora_targets)),
            rollout_func=rollout_func or fixed_rollouts(tok),
        )
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)  # a LoRA policy that differs from the base model
        return trainer

    return build
