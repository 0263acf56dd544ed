"""A small but real GRPO job (LoRA policy, rule-based reward) that drives policy drift for co-training."""
