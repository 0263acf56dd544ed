"""The policy side: what an RL job runs to ship a sample of its own forward passes to the sidecar (the Tap).

``protocol`` (PolicyTap, TapSink), ``base`` (what both Taps share: their options and checks, capture, header,
``end_step``, HeadSync, stats), ``budget`` (which sequences a step keeps), ``shipping`` (what both framework
adapters share), ``logit_stats`` (the per-token policy statistics shipped beside the states),
``hf`` (HF transformers, on ``hf/capture.py``'s hooks), ``megatron_hooks`` + ``megatron`` (megatron-core).
"""
