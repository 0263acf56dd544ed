"""HF transformers model introspection and generation, shared by the policy side and the loops."""
