"""Whether a published draft fits a target: shapes, positions, aux layers, RoPE and the tokenizer.

:func:`check_compatible` reads only the manifest (either format); :func:`rope_mismatch` is the RoPE
comparison both formats' export validation uses.  The aux-id conventions: docs/formats.md §1.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from draft_align.conventions import default_aux_layer_ids
from draft_align.heads.layers import target_rope
from draft_align.publish.folder import MTP_FORMAT, NATIVE_MTP_FORMAT, ExportError


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """First 16 hex chars of sha256 over the sorted (token, id) vocabulary plus the special tokens and roles."""
    vocab = sorted((str(tok), int(i)) for tok, i in tokenizer.get_vocab().items())
    special = sorted(str(t) for t in (getattr(tokenizer, "all_special_tokens", None) or []))
    roles = getattr(tokenizer, "special_tokens_map", None) or {}
    payload = json.dumps(
        {"vocab": vocab, "special_tokens": special, "special_tokens_map": roles},
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


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


def _check_tokenizer(manifest: Mapping[str, Any], tokenizer_fingerprint: str | None) -> None:
    if tokenizer_fingerprint is not None and tokenizer_fingerprint != manifest["tokenizer_fingerprint"]:
        raise ExportError(
            f"tokenizer fingerprint mismatch: draft {manifest['tokenizer_fingerprint']}, "
            f"target {tokenizer_fingerprint}"
        )


def check_compatible(
    manifest: Mapping[str, Any], target_config: Any, tokenizer_fingerprint: str | None
) -> None:
    """Raise ExportError unless the draft described by ``manifest`` fits ``target_config``.

        EAGLE-3: hidden size, vocab size, max_position_embeddings, that the aux layers are capturable on this
        target's depth (and, when config.json relies on the engines' default ids, that the default for this depth
        is what the draft was trained on).  MTP: hidden size, vocab size, the target's depth, positions.  A model's
    own MTP layers: its architecture, hidden size, vocab size and depth.  All:
        the tokenizer fingerprint when one is given.
    """
    if manifest.get("format") == MTP_FORMAT:
        _check_mtp(manifest, target_config)
    elif manifest.get("format") == NATIVE_MTP_FORMAT:
        _check_native_mtp(manifest, target_config)
    else:
        _check_eagle3(manifest, target_config)
    _check_tokenizer(manifest, tokenizer_fingerprint)


def _check_eagle3(manifest: Mapping[str, Any], target_config: Any) -> None:
    target = manifest["target"]
    hidden, vocab = int(target_config.hidden_size), int(target_config.vocab_size)
    if int(target["hidden_size"]) != hidden:
        raise ExportError(
            f"hidden size mismatch: draft trained for {target['hidden_size']}, target has {hidden}"
        )
    if int(target["vocab_size"]) != vocab:
        raise ExportError(
            f"vocab size mismatch: draft trained for {target['vocab_size']}, target has {vocab}"
        )
    draft_max = int(manifest["eagle3_config"]["max_position_embeddings"])
    target_max = int(target_config.max_position_embeddings)
    if draft_max < target_max:
        raise ExportError(f"max_position_embeddings {draft_max} is smaller than the target's {target_max}")
    n_layers = int(target_config.num_hidden_layers)
    aux = manifest["aux_layer_ids"]
    ids = [int(i) for i in aux["hf"]]
    bad = [i for i in ids if not 1 <= i <= n_layers - 1]
    if bad:
        raise ExportError(
            f"num layers mismatch: aux_layer_ids {ids} out of range for a {n_layers}-layer target "
            f"(capturable: 1..{n_layers - 1})"
        )
    default = list(default_aux_layer_ids(n_layers))
    if not aux["in_config"] and default != ids:
        raise ExportError(
            f"num layers mismatch: config.json relies on the engines' default aux layers, which for a "
            f"{n_layers}-layer target are {default}, but the draft was trained on {ids}"
        )


def _check_mtp(manifest: Mapping[str, Any], target_config: Any) -> None:
    cfg = manifest["mtp_config"]
    for what, key, theirs in (
        ("hidden size", "hidden_size", int(target_config.hidden_size)),
        ("vocab size", "vocab_size", int(target_config.vocab_size)),
        ("num layers", "target_num_layers", int(target_config.num_hidden_layers)),
    ):
        if int(cfg[key]) != theirs:
            raise ExportError(f"{what} mismatch: MTP draft built for {cfg[key]}, target has {theirs}")
    if int(cfg["max_position_embeddings"]) < int(target_config.max_position_embeddings):
        raise ExportError(
            f"max_position_embeddings {cfg['max_position_embeddings']} is smaller than the target's "
            f"{target_config.max_position_embeddings}"
        )


def _check_native_mtp(manifest: Mapping[str, Any], target_config: Any) -> None:
    target = manifest["target"]
    arch = (getattr(target_config, "architectures", None) or ["?"])[0]
    if manifest.get("architecture") != arch:
        raise ExportError(
            f"architecture mismatch: the MTP layers are {manifest.get('architecture')}'s, the target is {arch}"
        )
    for what, key in (
        ("hidden size", "hidden_size"),
        ("vocab size", "vocab_size"),
        ("num layers", "num_hidden_layers"),
    ):
        theirs = int(getattr(target_config, key))
        if int(target[key]) != theirs:
            raise ExportError(f"{what} mismatch: MTP layers built for {target[key]}, target has {theirs}")
