"""Wire messages (docs/wire.md, schema version 1): dataclasses, encode/decode with strict validation, HMAC.

A message is a list of frames: ``[header JSON, tensor bytes..., mac]``.  The MAC is

    mac = HMAC-SHA256(key, H(f_0) ‖ H(f_1) ‖ … ‖ H(f_n)),   H(f) = len(f) as 8-byte big-endian ‖ f

over every frame but the MAC itself; without a key the MAC frame is empty.  No pickle anywhere: the header
is JSON and tensors are raw little-endian C-contiguous bytes described by the header.  Decoding checks the
size and the MAC before it parses anything, then validates the header, every field, every tensor's dtype,
shape and values; any failure raises :class:`WireError` with one of :data:`REASONS`.  Decoded tensors own
their memory (copied out of the frames).  This module does not import zmq (see ``channel.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np
import torch

from draft_align.conventions import DTYPES

SCHEMA = "draft_align.wire"
VERSION = 1
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
)

_DTYPES = DTYPES
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_SHA256_RE = re.compile(r"[0-9a-fA-F]{64}")


class WireError(ValueError):
    """A message that violates docs/wire.md.  ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown WireError reason {reason!r}")
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


# ----------------------------------------------------------------------------------------------- messages
@dataclass(frozen=True, eq=False)
class TapBatch:
    """Policy → sidecar: S sequences, N tokens, ragged-packed by ``cu_seqlens``."""

    run_id: str
    policy_version: int
    source_rank: int
    batch_id: int
    step: int
    aux_layer_ids: tuple[int, ...]  # HF hidden_states indices, ascending
    hidden_size: int  # H
    vocab_size: int  # V
    final_norm: str | None  # "post" | "pre" | None (None iff final_hidden is None)
    temperature: float  # the rollouts' sampling temperature
    cu_seqlens: torch.Tensor  # [S+1] int64, 0 = cu[0] < … < cu[S] = N, every sequence ≥ 2 tokens
    input_ids: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [N] bool: response tokens
    aux_hidden: torch.Tensor  # [N, n_aux·H] bf16
    final_hidden: torch.Tensor | None = None  # [N, H] bf16
    next_logprob: torch.Tensor | None = None  # [N] f32: log p(x_{t+1} | x_≤t) at T=1; 0 at a sequence's end
    logit_lse: torch.Tensor | None = None  # [N] f32: logsumexp of the full-vocab logits at t (T=1)
    topk_ids: torch.Tensor | None = None  # [N, K] int64
    topk_logprobs: torch.Tensor | None = None  # [N, K] f32

    KIND: ClassVar[str] = "TapBatch"

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def sequence(self, i: int) -> dict[str, torch.Tensor]:
        """Views of sequence ``i``'s tokens: every present tensor but ``cu_seqlens``, sliced to [T, ...]."""
        s = self.num_sequences
        if not -s <= i < s:
            raise IndexError(f"sequence {i} of a batch of {s}")
        i %= s
        a, b = int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1])
        return {name: t[a:b] for name, t in self.tensors().items() if name != "cu_seqlens"}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present tensors in wire order."""
        return {n: getattr(self, n) for n in _TENSOR_SPECS["TapBatch"] if getattr(self, n) is not None}

    @classmethod
    def make_dummy(
        cls,
        num_sequences: int = 3,
        *,
        min_len: int = 2,
        max_len: int = 9,
        hidden_size: int = 8,
        vocab_size: int = 50,
        aux_layer_ids: tuple[int, ...] = (1, 2, 3),
        final: bool = True,
        logprobs: bool = True,
        topk: int = 2,
        policy_version: int = 0,
        batch_id: int = 0,
        seed: int = 0,
    ) -> TapBatch:
        """A small valid batch with seeded random contents (tests only)."""
        g = torch.Generator().manual_seed(seed)
        seqs = []
        for _ in range(num_sequences):
            t = int(torch.randint(min_len, max_len + 1, (), generator=g))
            prompt = int(torch.randint(1, t, (), generator=g))
            s: dict[str, torch.Tensor] = {
                "input_ids": torch.randint(0, vocab_size, (t,), generator=g),
                "loss_mask": torch.arange(t) >= prompt,
                "aux_hidden": torch.randn(t, len(aux_layer_ids) * hidden_size, generator=g).bfloat16(),
            }
            if final:
                s["final_hidden"] = torch.randn(t, hidden_size, generator=g).bfloat16()
            if logprobs:
                lp = -torch.rand(t, generator=g) * 5
                lp[-1] = 0.0
                s["next_logprob"] = lp
                s["logit_lse"] = torch.randn(t, generator=g) + 4
            if topk:
                s["topk_ids"] = torch.randint(0, vocab_size, (t, topk), generator=g)
                s["topk_logprobs"] = -(torch.rand(t, topk, generator=g) * 5).sort(dim=-1).values
            seqs.append(s)
        return pack_sequences(
            seqs, run_id="dummy", policy_version=policy_version, source_rank=0, batch_id=batch_id, step=0,
            aux_layer_ids=aux_layer_ids, hidden_size=hidden_size, vocab_size=vocab_size,
            final_norm="post" if final else None, temperature=1.0,
        )

    def to_frames(self, key: bytes | None) -> list[bytes]:
        return encode(self, key)

    @classmethod
    def from_frames(cls, frames: Sequence[Any], key: bytes | None, **limits: int) -> TapBatch:
        return _decode_as(cls, frames, key, **limits)


@dataclass(frozen=True, eq=False)
class TapPart:
    """Policy → sidecar: one pipeline stage's share of a TapBatch (megatron pipeline parallelism).

    Every stage of pipeline ``source_rank`` sends one part per ``batch_id`` with the same sequences
    (``cu_seqlens``, ``input_ids``, ``loss_mask``) and the aux states of the layers it owns (``layer_ids``,
    a subset of the joined batch's ``aux_layer_ids``); the stage holding the final norm and output layer
    adds ``final_hidden`` and the log-prob tensors.  :mod:`draft_align.wire.join` joins the ``num_stages``
    parts into one TapBatch; a part alone is never trained on.
    """

    run_id: str
    policy_version: int
    source_rank: int  # the pipeline (its data-parallel rank): the joined TapBatch's source_rank
    batch_id: int
    step: int
    stage: int  # 0 ≤ stage < num_stages
    num_stages: int
    layer_ids: tuple[int, ...]  # HF hidden_states indices captured by this stage, ascending (may be empty)
    aux_layer_ids: tuple[int, ...]  # the joined batch's aux_layer_ids (all stages together)
    hidden_size: int
    vocab_size: int
    final_norm: str | None
    temperature: float
    cu_seqlens: torch.Tensor  # [S+1] int64
    input_ids: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [N] bool
    aux_hidden: torch.Tensor  # [N, len(layer_ids)·H] bf16
    final_hidden: torch.Tensor | None = None  # [N, H] bf16
    next_logprob: torch.Tensor | None = None  # [N] f32
    logit_lse: torch.Tensor | None = None  # [N] f32
    topk_ids: torch.Tensor | None = None  # [N, K] int64
    topk_logprobs: torch.Tensor | None = None  # [N, K] f32

    KIND: ClassVar[str] = "TapPart"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present tensors in wire order."""
        return {n: getattr(self, n) for n in _TENSOR_SPECS["TapPart"] if getattr(self, n) is not None}

    @classmethod
    def split(cls, batch: TapBatch, layers_per_stage: Sequence[Sequence[int]]) -> list[TapPart]:
        """The parts pipeline stages would send for ``batch`` (tests, and a reference for the join):
        stage i carries the aux layers ``layers_per_stage[i]``; the last stage carries final hidden and
        log-prob tensors."""
        n_stages = len(layers_per_stage)
        h = batch.hidden_size
        col = {lid: j for j, lid in enumerate(batch.aux_layer_ids)}
        stray = {i for ids in layers_per_stage for i in ids} - set(col)
        if stray:
            raise ValueError(f"layers {sorted(stray)} are not in the batch's aux_layer_ids {batch.aux_layer_ids}")
        parts = []
        for stage, ids in enumerate(layers_per_stage):
            last = stage == n_stages - 1
            aux = [batch.aux_hidden[:, col[i] * h : (col[i] + 1) * h] for i in ids]
            extra = {n: t for n, t in batch.tensors().items() if n in _STAGE_LAST_TENSORS} if last else {}
            parts.append(cls(
                run_id=batch.run_id, policy_version=batch.policy_version, source_rank=batch.source_rank,
                batch_id=batch.batch_id, step=batch.step, stage=stage, num_stages=n_stages,
                layer_ids=tuple(ids), aux_layer_ids=batch.aux_layer_ids, hidden_size=h,
                vocab_size=batch.vocab_size, final_norm=batch.final_norm if last else None,
                temperature=batch.temperature, cu_seqlens=batch.cu_seqlens.clone(),
                input_ids=batch.input_ids.clone(), loss_mask=batch.loss_mask.clone(),
                aux_hidden=torch.cat(aux, dim=1) if aux else batch.aux_hidden.new_empty(batch.num_tokens, 0),
                **extra,
            ))
        return parts

    @classmethod
    def make_dummy(
        cls, stage: int = 0, layers_per_stage: Sequence[Sequence[int]] = ((1,), (2, 3)), **batch_kwargs: Any
    ) -> TapPart:
        """Stage ``stage``'s part of ``TapBatch.make_dummy(**batch_kwargs)`` (tests only)."""
        return cls.split(TapBatch.make_dummy(**batch_kwargs), layers_per_stage)[stage]

    def to_frames(self, key: bytes | None) -> list[bytes]:
        return encode(self, key)

    @classmethod
    def from_frames(cls, frames: Sequence[Any], key: bytes | None, **limits: int) -> TapPart:
        return _decode_as(cls, frames, key, **limits)


# the tensors only the last pipeline stage (final norm + output layer) can fill
_STAGE_LAST_TENSORS = ("final_hidden", "next_logprob", "logit_lse", "topk_ids", "topk_logprobs")


@dataclass(frozen=True, eq=False)
class HeadSync:
    """Policy → sidecar, once per policy version: what turns ``final_hidden`` into draft-vocab logits."""

    run_id: str
    policy_version: int
    hidden_size: int  # H
    vocab_size: int  # V
    norm_eps: float
    norm_weight: torch.Tensor  # [H] f32, the final RMSNorm weight
    draft_to_target: torch.Tensor  # [Vd] int64, distinct, in 0..V-1
    rows: torch.Tensor  # [Vd, H] bf16, lm_head rows in draft-id order

    KIND: ClassVar[str] = "HeadSync"

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in _TENSOR_SPECS["HeadSync"]}

    @classmethod
    def make_dummy(
        cls, *, hidden_size: int = 8, vocab_size: int = 50, draft_vocab: int = 16, policy_version: int = 0,
        seed: int = 0,
    ) -> HeadSync:
        g = torch.Generator().manual_seed(seed)
        d2t = torch.randperm(vocab_size, generator=g)[:draft_vocab].sort().values
        return cls(
            run_id="dummy", policy_version=policy_version, hidden_size=hidden_size, vocab_size=vocab_size,
            norm_eps=1e-5, norm_weight=1 + 0.1 * torch.randn(hidden_size, generator=g), draft_to_target=d2t,
            rows=torch.randn(draft_vocab, hidden_size, generator=g).bfloat16(),
        )

    def to_frames(self, key: bytes | None) -> list[bytes]:
        return encode(self, key)

    @classmethod
    def from_frames(cls, frames: Sequence[Any], key: bytes | None, **limits: int) -> HeadSync:
        return _decode_as(cls, frames, key, **limits)


