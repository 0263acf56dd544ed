"""config.json fields both draft formats write for their Llama decoder block, in HF's names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from draft_align.publish.folder import ExportError


def rope_fields(rope: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta (transformers 4 and engines), rope_scaling when not default, rope_parameters (transformers 5)."""
    if "rope_theta" not in rope:
        raise ExportError(f"rope_parameters {dict(rope)} has no rope_theta")
    out: dict[str, Any] = {"rope_theta": float(rope["rope_theta"])}
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_parameters"] = dict(rope)
    return out


def block_config_fields(cfg: Any) -> dict[str, Any]:
    """config.json's shape fields of a Llama decoder block (Eagle3Config or MTPConfig), in HF's names."""
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_fields(cfg.rope_parameters),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
    }


def special_token_ids(target_config: Any) -> dict[str, Any]:
    """The target's bos/eos token ids that it sets (config.json copies them)."""
    return {
        key: value
        for key in ("bos_token_id", "eos_token_id")
        if (value := getattr(target_config, key, None)) is not None
    }
