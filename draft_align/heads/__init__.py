"""Draft heads: pure math, no I/O (docs/formats.md).

- ``draft_head.py``: :class:`DraftHead`, the interface every head implements, what every head's configuration
  raises and reads with (:class:`DraftConfigError`, ``config_from_dict``), and the code the heads share
  (``DraftModule``; ``SharedHeadDraft``, ``SharedHeadConfig``: a head on the target's own lm_head);
- ``layers.py``: the Llama decoder-block pieces both heads are built from (RMSNorm, RoPE, attention, MLP);
- ``eagle3.py``: the EAGLE-3 head (vLLM's and SGLang's ``LlamaForCausalLMEagle3``), its TTT unroll and KV-cached step;
- ``mtp.py``: the multi-token-prediction head (DeepSeek-V3 and Qwen3-Next layouts);
- ``native_mtp.py``: a model's own MTP layers (MiMo, GLM-4.5, DeepSeek-V3) built from its config with transformers' decoder
  layer, loaded from and written back to the checkpoint's MTP tensors (docs/mtp.md);
- ``megatron_mtp.py``: the same native MTP head with megatron-core's own ``MultiTokenPredictionLayer`` as each
  depth, its tensors mapped megatron ↔ the family's HF names (``draft.mtp_impl: megatron``; docs/mtp.md);
- ``lora.py``: LoRA adapters over a frozen head, merging, the adapter tensors;
- ``vocab.py``: the draft vocabulary (d2t/t2d) and its selection.
"""