@dataclass(frozen=True)
class DraftPublished:
    """Sidecar → anyone (PUB/SUB): a new draft version is on disk."""

    run_id: str
    draft_version: int  # ≥ 1
    policy_version: int  # newest policy version in the training data
    path: str  # the version folder
    sha256: str  # 64 hex chars, of model.safetensors
    metrics: dict[str, float] = field(default_factory=dict)

    KIND: ClassVar[str] = "DraftPublished"

    def tensors(self) -> dict[str, torch.Tensor]:
        return {}

    @classmethod
    def make_dummy(
        cls, *, draft_version: int = 1, policy_version: int = 0, path: str = "/tmp/drafts/v0001"
    ) -> DraftPublished:
        return cls(
            run_id="dummy", draft_version=draft_version, policy_version=policy_version, path=path,
            sha256=hashlib.sha256(f"{path}:{draft_version}".encode()).hexdigest(),
            metrics={"acceptance_length": 2.5, "loss": 0.75},
        )

    def to_frames(self, key: bytes | None) -> list[bytes]:
        return encode(self, key)

    @classmethod
    def from_frames(cls, frames: Sequence[Any], key: bytes | None, **limits: int) -> DraftPublished:
        return _decode_as(cls, frames, key, **limits)


@dataclass(frozen=True)
class StepReport:
    """RL job → sidecar: the job's own per-step measurements (None = not measured this step)."""

    run_id: str
    step: int
    policy_version: int
    metrics: dict[str, float | None] = field(default_factory=dict)

    KIND: ClassVar[str] = "StepReport"

    def tensors(self) -> dict[str, torch.Tensor]:
        return {}

    @classmethod
    def make_dummy(cls, *, step: int = 0, policy_version: int = 0) -> StepReport:
        return cls(
            run_id="dummy", step=step, policy_version=policy_version,
            metrics={"reward": 0.5, "kl": 0.01, "acceptance_length/v0001": None, "tap_dropped": 0.0},
        )

    def to_frames(self, key: bytes | None) -> list[bytes]:
        return encode(self, key)

    @classmethod
    def from_frames(cls, frames: Sequence[Any], key: bytes | None, **limits: int) -> StepReport:
        return _decode_as(cls, frames, key, **limits)


