"""Wire codec (docs/wire.md, schema version 2): message ↔ frames, the HMAC, and the envelope.

A message is a list of frames: ``[header JSON, tensor bytes..., mac]``.  The MAC is

    mac = HMAC-SHA256(key, H(f_0) ‖ H(f_1) ‖ … ‖ H(f_n)),   H(f) = len(f) as 8-byte big-endian ‖ f

over every frame but the MAC itself; without a key the MAC frame is empty.  The header carries, under
the MAC, the envelope: ``sender`` (an id a sending process draws at random when it starts) and ``seq``
(that sender's message counter, strictly increasing), so a receiver can drop a replayed or stale message
(:class:`~draft_align.wire.sequence_guard.SequenceGuard`).  No pickle anywhere: the header is JSON and tensors are
raw little-endian C-contiguous bytes described by the header.  Decoding checks the frame count, the size
and the MAC before it parses anything, then validates the header, every field, every tensor's dtype,
shape and values; any failure raises :class:`~draft_align.wire.schema.WireError` with one of
:data:`~draft_align.wire.schema.REASONS`.  No tensor is copied that need not be: :func:`encode_views` hands
out views of the message's own tensor memory (a sender that sends them must not modify the tensors until they
are sent), and a decoded tensor of at least :data:`SHARE_MIN_BYTES` lies in the received ZeroMQ frame itself
(which nothing reuses, and which the tensor keeps alive); other frames (bytes from a recording or a test) are
copied, so a decoded tensor never aliases a caller's bytes.
The codec knows kinds by name (``schema.py``); ``messages.py`` turns decoded parts into dataclasses.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import numpy as np
import torch

from draft_align.wire.schema import (
    _DTYPE_NAMES,
    _DTYPES,
    _FIELD_SPECS,
    _MAX_INT,
    _TENSOR_SPECS,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_TOKENS,
    HEADER_MAX_BYTES,
    MAC_BYTES,
    SCHEMA,
    VERSION,
    WireError,
    _bad,
    _check_names,
    _check_tensors,
    _parse_fields,
)

# the most frames a valid message has: header, one per tensor of the kind with the most, MAC
MAX_FRAMES = 2 + max(len(spec) for spec in _TENSOR_SPECS.values())
_SENDER_RE = re.compile(r"[0-9A-Za-z_.-]{0,64}")
_HEADER_KEYS = {"schema", "version", "kind", "sender", "seq", "fields", "tensors"}
#: a received frame at least this large is decoded in place (smaller ones are copied: no gain, and ZeroMQ may
#: keep small messages inside a shared receive buffer)
SHARE_MIN_BYTES = 64 * 1024

#: a frame as :func:`encode_views` gives it: the header and MAC as bytes, a tensor as a view of its memory
Frame = bytes | memoryview


@dataclass(frozen=True)
class Origin:
    """The envelope of a decoded message: who sent it (``""``: a sender that gave no id) and its number."""

    sender: str
    seq: int


@dataclass(frozen=True)
class Decoded:
    """A decoded message before it becomes a dataclass: its kind, parsed fields, tensors and envelope."""

    kind: str
    fields: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    origin: Origin


def _frame_mac(key: bytes, frames: Sequence[Any]) -> bytes:
    m = hmac.new(key, digestmod=hashlib.sha256)
    for fr in frames:
        m.update(memoryview(fr).nbytes.to_bytes(8, "big"))
        m.update(fr)
    return m.digest()


def frame_mac(key: bytes, frames: Sequence[Any]) -> bytes:
    """HMAC-SHA256 of ``frames`` as the wire computes it (for tools that forge or check messages)."""
    return _frame_mac(key, frames)


def _sender(v: Any) -> str:
    if type(v) is not str or not _SENDER_RE.fullmatch(v):
        raise WireError("header", f"sender {v!r} must be ≤ 64 characters of [0-9A-Za-z_.-]")
    return v


def _seq(v: Any) -> int:
    if type(v) is not int or not 0 <= v <= _MAX_INT:
        raise WireError("header", f"seq {v!r} must be an int in [0, 2^63)")
    return v


def _json_fields(msg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fd in fields(msg):
        if fd.name in _FIELD_SPECS[msg.KIND]:
            v = getattr(msg, fd.name)
            out[fd.name] = list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v
    return out


def _tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, not copied (the view keeps the tensor alive)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _prepare(msg: Any, max_tokens: int | None) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """(kind, JSON-ready canonical fields, contiguous CPU tensors in wire order) of a valid message."""
    kind = getattr(type(msg), "KIND", None)
    if (
        kind not in _FIELD_SPECS
        or type(msg).__name__ != kind
        or not is_dataclass(msg)
        or type(msg).__module__ != "draft_align.wire.messages"
    ):
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


def validate(msg: Any, *, max_tokens: int | None = None) -> None:
    """Check ``msg`` against docs/wire.md without encoding it; raises :class:`WireError`."""
    _prepare(msg, max_tokens)


def encode(msg: Any, key: bytes | None, *, sender: str = "", seq: int = 0) -> list[bytes]:
    """Frames of ``msg`` (a message of ``messages.py``): [header, tensor bytes (wire order), mac], with
    the envelope ``sender``/``seq`` in the header.  Validates the message exactly as :func:`decode_frames`
    would (so a sender never ships what a receiver rejects); raises :class:`WireError`.  Every frame is bytes
    of its own (:func:`encode_views` for views of the tensors instead)."""
    return [bytes(f) for f in encode_views(msg, key, sender=sender, seq=seq)]


def encode_views(msg: Any, key: bytes | None, *, sender: str = "", seq: int = 0) -> list[Frame]:
    """:func:`encode`, with each tensor frame a view of the message's own tensor memory (no copy: the caller
    must not modify the tensors until the frames are sent; ZeroMQ sends a view with ``copy=False``)."""
    if sys.byteorder != "little":
        raise RuntimeError("the wire format is little-endian; big-endian hosts are not supported")
    kind, canonical, tensors = _prepare(msg, None)
    header = {
        "schema": SCHEMA,
        "version": VERSION,
        "kind": kind,
        "sender": _sender(sender),
        "seq": _seq(seq),
        "fields": canonical,
        "tensors": [
            {"name": n, "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape)} for n, t in tensors.items()
        ],
    }
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    if len(head) > HEADER_MAX_BYTES:
        raise WireError("size", f"header of {len(head)} bytes > {HEADER_MAX_BYTES}")
    frames: list[Frame] = [head, *(_tensor_view(t) for t in tensors.values())]
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
    if header.keys() != _HEADER_KEYS:
        raise WireError("header", f"header keys {sorted(header)} ≠ {sorted(_HEADER_KEYS)}")
    if header["schema"] != SCHEMA:
        raise WireError("schema", f"schema {header['schema']!r} ≠ {SCHEMA!r}")
    if type(header["version"]) is not int or header["version"] != VERSION:
        raise WireError("version", f"version {header['version']!r} ≠ {VERSION}")
    if type(header["kind"]) is not str or header["kind"] not in _FIELD_SPECS:
        raise WireError("kind", f"unknown kind {header['kind']!r}")
    if type(header["tensors"]) is not list:
        raise WireError("header", "tensors must be a list")
    _sender(header["sender"])
    _seq(header["seq"])
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


def _frame_tensor(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...], share: bool) -> torch.Tensor:
    """The tensor a frame holds: in the frame's own memory when ``share`` (a received ZeroMQ frame) and it is
    large and aligned, else copied into memory of its own."""
    if share and buf.nbytes >= SHARE_MIN_BYTES:
        with warnings.catch_warnings():  # a received frame's buffer is exported read-only; nothing reuses it
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(buf, dtype=torch.uint8)
        if raw.data_ptr() % dtype.itemsize == 0:  # each element at its natural alignment
            return raw.view(dtype).view(shape)
    raw = torch.empty(buf.nbytes, dtype=torch.uint8)  # own, aligned memory
    if buf.nbytes:
        raw.numpy()[:] = np.frombuffer(buf, dtype=np.uint8)
    return raw.view(dtype).view(shape)


def decode_frames(
    frames: Sequence[Any],
    key: bytes | None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> Decoded:
    """Validate and decode one message's frames (bytes, memoryviews or zmq.Frame).  Order: frame count,
    total size, MAC (constant-time, before the header is parsed), header, envelope, fields, tensors.
    Raises :class:`WireError` on any violation, never anything else.  A tensor lies in its frame when the frame
    is a received ``zmq.Frame`` of at least :data:`SHARE_MIN_BYTES` (it keeps the frame alive), else in memory
    of its own."""
    if not isinstance(frames, list | tuple) or not 2 <= len(frames) <= MAX_FRAMES:
        raise WireError("frames", f"a message has a header, at most {MAX_FRAMES - 2} tensors and a MAC frame")
    bufs = [_as_buffer(fr, i) for i, fr in enumerate(frames)]
    share = all(hasattr(fr, "buffer") for fr in frames)  # zmq.Frame: received, never reused
    total = sum(b.nbytes for b in bufs)
    if total > max_bytes:
        raise WireError("size", f"message of {total} bytes > max_bytes {max_bytes}")
    mac = bufs[-1]
    if key is not None:
        if mac.nbytes != MAC_BYTES or not hmac.compare_digest(_frame_mac(key, bufs[:-1]), bytes(mac)):
            raise WireError("mac", "MAC does not match (forged, corrupted, or another key)")
    elif mac.nbytes:
        raise WireError("mac", "message carries a MAC but no key is configured")
    try:
        return _decode_checked(bufs, max_tokens, share)
    except WireError:
        raise
    except (ArithmeticError, ValueError, TypeError, LookupError, RecursionError, RuntimeError) as e:
        # a value the validators did not foresee (e.g. a float field written as a 401-digit integer)
        raise WireError("fields", f"undecodable value: {type(e).__name__}: {e}") from e


def _decode_checked(bufs: list[memoryview], max_tokens: int, share: bool) -> Decoded:
    header = _parse_header(bufs[0])
    try:
        return _decode_body(bufs, header, max_tokens, share)
    except WireError as e:
        # the envelope was read (under the MAC when keyed): a receiver tells this numbered message from one
        # that never arrived (channel.py counts those as lost)
        e.origin = Origin(header["sender"], header["seq"])
        raise


def _decode_body(bufs: list[memoryview], header: dict[str, Any], max_tokens: int, share: bool) -> Decoded:
    kind = header["kind"]
    entries = header["tensors"]
    if len(bufs) != len(entries) + 2:
        raise WireError(
            "frames", f"{len(bufs)} frames for {len(entries)} tensors (expected {len(entries) + 2})"
        )
    specs = [_parse_tensor_entry(kind, e) for e in entries]
    _check_names(kind, [n for n, _, _ in specs])
    parsed = _parse_fields(kind, header["fields"])
    tensors: dict[str, torch.Tensor] = {}
    mask_bytes = None
    for (name, dtype, shape), buf in zip(specs, bufs[1:-1], strict=True):
        expect = math.prod(shape) * dtype.itemsize
        if buf.nbytes != expect:
            raise WireError("frames", f"{name}: {buf.nbytes} bytes, shape {list(shape)} needs {expect}")
        t = _frame_tensor(buf, torch.uint8 if dtype == torch.bool else dtype, shape, share)
        if dtype == torch.bool:
            mask_bytes, t = t, t.view(torch.bool)  # bytes other than 0/1 are rejected before any bool use
        tensors[name] = t
    _check_tensors(kind, parsed, tensors, max_tokens, mask_bytes)
    return Decoded(kind, parsed, tensors, Origin(header["sender"], header["seq"]))
