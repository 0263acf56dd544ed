"""verl configurations draft_align cannot serve, refused before training starts with one line each.

Read from verl's trainer config (an OmegaConf ``DictConfig`` or a plain dict, keys as in verl 0.9's
``ppo_trainer.yaml``); :func:`check_verl_config` is what :class:`~draft_align.integrations.verl.driver.VerlDraftAlign`
runs at start.  Refused:

- a rollout backend without EAGLE-3 speculative decoding (``actor_rollout_ref.rollout.name`` other than
  ``vllm``; SGLang until draft_align's hot refresh supports it), or vLLM without an ``eagle3``
  ``speculative_config`` in ``actor_rollout_ref.rollout.engine_kwargs.vllm``;
- ``lm_head`` among the LoRA target modules (the Tap ships the base head rows; an adapted head would not be
  the head the policy samples from);
- level-2 sleep (verl's hybrid default: it discards the draft's weights and verl's weight sync reloads only the
  target) unless the draft survives it: ``free_cache_engine: false`` (no sleep), a LoRA adapter or MTP rollout
  (verl then sleeps at level 1), or draft_align's rollout server (``draft_align.sleep_level: 1``,
  :mod:`~draft_align.integrations.verl.server`);
- what the Tap cannot follow yet: an actor strategy other than ``fsdp2`` (FSDP1's flat parameters hide the
  head; Megatron's ``thd`` path), Ulysses sequence parallelism.
"""

from __future__ import annotations

import json
from typing import Any

_MISSING = object()


class VerlConfigError(ValueError):
    """A verl configuration draft_align cannot serve (the message names the key and a way out)."""


def select(config: Any, key: str, default: Any = None) -> Any:
    """``config``'s value at the dotted ``key`` (None/absent → ``default``), for DictConfig and dict alike."""
    node = config
    for part in key.split("."):
        if node is None:
            return default
        try:
            node = node.get(part, _MISSING) if hasattr(node, "get") else getattr(node, part, _MISSING)
        except Exception:  # a struct DictConfig without the key
            return default
        if node is _MISSING:
            return default
    return default if node is None else node


def speculative_config(config: Any) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` as verl passes it (``actor_rollout_ref.rollout.engine_kwargs.vllm``;
    a dict, or the JSON string vLLM's CLI takes)."""
    spec = select(config, "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config")
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise VerlConfigError(
                f"actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config is not JSON: {e}"
            ) from e
    return {str(k): v for k, v in dict(spec).items()}


def lora_as_adapter(config: Any) -> bool:
    """verl's rule: LoRA served as an adapter (not merged) makes the rollout sleep at level 1."""
    rank = int(select(config, "actor_rollout_ref.model.lora_rank", 0) or 0)
    rank2 = int(select(config, "actor_rollout_ref.model.lora.rank", 0) or 0)
    return (rank > 0 or rank2 > 0) and not bool(select(config, "actor_rollout_ref.model.lora.merge", False))


def sleep_level(config: Any) -> int:
    """The sleep level verl's ``vLLMHttpServer._resolve_sleep_level`` picks in hybrid mode (0: no sleep), or
    1 where draft_align's server keeps the draft (``draft_align.sleep_level: 1``)."""
    if not bool(select(config, "actor_rollout_ref.hybrid_engine", True)):
        return 0
    if not bool(select(config, "actor_rollout_ref.rollout.free_cache_engine", True)):
        return 0
    mtp = bool(select(config, "actor_rollout_ref.model.mtp.enable", False)) and bool(
        select(config, "actor_rollout_ref.model.mtp.enable_rollout", False)
    )
    if mtp or lora_as_adapter(config):
        return 1
    if int(select(config, "actor_rollout_ref.draft_align.sleep_level", 2) or 2) == 1:
        return 1
    return 2


def _targets(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def check_verl_config(config: Any) -> None:
    """Raise :class:`VerlConfigError` (one line) for the first configuration the module docstring refuses."""
    name = select(config, "actor_rollout_ref.rollout.name")
    if name == "sglang":
        raise VerlConfigError(
            "actor_rollout_ref.rollout.name=sglang: draft_align refreshes drafts in vLLM servers only so far; "
            "use rollout.name=vllm"
        )
    if name != "vllm":
        raise VerlConfigError(
            f"actor_rollout_ref.rollout.name={name}: that rollout backend runs no EAGLE-3 speculative decoding; "
            "use rollout.name=vllm"
        )
    spec = speculative_config(config)
    if spec is None or str(spec.get("method", "")).lower() != "eagle3":
        method = None if spec is None else spec.get("method")
        raise VerlConfigError(
            f"actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config has method={method}: draft_align "
            "serves EAGLE-3 drafts; set {method: eagle3, model: <the starting draft folder>, "
            "num_speculative_tokens: k}"
        )
    lora = any(
        int(select(config, k, 0) or 0) > 0
        for k in ("actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora.rank")
    )
    for key in ("actor_rollout_ref.model.target_modules", "actor_rollout_ref.model.lora.target_modules"):
        if lora and "lm_head" in _targets(select(config, key)):
            raise VerlConfigError(
                f"{key} includes lm_head: the Tap ships the base lm_head rows, not an adapted head; "
                "remove lm_head from the LoRA target modules"
            )
    if sleep_level(config) == 2:
        raise VerlConfigError(
            "level-2 sleep (hybrid engine with free_cache_engine) discards the EAGLE-3 draft and verl's weight "
            "sync reloads only the target: set +actor_rollout_ref.draft_align.sleep_level=1 with draft_align's "
            "rollout server (docs/verl.md), or actor_rollout_ref.rollout.free_cache_engine=False"
        )
    strategy = select(config, "actor_rollout_ref.actor.strategy", "fsdp")
    if strategy != "fsdp2":
        raise VerlConfigError(
            f"actor_rollout_ref.actor.strategy={strategy}: the verl Tap follows FSDP2 actors only so far "
            "(FSDP1's flat parameters hide the lm_head; Megatron's thd path is not mapped yet); use strategy=fsdp2"
        )
    sp = int(select(config, "actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1) or 1)
    if sp > 1:
        raise VerlConfigError(
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}: the verl Tap does not gather Ulysses "
            "slices yet; set it to 1"
        )
