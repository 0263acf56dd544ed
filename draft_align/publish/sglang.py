"""SGLang's EAGLE-3 loader rules, checked against a published draft folder without SGLang installed.

SGLang drops unknown tensor names silently, reads aux ids only from ``eagle_config`` (adding one to each)
and shares the target's embedding only when hidden sizes agree, so a folder vLLM runs can still load wrong.
The rules, and the SGLang source each was read from: docs/engines.md, "SGLang loader rules: where they
come from".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch

from draft_align.conventions import default_aux_layer_ids
from draft_align.heads.eagle3 import ARCHITECTURE, ENGINE_NUM_AUX
from draft_align.heads.eagle3 import expected_shapes as eagle3_expected_shapes
from draft_align.publish.config_json import SHAPE_FIELDS
from draft_align.publish.folder import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE

# ARCHITECTURE is the only EAGLE-3 class SGLang registers for the HF layout
NUM_AUX = ENGINE_NUM_AUX  # fc = Linear(3 · target_hidden_size, hidden_size)
_FLOAT_DTYPES = {"BF16", "F16", "F32"}
# what SGLang sizes the draft from: the Llama block's shape fields and EAGLE-3's two
_INT_FIELDS = (*SHAPE_FIELDS, "draft_vocab_size", "target_hidden_size")


def sglang_default_capture(num_layers: int) -> list[int]:
    """HF ``hidden_states`` indices SGLang captures when the draft's config names no aux ids."""
    return list(default_aux_layer_ids(num_layers))


def sglang_capture(sglang_ids: Sequence[int]) -> list[int]:
    """HF ``hidden_states`` indices SGLang captures for explicit ``eagle_config`` ids (it adds one)."""
    return [int(j) + 1 for j in sglang_ids]


@dataclass(frozen=True)
class ConfigShape:
    """The :class:`heads.eagle3.Eagle3Shape` a config.json describes, as SGLang sizes it: fc reads
    ``3 · target_hidden_size`` (``target_hidden_size`` defaults to ``hidden_size``)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    fc_in_features: int
    draft_vocab_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ConfigShape:
        h = int(config["hidden_size"])
        return cls(
            hidden_size=h,
            intermediate_size=int(config["intermediate_size"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=int(config["num_key_value_heads"]),
            head_dim=int(config["head_dim"]),
            fc_in_features=NUM_AUX * int(config.get("target_hidden_size", h)),
            draft_vocab_size=int(config["draft_vocab_size"]),
            vocab_size=int(config["vocab_size"]),
        )


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors SGLang's ``LlamaForCausalLMEagle3`` fills, in our (unfused, unprefixed) names; SGLang
    fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` on load."""
    return eagle3_expected_shapes(ConfigShape.from_config(config))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_config(c: Mapping[str, Any]) -> list[str]:
    p: list[str] = []
    arch = c.get("architectures")
    if arch != [ARCHITECTURE]:
        hint = (
            " (speculators dialect: SGLang has no loader for it; export --dialect hf)"
            if ("speculators_model_type" in c)
            else ""
        )
        p.append(f"config.architectures is {arch!r}, SGLang needs [{ARCHITECTURE!r}]{hint}")
    if c.get("model_type") != "llama":
        p.append(
            f"config.model_type is {c.get('model_type')!r}, expected 'llama' (llama4_text reads other fields)"
        )
    if c.get("num_hidden_layers") != 1:
        p.append(
            f"config.num_hidden_layers is {c.get('num_hidden_layers')!r}: SGLang older than the multi-layer "
            f"loader refuses != 1, newer names later layers additional_layers.* (not what vLLM reads); keep 1"
        )
    for key in _INT_FIELDS:
        v = c.get(key)
        if key == "draft_vocab_size" and v is None:
            p.append(
                "config.draft_vocab_size is missing or null: SGLang then takes the target's full lm_head "
                "and ignores ours (and d2t)"
            )
        elif key == "target_hidden_size" and key not in c:
            p.append("config.target_hidden_size is missing: SGLang sizes fc from hidden_size instead")
        elif not _is_int(v) or v <= 0:
            p.append(f"config.{key} is {v!r}, expected a positive int")
    if c.get("hidden_act") != "silu":
        p.append(f"config.hidden_act is {c.get('hidden_act')!r}, expected 'silu'")
    eps = c.get("rms_norm_eps")
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not eps > 0:
        p.append(f"config.rms_norm_eps is {eps!r}, expected a positive number")
    theta = c.get("rope_theta")
    rp_theta = (
        (c.get("rope_parameters") or {}).get("rope_theta")
        if isinstance(c.get("rope_parameters"), dict)
        else None
    )
    if theta is None and rp_theta is None:
        p.append("config has no rope_theta (nor rope_parameters.rope_theta): SGLang silently uses 10000")
    elif theta is not None and rp_theta is not None and not math.isclose(float(theta), float(rp_theta)):
        p.append(f"config.rope_theta {theta} disagrees with rope_parameters.rope_theta {rp_theta}")
    if c.get("tie_word_embeddings") is True:
        p.append("config.tie_word_embeddings is true: SGLang then uses the embedding as lm_head, not ours")
    if c.get("bias") is True or c.get("attention_bias") is True:
        p.append(
            "config sets bias/attention_bias: SGLang then expects fc/attention biases the draft does not have"
        )
    if c.get("norm_before_residual") is True:
        p.append("config.norm_before_residual is true: SGLang's EAGLE-3 layer only implements false")
    ok = all(_is_int(c.get(k)) and c.get(k) > 0 for k in ("hidden_size", "target_hidden_size"))
    if ok and c["hidden_size"] != c["target_hidden_size"]:
        p.append(
            f"hidden_size {c['hidden_size']} != target_hidden_size {c['target_hidden_size']}: SGLang "
            f"(llama.py set_embed) then does not share the target's embedding and the draft embeds tokens "
            f"with uninitialised weights"
        )
    heads, kv = c.get("num_attention_heads"), c.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv) and kv > 0 and heads % kv:
        p.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return p


