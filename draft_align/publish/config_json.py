"""config.json fields both draft formats write for their Llama decoder block, in HF's names; the RoPE the block
must share with its target (:func:`check_rope`, run on export)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draft_align.heads.layers import target_rope
from draft_align.publish.folder import CONFIG_FILE, CorruptCheckpointError, ExportError


def rope_fields(rope: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta (transformers 4 and engines), rope_scaling when not default, rope_parameters (transformers 5)."""
    if "rope_theta" not in rope:
        raise ExportError(f"rope_parameters {dict(rope)} has no rope_theta")
    out: dict[str, Any] = {"rope_theta": float(rope["rope_theta"])}
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_parameters"] = dict(rope)
    return out


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def rope_mismatch(draft_rope: Mapping[str, Any], target_config: Any) -> list[str]:
    """The RoPE keys whose values differ between a draft's ``rope_parameters`` and the target's (None
    values count as absent; numbers compare to 1e-9 relative)."""
    d = {k: v for k, v in draft_rope.items() if v is not None}
    t = {k: v for k, v in target_rope(target_config).items() if v is not None}
    return sorted(k for k in set(d) | set(t) if k not in d or k not in t or not _same_value(d[k], t[k]))


def check_rope(draft_rope: Mapping[str, Any], target_config: Any) -> None:
    """Raise ExportError naming the differing keys unless the draft's RoPE equals the target's."""
    diff = rope_mismatch(draft_rope, target_config)
    if diff:
        raise ExportError(
            f"rope mismatch in {diff}: draft {dict(draft_rope)} vs target {target_rope(target_config)}"
        )


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


#: the block fields whose value follows from the weights' shapes (through the head config they were checked
#: against): an engine that read another value would build another model around the same tensors
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)


def config_json_mismatch(config: Any, cfg: Any, extra: dict[str, Any]) -> str | None:
    """Why a folder's parsed config.json does not describe the head config ``cfg`` (an Eagle3Config or
    MTPConfig already checked against the weights), or None.  Compared: :data:`SHAPE_FIELDS` of the Llama block
    (top level, or ``transformer_layer_config`` in the speculators dialect) and ``extra`` (top-level keys the
    format writes, e.g. ``draft_vocab_size``)."""
    if not isinstance(config, dict):
        return f"not a JSON object ({type(config).__name__})"
    block = config.get("transformer_layer_config", config)
    if not isinstance(block, dict):
        return "transformer_layer_config is not an object"
    want = {k: getattr(cfg, k) for k in SHAPE_FIELDS}
    for where, wanted in ((block, want), (config, extra)):
        for key, value in wanted.items():
            got = where.get(key)
            if type(got) is not int or got != int(value):
                return f"{key} is {str(got)[:40]}, the weights say {value}"
    return None


def check_config_json(path: Path, cfg: Any, extra: dict[str, Any]) -> None:
    """CorruptCheckpointError (one line) unless the folder's config.json, what the engines build the draft
    from, describes the weights being loaded (:func:`config_json_mismatch`): a config.json edited to another
    vocabulary or hidden size and re-hashed into the manifest is refused here, not served."""
    cpath = Path(path) / CONFIG_FILE
    try:
        config = json.loads(cpath.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{cpath}: unreadable ({' '.join(str(e).split())})") from e
    why = config_json_mismatch(config, cfg, extra)
    if why is not None:
        raise CorruptCheckpointError(
            f"{cpath}: {why}: it no longer describes this draft (edited after export?); restore it or export "
            "the draft again"
        )
