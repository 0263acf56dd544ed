"""What a draft update through vLLM's weight-update API carries: the run's signed ``DraftPublished``.

vLLM's RL API (``start_draft_weight_update`` → ``update_weights`` → ``finish_weight_update``, on ``LLM`` and as
HTTP routes) hands ``update_info`` — a JSON object — to the weight-transfer backend in every worker.  The
``draft_align`` backend (:mod:`draft_align.engines.vllm.transfer`) takes exactly one key::

    {"published": [<base64 header frame>, <base64 MAC frame>]}

the wire frames (docs/wire.md) of a ``DraftPublished`` naming the version folder, its version and the sha256
of its weights, HMAC-signed with the run's wire key.  The worker checks the MAC with the key it was given at
start, refuses a replayed message (its envelope's sequence number), and loads only a folder of the run it is
bound to whose bytes hash to the signed sha256: whoever can reach the route cannot load an arbitrary folder.

The version a server serves is also written into vLLM's ``weight_version`` (``finish_weight_update``), as
:func:`weight_version` formats it, so ``GET /weight_info`` tells a restarted push process what each server
serves (:func:`parse_weight_version`).  Neutral: no vLLM import.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from draft_align.wire.codec import Origin, encode
from draft_align.wire.messages import DraftPublished, decode_with_origin
from draft_align.wire.schema import WireError
from draft_align.wire.sequence_guard import Envelope

BACKEND = "draft_align"  # the name the backend is registered under (--weight-transfer-config)
# a policy sync for a server (rl.engine.kind: server): <run>/engine_policy/vNNNN/{model.safetensors, manifest.json},
# announced by the same signed DraftPublished (its draft_version is the policy version)
POLICY_DIR = "engine_policy"
POLICY_KIND = "draft_align.policy_layers"
UPDATE_FIELD = "published"
MAX_UPDATE_BYTES = 64 << 10  # a DraftPublished is a header and a MAC: far below this
_WEIGHT_VERSION_RE = re.compile(r"draft_align:v(\d{1,19}):([0-9a-f]{64})")


class UpdateRefused(ValueError):
    """An update the backend refuses; the message is the one-line reason the caller sees."""


@dataclass(frozen=True)
class SignedUpdate:
    """A decoded, authenticated update: the announcement and its envelope."""

    published: DraftPublished
    origin: Origin


class UpdateSigner:
    """The sending side: signs one ``DraftPublished`` per update with the run's key, each with a fresh
    sequence number of this signer's random sender id (a replayed update is refused by the worker)."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._envelope = Envelope()

    def update_info(self, msg: DraftPublished) -> dict[str, Any]:
        """``update_info`` for ``msg`` (JSON-safe)."""
        sender, seq = self._envelope.stamp()
        frames = encode(msg, self._key, sender=sender, seq=seq)
        self._envelope.advance()
        return {UPDATE_FIELD: [base64.b64encode(f).decode("ascii") for f in frames]}


def read_update(update_info: Any, key: bytes) -> SignedUpdate:
    """Authenticate and decode ``update_info``; :class:`UpdateRefused` with the reason otherwise."""
    if not isinstance(update_info, Mapping) or set(update_info) != {UPDATE_FIELD}:
        got = sorted(update_info) if isinstance(update_info, Mapping) else type(update_info).__name__
        raise UpdateRefused(
            f"update_info must be {{{UPDATE_FIELD!r}: [header, mac]}} (draft_align), got {got}"
        )
    frames = update_info[UPDATE_FIELD]
    if not isinstance(frames, list) or len(frames) != 2 or not all(isinstance(f, str) for f in frames):
        raise UpdateRefused(f"update_info[{UPDATE_FIELD!r}] must be two base64 strings (header, mac)")
    if sum(len(f) for f in frames) > MAX_UPDATE_BYTES:
        raise UpdateRefused(f"update_info of more than {MAX_UPDATE_BYTES} bytes")
    try:
        raw = [base64.b64decode(f, validate=True) for f in frames]
    except (binascii.Error, ValueError) as e:
        raise UpdateRefused(f"update_info is not base64: {e}") from e
    try:
        msg, origin = decode_with_origin(raw, key, max_bytes=MAX_UPDATE_BYTES)
    except WireError as e:
        raise UpdateRefused(f"not signed by this run's key or malformed ({e.reason}): {e}") from e
    if not isinstance(msg, DraftPublished):
        raise UpdateRefused(f"update_info carries a {type(msg).__name__}, not a DraftPublished")
    return SignedUpdate(msg, origin)


def weight_version(version: int, sha256: str) -> str:
    """vLLM's ``weight_version`` for a draft version: ``draft_align:v<version>:<sha256>``."""
    return f"draft_align:v{int(version)}:{sha256}"


def parse_weight_version(text: Any) -> tuple[int, str] | None:
    """(version, sha256) of a :func:`weight_version` string; None for anything else (vLLM's ``"default"``, a
    policy version another tool set)."""
    m = _WEIGHT_VERSION_RE.fullmatch(text) if isinstance(text, str) else None
    return (int(m.group(1)), m.group(2)) if m else None