Message = TapBatch | HeadSync | DraftPublished | StepReport | TapPart
_CLASSES: dict[str, type] = {c.KIND: c for c in (TapBatch, HeadSync, DraftPublished, StepReport, TapPart)}


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
    f = float(v)
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
    if t < 0:
        raise _bad(f"temperature={t} < 0")
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
_TENSOR_SPECS: dict[str, dict[str, tuple[torch.dtype, int, bool]]] = {
    "TapBatch": _TAP_TENSORS,
    "TapPart": _TAP_TENSORS,  # a pipeline stage's share of a TapBatch: the same tensors
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


def _check_tap_batch(f: dict[str, Any], ts: dict[str, torch.Tensor], max_tokens: int | None,
                     mask_bytes: torch.Tensor | None) -> None:
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


def _check_tap_part(f: dict[str, Any], ts: dict[str, torch.Tensor], max_tokens: int | None,
                    mask_bytes: torch.Tensor | None) -> None:
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


def _check_tensors(kind: str, f: dict[str, Any], ts: dict[str, torch.Tensor], max_tokens: int | None,
                   mask_bytes: torch.Tensor | None = None) -> None:
    if kind == "TapBatch":
        _check_tap_batch(f, ts, max_tokens, mask_bytes)
    elif kind == "TapPart":
        _check_tap_part(f, ts, max_tokens, mask_bytes)
    elif kind == "HeadSync":
        _check_head_sync(f, ts)


# ------------------------------------------------------------------------------------------- encode/decode
def _frame_mac(key: bytes, frames: Sequence[Any]) -> bytes:
    m = hmac.new(key, digestmod=hashlib.sha256)
    for fr in frames:
        m.update(memoryview(fr).nbytes.to_bytes(8, "big"))
        m.update(fr)
    return m.digest()


def _json_fields(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fd in fields(msg):
        if fd.name in _FIELD_SPECS[msg.KIND]:
            v = getattr(msg, fd.name)
            out[fd.name] = list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v
    return out


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _prepare(msg: Message, max_tokens: int | None) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """(kind, JSON-ready canonical fields, contiguous CPU tensors in wire order) of a valid message."""
    kind = getattr(type(msg), "KIND", None)
    if kind not in _CLASSES or type(msg) is not _CLASSES[kind]:
        raise TypeError(f"{type(msg).__name__} is not a wire message")
    parsed = _parse_fields(kind, _json_fields(msg))
    tensors: dict[str, torch.Tensor] = {}
    for name, t in msg.tensors().items():
        if not isinstance(t, torch.Tensor):
            raise _bad(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        dtype, ndim, _ = _TENSOR_SPECS[kind][name]
        if t.dtype != dtype:
            raise WireError("dtype", f"{name} is {t.dtype}, the wire needs {dtype}")
        if t.dim() != ndim:
            raise WireError("shape", f"{name} must have {ndim} dims, got shape {list(t.shape)}")
        tensors[name] = t.detach().cpu().contiguous()
    _check_names(kind, list(tensors))
    _check_tensors(kind, parsed, tensors, max_tokens)
    canonical = {k: list(v) if isinstance(v, tuple) else v for k, v in parsed.items()}
    return kind, canonical, tensors


def validate(msg: Message, *, max_tokens: int | None = None) -> None:
    """Check ``msg`` against docs/wire.md without encoding it; raises :class:`WireError`."""
    _prepare(msg, max_tokens)


def encode(msg: Message, key: bytes | None) -> list[bytes]:
    """Frames of ``msg``: [header, tensor bytes (wire order), mac].  Validates the message exactly as
    :func:`decode` would (so a sender never ships what a receiver rejects); raises :class:`WireError`."""
    if sys.byteorder != "little":
        raise RuntimeError("the wire format is little-endian; big-endian hosts are not supported")
    kind, canonical, tensors = _prepare(msg, None)
    header = {
        "schema": SCHEMA,
        "version": VERSION,
        "kind": kind,
        "fields": canonical,
        "tensors": [
            {"name": n, "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape)} for n, t in tensors.items()
        ],
    }
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    if len(head) > HEADER_MAX_BYTES:
        raise WireError("size", f"header of {len(head)} bytes > {HEADER_MAX_BYTES}")
    frames = [head] + [_tensor_bytes(t) for t in tensors.values()]
    frames.append(_frame_mac(key, frames) if key is not None else b"")
    return frames


def _as_buffer(fr: Any, i: int) -> memoryview:
    buf = getattr(fr, "buffer", fr)  # zmq.Frame exposes .buffer; bytes/bytearray/memoryview are buffers
    try:
        mv = memoryview(buf)
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    except (TypeError, ValueError) as e:
        raise WireError("frames", f"frame {i} is not a contiguous byte buffer ({type(fr).__name__})") from e


def _no_constants(token: str) -> Any:
    raise ValueError(f"{token} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError(f"duplicate keys in {[k for k, _ in pairs]}")
    return out


def _parse_header(buf: memoryview) -> dict[str, Any]:
    if buf.nbytes > HEADER_MAX_BYTES:
        raise WireError("size", f"header of {buf.nbytes} bytes > {HEADER_MAX_BYTES}")
    try:
        header = json.loads(
            bytes(buf).decode("utf-8"), parse_constant=_no_constants, object_pairs_hook=_no_duplicates
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError("header", f"header is not UTF-8 JSON: {e}") from e
    if type(header) is not dict:
        raise WireError("header", f"header must be a JSON object, got {type(header).__name__}")
    keys = {"schema", "version", "kind", "fields", "tensors"}
    if header.keys() != keys:
        raise WireError("header", f"header keys {sorted(header)} ≠ {sorted(keys)}")
    if header["schema"] != SCHEMA:
        raise WireError("schema", f"schema {header['schema']!r} ≠ {SCHEMA!r}")
    if type(header["version"]) is not int or header["version"] != VERSION:
        raise WireError("version", f"version {header['version']!r} ≠ {VERSION}")
    if type(header["kind"]) is not str or header["kind"] not in _CLASSES:
        raise WireError("kind", f"unknown kind {header['kind']!r}")
    if type(header["tensors"]) is not list:
        raise WireError("header", "tensors must be a list")
    return header


def _parse_tensor_entry(kind: str, e: Any) -> tuple[str, torch.dtype, tuple[int, ...]]:
    if type(e) is not dict or e.keys() != {"name", "dtype", "shape"} or type(e["name"]) is not str:
        raise WireError("header", f"tensor entry {e!r} must be {{name: str, dtype, shape}}")
    name = e["name"]
    spec = _TENSOR_SPECS[kind].get(name)
    if spec is None:
        raise _bad(f"{kind} has no tensor {name!r}")
    if type(e["dtype"]) is not str or e["dtype"] not in _DTYPES:
        raise WireError("dtype", f"{name}: unknown dtype {e['dtype']!r}")
    dtype = _DTYPES[e["dtype"]]
    if dtype != spec[0]:
        raise WireError("dtype", f"{name} is {e['dtype']}, must be {_DTYPE_NAMES[spec[0]]}")
    shape = e["shape"]
    if type(shape) is not list or any(type(d) is not int or not 0 <= d < 2**62 for d in shape):
        raise WireError("shape", f"{name}: shape {shape!r} must be a list of non-negative ints")
    if len(shape) != spec[1]:
        raise WireError("shape", f"{name} must have {spec[1]} dims, got {shape}")
    return name, dtype, tuple(shape)


def _copy_tensor(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.empty(buf.nbytes, dtype=torch.uint8)  # own, aligned memory
    if buf.nbytes:
        raw.numpy()[:] = np.frombuffer(buf, dtype=np.uint8)
    return raw.view(dtype).view(shape)


def decode(
    frames: Sequence[Any],
    key: bytes | None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> Message:
    """Validate and decode one message (frames as bytes, memoryviews or zmq.Frame).  Order: frame count,
    total size, MAC (constant-time, before the header is parsed), header, fields, tensors.  Raises
    :class:`WireError` on any violation; the returned tensors own their memory."""
    if not isinstance(frames, list | tuple) or len(frames) < 2:
        raise WireError("frames", "a message has at least a header and a MAC frame")
    bufs = [_as_buffer(fr, i) for i, fr in enumerate(frames)]
    total = sum(b.nbytes for b in bufs)
    if total > max_bytes:
        raise WireError("size", f"message of {total} bytes > max_bytes {max_bytes}")
    mac = bufs[-1]
    if key is not None:
        if mac.nbytes != MAC_BYTES or not hmac.compare_digest(_frame_mac(key, bufs[:-1]), bytes(mac)):
            raise WireError("mac", "MAC does not match (forged, corrupted, or another key)")
    elif mac.nbytes:
        raise WireError("mac", "message carries a MAC but no key is configured")
    header = _parse_header(bufs[0])
    kind = header["kind"]
    entries = header["tensors"]
    if len(bufs) != len(entries) + 2:
        raise WireError("frames", f"{len(bufs)} frames for {len(entries)} tensors (expected {len(entries) + 2})")
    specs = [_parse_tensor_entry(kind, e) for e in entries]
    _check_names(kind, [n for n, _, _ in specs])
    parsed = _parse_fields(kind, header["fields"])
    tensors: dict[str, torch.Tensor] = {}
    mask_bytes = None
    for (name, dtype, shape), buf in zip(specs, bufs[1:-1], strict=True):
        expect = math.prod(shape) * dtype.itemsize
        if buf.nbytes != expect:
            raise WireError("frames", f"{name}: {buf.nbytes} bytes, shape {list(shape)} needs {expect}")
        t = _copy_tensor(buf, torch.uint8 if dtype == torch.bool else dtype, shape)
        if dtype == torch.bool:
            mask_bytes, t = t, t.view(torch.bool)  # bytes other than 0/1 are rejected before any bool use
        tensors[name] = t
    _check_tensors(kind, parsed, tensors, max_tokens, mask_bytes)
    cls = _CLASSES[kind]
    order = _TENSOR_SPECS[kind]
    return cls(**parsed, **{n: tensors[n] for n in order if n in tensors})


def _decode_as(cls: type, frames: Sequence[Any], key: bytes | None, **limits: int) -> Any:
    msg = decode(frames, key, **limits)
    if type(msg) is not cls:
        raise WireError("kind", f"expected {cls.KIND}, got {type(msg).KIND}")
    return msg


# ------------------------------------------------------------------------------------ batch construction
def pack_sequences(
    seqs: Sequence[dict[str, torch.Tensor]],
    *,
    run_id: str,
    policy_version: int,
    source_rank: int,
    batch_id: int,
    step: int,
    aux_layer_ids: Sequence[int],
    hidden_size: int,
    vocab_size: int,
    final_norm: str | None,
    temperature: float,
) -> TapBatch:
    """Pack per-sequence tensors (``input_ids`` [T], ``loss_mask`` [T], ``aux_hidden`` [T, n_aux·H] and
    optionally ``final_hidden`` [T, H], ``next_logprob`` [T], ``logit_lse`` [T], ``topk_ids`` [T, K],
    ``topk_logprobs`` [T, K]) into one CPU TapBatch with wire dtypes; the result is validated as
    :func:`encode` would (raises :class:`WireError`).  The packed tensors are new memory."""
    if not seqs:
        raise ValueError("pack_sequences needs at least one sequence")
    spec = _TENSOR_SPECS["TapBatch"]
    names = [n for n in spec if n in seqs[0]]
    for i, s in enumerate(seqs):
        unknown = set(s) - (spec.keys() - {"cu_seqlens"})
        if unknown:
            raise ValueError(f"sequence {i}: unknown tensors {sorted(unknown)}")
        if [n for n in spec if n in s] != names:
            raise ValueError(f"sequence {i} has tensors {sorted(s)}, sequence 0 has {sorted(names)}")
    lengths = torch.tensor([s["input_ids"].shape[0] for s in seqs], dtype=torch.int64)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    packed = {n: torch.cat([s[n].detach().to("cpu", spec[n][0]) for s in seqs]) for n in names}
    batch = TapBatch(
        run_id=run_id, policy_version=policy_version, source_rank=source_rank, batch_id=batch_id, step=step,
        aux_layer_ids=tuple(aux_layer_ids), hidden_size=hidden_size, vocab_size=vocab_size,
        final_norm=final_norm, temperature=temperature, cu_seqlens=cu, **packed,
    )
    validate(batch)
    return batch


def drop_nonfinite(batch: TapBatch) -> tuple[TapBatch | None, int]:
    """Remove the sequences whose ``aux_hidden`` or ``final_hidden`` hold NaN/Inf.  Returns (the batch, or
    the same object when nothing is dropped, or None when nothing is left; the number of sequences dropped)."""
    bad_tok = ~batch.aux_hidden.isfinite().all(dim=-1)  # [N]
    if batch.final_hidden is not None:
        bad_tok |= ~batch.final_hidden.isfinite().all(dim=-1)
    if not bool(bad_tok.any()):
        return batch, 0
    cu = batch.cu_seqlens
    lengths = cu[1:] - cu[:-1]  # [S]
    seq_of_tok = torch.repeat_interleave(torch.arange(batch.num_sequences), lengths)  # [N]
    bad_seq = torch.zeros(batch.num_sequences, dtype=torch.bool)  # [S]
    bad_seq[seq_of_tok[bad_tok]] = True
    dropped = int(bad_seq.sum())
    if dropped == batch.num_sequences:
        return None, dropped
    keep_tok = ~bad_seq[seq_of_tok]  # [N]
    new_cu = torch.zeros(batch.num_sequences - dropped + 1, dtype=torch.int64)
    new_cu[1:] = lengths[~bad_seq].cumsum(0)
    kept = {n: t[keep_tok] for n, t in batch.tensors().items() if n != "cu_seqlens"}
    scalars = {n: getattr(batch, n) for n in _FIELD_SPECS["TapBatch"]}
    return TapBatch(**scalars, cu_seqlens=new_cu, **kept), dropped
