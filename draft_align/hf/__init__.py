"""HF transformers model introspection and generation, shared by the policy side and the loops.

- ``parts.py``: the parts of an HF causal LM every side needs by name (Llama/Qwen/Mistral layout);
- ``capture.py``: forward-hook capture of what a draft needs from the target's own forward pass;
- ``generate.py``: batched response generation by the target itself;
- ``lora_layers.py``: decoder layers that carry peft LoRA modules, merged per tensor.
"""
