"""Wire schema (docs/wire.md): constants, rejection reasons, :class:`WireError`, the field and tensor specs of
every kind and the validators that check a message's fields and tensors.  Knows kinds by name, not the
message classes (``messages.py``) or the bytes (``codec.py``)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from draft_align.conventions import DTYPES, temperature_ok, temperature_rule

SCHEMA = "draft_align.wire"
VERSION = 2  # 2: the envelope (sender, seq) in the header
MAC_BYTES = 32
HEADER_MAX_BYTES = 64 * 1024
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_TOKENS = 1_048_576
_MAX_INT = 2**63 - 1  # header ints must fit an int64

REASONS: tuple[str, ...] = (
    "frames",  # frame count, a non-buffer frame, or a tensor frame whose length ≠ prod(shape)·itemsize
    "header",  # header not UTF-8 JSON object, duplicate/missing/unknown top-level key, malformed tensor entry
    "schema",  # header["schema"] ≠ "draft_align.wire"
    "version",  # header["version"] ≠ 1
    "kind",  # unknown kind (or not the kind the caller expected)
    "fields",  # missing/unknown/mistyped/invalid scalar field; missing/unknown/duplicate tensor name
    "mac",  # MAC absent, wrong length or wrong value (or present when no key is configured)
    "size",  # message over max_bytes, header over 64 KiB, TapBatch over max_tokens
    "dtype",  # unknown dtype or not the dtype its tensor name requires
    "shape",  # shapes inconsistent with each other or with the fields
    "range",  # tensor values out of range (ids, cu_seqlens, loss_mask bytes, NaN log-probs, d2t)
    "auth",  # a connection whose handshake failed (no key or another key): nothing it sent was read
    "sequence",  # a (sender, seq) seen before or older than the sender's newest, or no sender id (channel.py)
    # messages a sender numbered and sent that never arrived (a gap in its sequence; channel.py): dropped in
    # transit, e.g. by libzmq for a frame over the receiver's MAXMSGSIZE, or with a connection that broke
    "lost",
    "senders",  # (no longer raised: the sequence guard evicts into its dormant table; the name stays for counters)
)

_DTYPES = DTYPES
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_SHA256_RE = re.compile(r"[0-9a-fA-F]{64}")


class ReasonError(ValueError):
    """An error with a ``reason`` from a fixed list (the subclass's ``reasons``, what it is counted by) and a
    one-line ``detail``; ``str()`` is ``"reason: detail"``."""

    reasons: ClassVar[tuple[str, ...]] = ()
    origin: Any = None  # WireError: the message's envelope (codec.Origin) when it was read before the error

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in self.reasons:
            raise ValueError(f"unknown {type(self).__name__} reason {reason!r}")
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


class WireError(ReasonError):
    """A message that violates docs/wire.md.  ``reason`` is one of :data:`REASONS`."""

    reasons = REASONS


# the tensors only the last pipeline stage (final norm + output layer) can fill
_STAGE_LAST_TENSORS = ("final_hidden", "next_logprob", "logit_lse", "topk_ids", "topk_logprobs")


# ------------------------------------------------------------------------------------- field validation
def _bad(what: str) -> WireError:
    return WireError("fields", what)


def _int(name: str, v: Any, lo: int) -> int:
    if type(v) is not int:  # bool is not an int here, and neither is 1.0
        raise _bad(f"{name} must be an int, got {type(v).__name__}")
    if not lo <= v <= _MAX_INT:
        raise _bad(f"{name}={v} outside [{lo}, 2^63)")
    return v


def _float(name: str, v: Any) -> float:
    if type(v) not in (int, float):
        raise _bad(f"{name} must be a number, got {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:  # an int beyond the float range (e.g. 401 digits)
        raise _bad(f"{name} is beyond the float range") from None
    if not math.isfinite(f):
        raise _bad(f"{name}={v} is not finite")
    return f


def _str(name: str, v: Any) -> str:
    if type(v) is not str:
        raise _bad(f"{name} must be a string, got {type(v).__name__}")
    return v


def _nonneg(name: str) -> Callable[[Any], int]:
    return lambda v: _int(name, v, 0)


def _positive(name: str) -> Callable[[Any], int]:
    return lambda v: _int(name, v, 1)


def _run_id(v: Any) -> str:
    return _str("run_id", v)


def _aux_layer_ids(v: Any) -> tuple[int, ...]:
    if type(v) not in (list, tuple) or not v:
        raise _bad("aux_layer_ids must be a non-empty list of ints")
    ids = tuple(_int("aux_layer_ids[]", x, 0) for x in v)
    if any(a >= b for a, b in zip(ids, ids[1:], strict=False)):
        raise _bad(f"aux_layer_ids {list(ids)} must be distinct and ascending")
    return ids


def _layer_ids(v: Any) -> tuple[int, ...]:
    if type(v) not in (list, tuple):
        raise _bad("layer_ids must be a list of ints (possibly empty)")
    ids = tuple(_int("layer_ids[]", x, 0) for x in v)
    if any(a >= b for a, b in zip(ids, ids[1:], strict=False)):
        raise _bad(f"layer_ids {list(ids)} must be distinct and ascending")
    return ids


def _final_norm(v: Any) -> str | None:
    if v is not None and v not in ("post", "pre"):
        raise _bad(f"final_norm must be 'post', 'pre' or null, got {v!r}")
    return v


def _temperature(v: Any) -> float:
    t = _float("temperature", v)
    if not temperature_ok(t):  # 1e308 makes every distribution uniform, 5e-324 overflows z/T to NaN
        raise _bad(f"temperature={t:g} must be {temperature_rule()}")
    return t


def _norm_eps(v: Any) -> float:
    e = _float("norm_eps", v)
    if e <= 0:
        raise _bad(f"norm_eps={e} must be > 0")
    return e


def _sha256(v: Any) -> str:
    s = _str("sha256", v)
    if not _SHA256_RE.fullmatch(s):
        raise _bad("sha256 must be 64 hex characters")
    return s


def _metrics(allow_none: bool) -> Callable[[Any], dict[str, float | None]]:
    def parse(v: Any) -> dict[str, float | None]:
        if type(v) is not dict:
            raise _bad(f"metrics must be an object, got {type(v).__name__}")
        out: dict[str, float | None] = {}
        for k, x in v.items():
            if type(k) is not str:
                raise _bad(f"metrics key {k!r} is not a string")
            if x is None and allow_none:
                out[k] = None
            else:
                out[k] = _float(f"metrics[{k!r}]", x)
        return out

    return parse


_FIELD_SPECS: dict[str, dict[str, Callable[[Any], Any]]] = {
    "TapBatch": {
        "run_id": _run_id,
        "policy_version": _nonneg("policy_version"),
        "source_rank": _nonneg("source_rank"),
        "batch_id": _nonneg("batch_id"),
        "step": _nonneg("step"),
        "aux_layer_ids": _aux_layer_ids,
        "hidden_size": _positive("hidden_size"),
        "vocab_size": _positive("vocab_size"),
        "final_norm": _final_norm,
        "temperature": _temperature,
    },
    "TapPart": {
        "run_id": _run_id,
        "policy_version": _nonneg("policy_version"),
        "source_rank": _nonneg("source_rank"),
        "batch_id": _nonneg("batch_id"),
        "step": _nonneg("step"),
        "stage": _nonneg("stage"),
        "num_stages": _positive("num_stages"),
        "layer_ids": _layer_ids,
        "aux_layer_ids": _aux_layer_ids,
        "hidden_size": _positive("hidden_size"),
        "vocab_size": _positive("vocab_size"),
        "final_norm": _final_norm,
        "temperature": _temperature,
    },
    "HeadSync": {
        "run_id": _run_id,
        "policy_version": _nonneg("policy_version"),
        "hidden_size": _positive("hidden_size"),
        "vocab_size": _positive("vocab_size"),
        "norm_eps": _norm_eps,
    },
    "DraftPublished": {
        "run_id": _run_id,
        "draft_version": _positive("draft_version"),
        "policy_version": _nonneg("policy_version"),
        "path": lambda v: _str("path", v),
        "sha256": _sha256,
        "metrics": _metrics(allow_none=False),
    },
    "StepReport": {
        "run_id": _run_id,
        "step": _nonneg("step"),
        "policy_version": _nonneg("policy_version"),
        "metrics": _metrics(allow_none=True),
    },
}

# name → (dtype, ndim, required), in wire order
_TAP_TENSORS: dict[str, tuple[torch.dtype, int, bool]] = {
    "cu_seqlens": (torch.int64, 1, True),
    "input_ids": (torch.int64, 1, True),
    "loss_mask": (torch.bool, 1, True),
    "aux_hidden": (torch.bfloat16, 2, True),
    "final_hidden": (torch.bfloat16, 2, False),
    "next_logprob": (torch.float32, 1, False),
    "logit_lse": (torch.float32, 1, False),
    "topk_ids": (torch.int64, 2, False),
    "topk_logprobs": (torch.float32, 2, False),
}
# the per-token policy statistics (``stats_from`` says from which position of each sequence they are defined)
_STAT_TENSORS = ("next_logprob", "logit_lse", "topk_ids", "topk_logprobs")
_TENSOR_SPECS: dict[str, dict[str, tuple[torch.dtype, int, bool]]] = {
    # stats_from [S]: optional, added without a version change (a sender that omits it means "every position")
    "TapBatch": {**_TAP_TENSORS, "stats_from": (torch.int32, 1, False)},
    "TapPart": _TAP_TENSORS,  # a pipeline stage's share of a TapBatch: the same tensors, no stats_from
    "HeadSync": {
        "norm_weight": (torch.float32, 1, True),
        "draft_to_target": (torch.int64, 1, True),
        "rows": (torch.bfloat16, 2, True),
    },
    "DraftPublished": {},
    "StepReport": {},
}


def _parse_fields(kind: str, raw: Any) -> dict[str, Any]:
    spec = _FIELD_SPECS[kind]
    if type(raw) is not dict:
        raise _bad(f"fields must be an object, got {type(raw).__name__}")
    missing = spec.keys() - raw.keys()
    unknown = raw.keys() - spec.keys()
    if missing or unknown:
        raise _bad(f"{kind} fields: missing {sorted(missing)}, unknown {sorted(unknown)}")
    return {name: parse(raw[name]) for name, parse in spec.items()}


def _check_names(kind: str, names: list[str]) -> None:
    spec = _TENSOR_SPECS[kind]
    if len(set(names)) != len(names):
        raise _bad(f"{kind}: duplicate tensor names {names}")
    required = {n for n, (_, _, req) in spec.items() if req}
    missing = required - set(names)
    unknown = set(names) - spec.keys()
    if missing or unknown:
        raise _bad(f"{kind} tensors: missing {sorted(missing)}, unknown {sorted(unknown)}")
    if kind in ("TapBatch", "TapPart") and ("topk_ids" in names) != ("topk_logprobs" in names):
        raise _bad("topk_ids and topk_logprobs come together")


# ------------------------------------------------------------------------------------ tensor validation
def _shape(name: str, t: torch.Tensor, expect: tuple[int, ...]) -> None:
    if tuple(t.shape) != expect:
        raise WireError("shape", f"{name} has shape {list(t.shape)}, expected {list(expect)}")


def _check_tap_batch(
    f: dict[str, Any], ts: dict[str, torch.Tensor], max_tokens: int | None, mask_bytes: torch.Tensor | None
) -> None:
    if ("final_hidden" in ts) != (f["final_norm"] is not None):
        raise _bad("final_norm must be 'post'/'pre' exactly when final_hidden is present, else null")
    ids = ts["input_ids"]
    n = ids.shape[0]
    if max_tokens is not None and n > max_tokens:
        raise WireError("size", f"{n} tokens > max_tokens {max_tokens}")
    cu = ts["cu_seqlens"]
    s = cu.shape[0] - 1
    if s < 1:
        raise WireError("shape", "cu_seqlens must hold at least one sequence ([S+1], S ≥ 1)")
    h = f["hidden_size"]
    _shape("loss_mask", ts["loss_mask"], (n,))
    _shape("aux_hidden", ts["aux_hidden"], (n, len(f["aux_layer_ids"]) * h))
    if "final_hidden" in ts:
        _shape("final_hidden", ts["final_hidden"], (n, h))
    for name in ("next_logprob", "logit_lse"):
        if name in ts:
            _shape(name, ts[name], (n,))
    if "topk_ids" in ts:
        k = ts["topk_ids"].shape[1]
        if k < 1:
            raise WireError("shape", "topk_ids needs K ≥ 1")
        _shape("topk_ids", ts["topk_ids"], (n, k))
        _shape("topk_logprobs", ts["topk_logprobs"], (n, k))
    if int(cu[0]) != 0 or int(cu[-1]) != n or int(cu.min()) < 0 or int(cu.max()) > n:
        raise WireError("range", f"cu_seqlens must run from 0 to N={n}, got {cu.tolist()[:8]}…")
    # within [0, N] the differences below cannot overflow int64
    if bool((cu[1:] - cu[:-1] < 2).any()):
        raise WireError("range", "cu_seqlens must be increasing with every sequence ≥ 2 tokens")
    v = f["vocab_size"]
    for name in ("input_ids", "topk_ids"):
        if name in ts and ts[name].numel() and (int(ts[name].min()) < 0 or int(ts[name].max()) >= v):
            raise WireError("range", f"{name} outside [0, vocab_size={v})")
    if mask_bytes is not None and mask_bytes.numel() and int(mask_bytes.max()) > 1:
        raise WireError("range", "loss_mask bytes must be 0 or 1")
    for name in ("next_logprob", "logit_lse", "topk_logprobs"):
        if name in ts:
            x = ts[name]
            if bool(x.isnan().any()) or bool((x == math.inf).any()):
                raise WireError("range", f"{name} holds NaN or +inf")
    if "stats_from" in ts:
        _check_stats_from(ts, cu)


def _check_stats_from(ts: dict[str, torch.Tensor], cu: torch.Tensor) -> None:
    """``stats_from`` [S]: in sequence i the statistics are defined at positions ≥ stats_from[i] (from its
    start) and 0 before; 0 ≤ stats_from[i] ≤ the sequence's first response position (its length when it has
    none), so every position a reader scores (the response) has its statistics."""
    present = [n for n in _STAT_TENSORS if n in ts]
    if not present:
        raise _bad("stats_from without any statistics tensor (next_logprob, logit_lse, topk_*)")
    sf = ts["stats_from"]
    s = cu.shape[0] - 1
    _shape("stats_from", sf, (s,))
    lengths = cu[1:] - cu[:-1]  # [S]
    seq = torch.repeat_interleave(torch.arange(s), lengths)  # [N] sequence of each token
    pos = torch.arange(int(cu[-1])) - cu[:-1][seq]  # [N] position within its sequence
    mask = ts["loss_mask"]
    first = lengths.clone().scatter_reduce(0, seq[mask], pos[mask], reduce="amin")  # [S]
    sf64 = sf.to(torch.int64)
    bad = (sf64 < 0) | (sf64 > lengths)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise WireError("range", f"stats_from[{i}]={int(sf[i])} outside [0, length {int(lengths[i])}]")
    late = sf64 > first
    if bool(late.any()):
        i = int(late.nonzero()[0, 0])
        raise WireError(
            "range",
            f"stats_from[{i}]={int(sf[i])} is after the sequence's first response token "
            f"(position {int(first[i])}): the response's statistics would be missing",
        )
    before = pos < sf64[seq]  # [N] positions without statistics
    for name in present:
        x = ts[name]
        if bool((x[before] != 0).any()):
            raise WireError("range", f"{name} must be 0 before stats_from")


def _check_tap_part(
    f: dict[str, Any], ts: dict[str, torch.Tensor], max_tokens: int | None, mask_bytes: torch.Tensor | None
) -> None:
    if f["stage"] >= f["num_stages"]:
        raise _bad(f"stage {f['stage']} ≥ num_stages {f['num_stages']}")
    stray = set(f["layer_ids"]) - set(f["aux_layer_ids"])
    if stray:
        raise _bad(f"layer_ids {sorted(stray)} are not in aux_layer_ids {list(f['aux_layer_ids'])}")
    # the same tensor checks as a TapBatch whose aux columns are this stage's layers
    _check_tap_batch({**f, "aux_layer_ids": f["layer_ids"]}, ts, max_tokens, mask_bytes)


def _check_head_sync(f: dict[str, Any], ts: dict[str, torch.Tensor]) -> None:
    h, v = f["hidden_size"], f["vocab_size"]
    _shape("norm_weight", ts["norm_weight"], (h,))
    d2t = ts["draft_to_target"]
    vd = d2t.shape[0]
    if vd < 1:
        raise WireError("shape", "draft_to_target is empty")
    _shape("rows", ts["rows"], (vd, h))
    if int(d2t.min()) < 0 or int(d2t.max()) >= v:
        raise WireError("range", f"draft_to_target outside [0, vocab_size={v})")
    if d2t.unique().numel() != vd:
        raise WireError("range", "draft_to_target ids are not distinct")
    for name in ("norm_weight", "rows"):
        if not bool(ts[name].isfinite().all()):
            raise WireError("range", f"{name} holds non-finite values")


def _check_tensors(
    kind: str,
    f: dict[str, Any],
    ts: dict[str, torch.Tensor],
    max_tokens: int | None,
    mask_bytes: torch.Tensor | None = None,
) -> None:
    if kind == "TapBatch":
        _check_tap_batch(f, ts, max_tokens, mask_bytes)
    elif kind == "TapPart":
        _check_tap_part(f, ts, max_tokens, mask_bytes)
    elif kind == "HeadSync":
        _check_head_sync(f, ts)
