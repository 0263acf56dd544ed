"""A small but real GRPO job (LoRA policy, rule-based reward) that drives policy drift for co-training.

- ``grpo.py``: the job: rollouts, rewards, update, monitoring, one step at a time;
- ``policy.py``: the LoRA policy, versioned, savable, KL to the initial policy;
- ``loss.py``: the GRPO objective (group-normalised advantages, clipped surrogate, k3 KL);
- ``prompts.py``: the RL prompts and the fixed KL sequences;
- ``rewards.py``: rule-based style rewards and the verifiable task reward;
- ``rollouts.py``: :class:`RolloutEngine`, the step's plan, and the reference engine;
- ``drafts.py``: :class:`DraftSource`, the frozen draft and the newest published one;
- ``draft_guard.py``: :class:`CounterGuard`, the silent-zero guard on a step's own rollout counters;
- ``build.py``: the RL side built from a recipe, each piece in one place (the Tap and its sender, the draft
  source, the rollout engine), as ``sidecar/build.py`` builds the sidecar.
"""