def _aux_ids(c: Mapping[str, Any]) -> tuple[list[int] | None, list[str]]:
    """The ``eagle_config`` ids SGLang will read (None: its default) and problems with how they are written."""
    p: list[str] = []
    ec = c.get("eagle_config")
    top = c.get("eagle_aux_hidden_state_layer_ids")
    if ec is None:
        if top is not None:
            p.append(
                "config has top-level eagle_aux_hidden_state_layer_ids but no eagle_config: SGLang never "
                "reads the top-level key and captures its default layers instead"
            )
        return None, p
    if not isinstance(ec, dict):
        p.append(
            f"config.eagle_config is {type(ec).__name__}, expected an object (SGLang falls back to defaults)"
        )
        return None, p
    if ec.get("use_aux_hidden_state", True) is not True:
        p.append("config.eagle_config.use_aux_hidden_state is not true: SGLang would feed no aux states")
    ids = ec.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if top is not None:
            p.append("eagle_config lacks eagle_aux_hidden_state_layer_ids while the top level has them")
        return None, p
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
        p.append(f"eagle_config.eagle_aux_hidden_state_layer_ids is {ids!r}, expected a list of ints")
        return None, p
    if len(ids) != NUM_AUX:
        p.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {ids}: SGLang's fc reads exactly {NUM_AUX}")
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        p.append(
            f"eagle_config.eagle_aux_hidden_state_layer_ids {ids} must be distinct and ascending (SGLang "
            f"captures each layer once, in layer order)"
        )
    if top is not None and (not isinstance(top, list) or [int(i) - 1 for i in top] != ids):
        p.append(
            f"aux ids disagree: top-level (vLLM, HF indices) {top} vs eagle_config (SGLang, HF index − 1) {ids}; "
            f"expected eagle_config == [k - 1 for k in top-level]"
        )
    return list(ids), p


def _check_capture(
    sglang_ids: list[int] | None, trained: list[int] | None, num_layers: int | None
) -> list[str]:
    """What SGLang captures vs what the draft was trained on (both HF ``hidden_states`` indices)."""
    p: list[str] = []
    if num_layers is None:
        return p
    captured = sglang_capture(sglang_ids) if sglang_ids is not None else sglang_default_capture(num_layers)
    bad = [k for k in captured if not 1 <= k <= num_layers - 1]
    if bad:
        p.append(
            f"SGLang would capture HF hidden_states {captured} on a {num_layers}-layer target; {bad} are not "
            f"capturable (valid 1..{num_layers - 1}; an index ≥ L never fires)"
        )
    if trained is not None and captured != list(trained):
        how = f"eagle_config ids {sglang_ids} + 1" if sglang_ids is not None else "its default (2, L//2, L-3)"
        p.append(
            f"wrong aux layers: SGLang captures HF hidden_states {captured} ({how}) but the draft was trained "
            f"on {list(trained)}"
        )
    return p


