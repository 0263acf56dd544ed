"""Whether a published draft fits a target: shapes, positions, aux layers and the tokenizer.

:func:`check_compatible` reads only the manifest and runs the checks of the format it names
(``publish/registry.py``); :func:`tokenizer_fingerprint` is what a manifest records of the tokenizer.  The
aux-id conventions: docs/formats.md §1.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from draft_align.publish.folder import ExportError
from draft_align.publish.registry import format_of


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


def _check_tokenizer(manifest: Mapping[str, Any], tokenizer_fingerprint: str | None) -> None:
    if tokenizer_fingerprint is not None and tokenizer_fingerprint != manifest["tokenizer_fingerprint"]:
        raise ExportError(
            f"tokenizer fingerprint mismatch: draft {manifest['tokenizer_fingerprint']}, "
            f"target {tokenizer_fingerprint}"
        )


def check_compatible(
    manifest: Mapping[str, Any], target_config: Any, tokenizer_fingerprint: str | None
) -> None:
    """Raise ExportError unless the draft described by ``manifest`` fits ``target_config``: the checks of the
    format the manifest names (``check_target`` in ``eagle3_format``, ``mtp_format``, ``native_mtp_format``),
    then the tokenizer fingerprint when one is given."""
    format_of(manifest).check_target(manifest, target_config)
    _check_tokenizer(manifest, tokenizer_fingerprint)
