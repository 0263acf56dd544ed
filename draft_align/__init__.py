"""draft_align: keep speculative-decoding draft heads aligned with a policy under RL."""

__version__ = "0.1.0"