def _check_weights(path: Path, c: Mapping[str, Any]) -> list[str]:
    p: list[str] = []
    try:
        expected = expected_shapes(c)
    except (KeyError, TypeError, ValueError):
        return ["cannot derive the expected tensor shapes from config.json (fields missing, see above)"]
    try:
        f = safetensors.safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types
        return [f"{path.name}: unreadable ({e})"]
    with f:
        names = set(f.keys())
        for name in sorted(set(expected) - names):
            p.append(f"tensor {name} missing: SGLang leaves that parameter uninitialised (it skips silently)")
        for name in sorted(names - set(expected)):
            if name.startswith("layers.0."):
                why = "SGLang has no layers.0.* → midlayer.* mapping and drops it silently"
            elif name.startswith("embed_tokens") or name.startswith("model.embed_tokens"):
                why = "the draft must not carry an embedding: SGLang shares the target's"
            else:
                why = "not a tensor SGLang's LlamaForCausalLMEagle3 loads (dropped silently or fails)"
            p.append(f"unexpected tensor {name}: {why}")
        for name in sorted(set(expected) & names):
            sl = f.get_slice(name)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != expected[name]:
                p.append(f"tensor {name} has shape {list(shape)}, SGLang builds {list(expected[name])}")
            if name == "d2t" and dtype != "I64":
                p.append(
                    f"d2t has dtype {dtype}, expected I64 (SGLang adds it to arange() to index the vocab)"
                )
            elif name == "t2d" and dtype not in ("BOOL", "I64", "I32", "U8"):
                p.append(f"t2d has dtype {dtype}, expected BOOL")
            elif name not in ("d2t", "t2d") and dtype not in _FLOAT_DTYPES:
                p.append(f"tensor {name} has dtype {dtype}, expected a float type")
        if "d2t" in names and not any("d2t" in s for s in p):
            p += _check_d2t(f.get_tensor("d2t"), int(c["vocab_size"]))
    return p


def _check_d2t(d2t: torch.Tensor, vocab_size: int) -> list[str]:
    """SGLang's hot ids are ``d2t[i] + i``: each must be a distinct target id."""
    hot = d2t.to(torch.long) + torch.arange(d2t.numel())
    bad = int(((hot < 0) | (hot >= vocab_size)).sum())
    p = []
    if bad:
        p.append(f"d2t maps {bad} draft ids outside the target vocab 0..{vocab_size - 1}")
    if torch.unique(hot).numel() != hot.numel():
        p.append("d2t maps two draft ids to the same target id")
    return p


def _target_checks(c: Mapping[str, Any], target_config: Any) -> list[str]:
    p: list[str] = []
    pairs = (("target_hidden_size", "hidden_size"), ("vocab_size", "vocab_size"))
    for ours, theirs in pairs:
        want = getattr(target_config, theirs, None)
        if want is not None and c.get(ours) != int(want):
            p.append(f"config.{ours} {c.get(ours)} != target {theirs} {want}")
    tmax = getattr(target_config, "max_position_embeddings", None)
    if (
        tmax is not None
        and _is_int(c.get("max_position_embeddings"))
        and c["max_position_embeddings"] < int(tmax)
    ):
        p.append(
            f"max_position_embeddings {c['max_position_embeddings']} < the target's {tmax}: acceptance collapses "
            f"past it"
        )
    rp = getattr(target_config, "rope_parameters", None) or {}
    ttheta = rp.get("rope_theta") if isinstance(rp, dict) else None
    ttheta = ttheta if ttheta is not None else getattr(target_config, "rope_theta", None)
    theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta"))
    if ttheta is not None and theta is not None and not math.isclose(float(theta), float(ttheta)):
        p.append(f"rope_theta {theta} != the target's {ttheta}")
    return p


def check_sglang_compatible(draft_dir: Path | str, target_config: Any | None = None) -> list[str]:
    """Problems SGLang's EAGLE-3 loader would have with the draft folder ``draft_dir`` ([] when none).

    Reads ``config.json``, the safetensors header (plus ``d2t``) and, when present, ``manifest.json`` (for
    the aux layers the draft was trained on and the target's depth).  ``target_config`` (an HF config) adds
    the target-side checks and supplies the depth when there is no manifest.  Nothing is loaded into SGLang;
    the rules are the ones docs/engines.md lists.
    """
    d = Path(draft_dir)
    try:
        c = json.loads((d / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [f"{d / CONFIG_FILE} is missing"]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return [f"{d / CONFIG_FILE} is unparsable: {e}"]
    if not isinstance(c, dict):
        return [f"{d / CONFIG_FILE} is not a JSON object"]
    problems = _check_config(c)
    sglang_ids, aux_problems = _aux_ids(c)
    problems += aux_problems

    trained: list[int] | None = None
    num_layers: int | None = None
    try:
        manifest = json.loads((d / MANIFEST_FILE).read_text(encoding="utf-8"))
        trained = [int(k) for k in manifest["aux_layer_ids"]["hf"]]
        num_layers = int(manifest["target"]["num_hidden_layers"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        pass
    if target_config is not None:
        num_layers = int(target_config.num_hidden_layers)
        problems += _target_checks(c, target_config)
    problems += _check_capture(sglang_ids, trained, num_layers)

    weights = d / WEIGHTS_FILE
    if not weights.is_file():
        problems.append(f"{weights} is missing")
    else:
        problems += _check_weights(weights, c)
    return problems
