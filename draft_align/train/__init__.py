"""Draft training: TTT losses, batches of captured target states, the trainer."""
