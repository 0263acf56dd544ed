"""TRL configurations draft_align cannot follow, refused at start with one clear line each (never a silent
0 % acceptance later)."""

from __future__ import annotations

from typing import Any

from draft_align.config import RLTaskConfig


class TRLConfigError(ValueError):
    """A TRL configuration draft_align cannot work beside."""


def check_trainer(trainer: Any, task: RLTaskConfig, *, uses_rollout_func: bool) -> None:
    """Raise TRLConfigError for what cannot work (see docs/trl.md, "What is refused at start"); ``task``: the
    recipe's ``rl.task`` (its rollout temperature)."""
    from draft_align.hf.parts import decoder_parts
    from draft_align.integrations.trl.tap import policy_model

    args = trainer.args
    model = policy_model(trainer)
    _, _, _, lm_head = decoder_parts(model)
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer

        if isinstance(lm_head, BaseTunerLayer):
            raise TRLConfigError(
                "lm_head is in the policy's LoRA (peft target_modules): HeadSync ships lm_head.weight, which would "
                "miss the adapter, and the engine sync reloads decoder layers only; drop lm_head from target_modules"
            )
    except ImportError:
        pass
    cfg = model.config.get_text_config()
    # optional config fields, absent on most architectures (TRL's fused head reads the same ones)
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        raise TRLConfigError(
            f"{type(model).__name__} soft-caps its logits: the Tap's statistics from final state × "
            "lm_head would not be the policy's; this architecture is not supported"
        )
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        value = getattr(cfg, name, None)
        if value is not None and float(value) != 1.0:
            raise TRLConfigError(
                f"{type(model).__name__} has {name}={value}: the Tap's statistics from final "
                "state × lm_head would not be the policy's; this architecture is not supported"
            )
    if trainer.use_vllm and args.vllm_enable_sleep_mode:
        raise TRLConfigError(
            "vllm_enable_sleep_mode=True: TRL's level-2 sleep discards the engine's weights and re-pushes only the "
            "policy's, which silently wipes the EAGLE-3 draft (0 % acceptance); draft_align does not restore it: "
            "set vllm_enable_sleep_mode=False"
        )
    pc = args.parallelism_config
    if pc is not None and (pc.cp_enabled or pc.sp_enabled):
        raise TRLConfigError(
            "context/sequence parallelism shards each sequence across ranks: the Tap needs whole "
            "sequences on one rank; run without cp/sp"
        )
    if args.steps_per_generation % args.gradient_accumulation_steps and (
        args.gradient_accumulation_steps % args.steps_per_generation
    ):
        raise TRLConfigError(
            f"steps_per_generation={args.steps_per_generation} and gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}: neither divides the other, so a generation batch straddles "
            "optimizer steps at an offset and the Tap's per-step sample cannot follow it"
        )
    if not abs(float(trainer.temperature) - float(task.temperature)) <= 1e-9:  # NaN is unequal too
        raise TRLConfigError(
            f"TRL samples at temperature {trainer.temperature} but the recipe's rl.task.temperature is "
            f"{task.temperature}: the sidecar's soft targets and gate use the recipe's; make them equal"
        )
    if uses_rollout_func:
        defaults = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}
        odd = {
            k: getattr(args, k)
            for k, v in defaults.items()
            if getattr(args, k) not in (v, 0.0 if v is None else v)
        }
        if odd or args.generation_kwargs:
            raise TRLConfigError(
                f"draft_align's rollout_func samples plain temperature sampling; TRL asks for {odd or ''}"
                f"{args.generation_kwargs or ''}: leave top_p/top_k/min_p/repetition_penalty/generation_kwargs "
                "at their defaults"
            )
        if trainer.tools or trainer.environment_factories is not None:
            raise TRLConfigError(
                "tools/environments run TRL's own multi-turn loop, which a rollout_func replaces"
            )
