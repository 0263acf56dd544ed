"""draft_align: keep speculative-decoding draft heads aligned with a policy under RL.

Data flows one way (docs/architecture.md): policy process (``tap/``) → ``wire/`` → ``sidecar/`` → ``train/`` →
``publish/`` → ``engines/``; ``monitor/`` reads and never writes back.

- ``conventions.py``: names every side shares (verify modes, loss kinds, tap budgets), each defined once;
- ``storage.py``: tensor files on disk, I/O errors as ``OSError``;
- ``acceptance.py``: the acceptance math of chain speculative decoding, which engines, the RL job, the sidecar and
  monitoring all count and average with;
- ``assets/``: the embedded defaults (model and data from pinned PyPI wheels) and name resolution;
- ``config/``: the typed recipe schemas;
- ``data/``: chat data: loading, the held-out split, encoding;
- ``hf/``: HF transformers introspection, forward-hook capture, generation, merged LoRA layers;
- ``heads/``: the draft heads (EAGLE-3, MTP) behind one ``DraftHead`` interface, their shared layers, LoRA and the
  vocabulary map;
- ``tap/``: the policy side: what an RL job runs to ship a sample of its forward passes;
- ``wire/``: the messages, their bytes and HMAC, and the ZeroMQ channels;
- ``train/``: TTT losses, the trainer, the replay buffer, checkpoints, multi-rank training;
- ``publish/``: versioned draft folders the engines load;
- ``monitor/``: acceptance estimates, monitoring rows and sinks, reports and advice;
- ``engines/``: rollout engines that serve published drafts (vLLM, in process or servers over HTTP) and the lossless
  reference decoder;
- ``push/``: ``draft-align push``, keeping a fleet of vLLM servers on the newest draft;
- ``sidecar/``: the co-training sidecar;
- ``warmstart/``: offline warm-start of a draft from chat data;
- ``rl/``: a small GRPO job that drives policy drift;
- ``integrations/``: adapters for other RL frameworks (TRL);
- ``cli/``, ``cotrain.py``: the ``draft-align`` command line and the co-training launcher (RL job + sidecar).
"""

__version__ = "0.1.0"
