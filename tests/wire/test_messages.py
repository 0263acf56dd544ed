"""Wire messages: exact frame format, round trips, every rejection reason, fuzzing, drop_nonfinite."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import hmac
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draft_align.wire.codec import SHARE_MIN_BYTES, encode, encode_views, validate
from draft_align.wire.messages import BatchHeader, DraftPublished, HeadSync, StepReport, TapBatch, decode
from draft_align.wire.packing import drop_nonfinite, pack_sequences
from draft_align.wire.schema import REASONS, WireError

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
KINDS = (TapBatch, HeadSync, DraftPublished, StepReport)
NP_DTYPES = {"int64": "<i8", "float32": "<f4", "bool": "u1", "float16": "<f2", "int32": "<i4"}


# ------------------------------------------------------------------------------ an independent encoder
def spec_mac(key: bytes, frames: list[bytes]) -> bytes:
    """docs/wire.md: HMAC-SHA256(key, H(f0) ‖ … ‖ H(fn)), H(f) = len(f) as 8-byte big-endian ‖ f."""
    return hmac.new(key, b"".join(len(f).to_bytes(8, "big") + f for f in frames), hashlib.sha256).digest()


def tensor_entry(name: str, t: torch.Tensor) -> tuple[dict, bytes]:
    if t.dtype == torch.bfloat16:  # raw little-endian bf16 = the high half of each float32
        data = (np.asarray(t.float().numpy(), "<f4").view("<u4") >> 16).astype("<u2").tobytes()
        return {"name": name, "dtype": "bfloat16", "shape": list(t.shape)}, data
    dname = str(t.dtype).removeprefix("torch.")
    return {"name": name, "dtype": dname, "shape": list(t.shape)}, np.asarray(
        t.numpy(), NP_DTYPES[dname]
    ).tobytes()


def raw_frames(header: dict, tensors: list[tuple[dict, bytes]], key: bytes | None) -> list[bytes]:
    head = json.dumps({**header, "tensors": [e for e, _ in tensors]}).encode()
    frames = [head] + [d for _, d in tensors]
    return frames + [spec_mac(key, frames) if key is not None else b""]


def parts(msg) -> tuple[dict, list[tuple[dict, bytes]]]:
    """The header (without tensors) and tensor entries of ``msg``, built from the spec, not the module."""
    f = {}
    for fd in dataclasses.fields(msg):
        v = getattr(msg, fd.name)
        if not isinstance(v, torch.Tensor) and v is not None or fd.name == "final_norm":
            f[fd.name] = list(v) if isinstance(v, tuple) else v
    header = {
        "schema": "draft_align.wire",
        "version": 2,
        "kind": type(msg).__name__,
        "sender": "",
        "seq": 0,
        "fields": f,
    }
    return header, [tensor_entry(n, t) for n, t in msg.tensors().items()]


def rebuild(msg, key: bytes | None = None, *, header=None, fields=None, tensors=None, drop=(), add=()):
    """Frames of ``msg`` after replacing header keys, fields, or tensors ({name: tensor or (entry, bytes)})."""
    h, ts = parts(msg)
    h.update(header or {})
    if fields:
        h["fields"].update(fields)
    out = []
    for e, d in ts:
        if e["name"] in drop:
            continue
        repl = (tensors or {}).get(e["name"])
        if isinstance(repl, torch.Tensor):
            e, d = tensor_entry(e["name"], repl)
        elif repl is not None:
            e, d = repl
        out.append((e, d))
    return raw_frames(h, out + list(add), key)


def reason(frames, key=None, **kw) -> str:
    with pytest.raises(WireError) as ei:
        decode(frames, key, **kw)
    assert ei.value.reason in REASONS and isinstance(ei.value, ValueError)
    return ei.value.reason


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for fd in dataclasses.fields(a):
        x, y = getattr(a, fd.name), getattr(b, fd.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, fd.name
            assert torch.equal(x, y), fd.name
        else:
            assert x == y and type(x) is type(y), fd.name


# ------------------------------------------------------------------------------------------- the format
@pytest.mark.parametrize("key", [None, KEY])
@pytest.mark.parametrize("cls", KINDS)
def test_encode_matches_the_spec_byte_for_byte(cls, key):
    msg = cls.make_dummy()
    frames = encode(msg, key)
    assert all(isinstance(f, bytes) for f in frames)
    h, ts = parts(msg)
    assert json.loads(frames[0]) == {**h, "tensors": [e for e, _ in ts]}
    assert frames[1:-1] == [d for _, d in ts]
    assert frames[-1] == (spec_mac(key, frames[:-1]) if key else b"")
    assert_same(decode(raw_frames(h, ts, key), key), msg)


def test_tap_batch_frames_hold_the_values():
    b = TapBatch.make_dummy(num_sequences=2, hidden_size=4, aux_layer_ids=(0, 2))
    frames = encode(b, None)
    header = json.loads(frames[0])
    names = [e["name"] for e in header["tensors"]]
    assert names == [
        "cu_seqlens",
        "input_ids",
        "loss_mask",
        "aux_hidden",
        "final_hidden",
        "next_logprob",
        "logit_lse",
        "topk_ids",
        "topk_logprobs",
    ]
    assert np.frombuffer(frames[1], "<i8").tolist() == b.cu_seqlens.tolist()
    assert np.frombuffer(frames[2], "<i8").tolist() == b.input_ids.tolist()
    assert np.frombuffer(frames[3], "u1").tolist() == b.loss_mask.int().tolist()
    aux = np.frombuffer(frames[4], "<u2").astype("<u4") << 16
    assert np.array_equal(aux.view("<f4").reshape(b.num_tokens, 8), b.aux_hidden.float().numpy())
    assert header["fields"]["aux_layer_ids"] == [0, 2] and header["fields"]["temperature"] == 1.0


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("key", [None, KEY])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"final": False},
        {"logprobs": False},
        {"topk": 0},
        {"final": False, "logprobs": False, "topk": 0},
        {"topk": 5, "num_sequences": 1, "min_len": 2, "max_len": 2},
    ],
)
def test_tap_batch_round_trip(kw, key):
    b = TapBatch.make_dummy(**kw, seed=3)
    frames = b.to_frames(key)
    got = TapBatch.from_frames([bytearray(f) for f in frames], key)
    assert_same(got, b)
    assert got.aux_hidden.dtype == torch.bfloat16 and got.loss_mask.dtype == torch.bool
    assert (got.final_hidden is None) == (kw.get("final") is False)
    assert (got.topk_ids is None) == (kw.get("topk") == 0)


def test_decoded_tensors_own_their_memory():
    b = TapBatch.make_dummy()
    frames = [bytearray(f) for f in encode(b, None)]
    got = decode([memoryview(f) for f in frames], None)
    for f in frames[1:-1]:
        f[:] = b"\xff" * len(f)
    assert_same(got, b)
    got.aux_hidden.add_(1)  # writable
    assert got.aux_hidden.data_ptr() % 16 == 0


def test_encode_views_are_the_tensors_memory_and_encode_the_same_bytes():
    b = TapBatch.make_dummy(num_sequences=4, min_len=400, max_len=600, hidden_size=64)
    views = encode_views(b, KEY, sender="s", seq=3)
    assert [bytes(v) for v in views] == encode(b, KEY, sender="s", seq=3)  # the MAC too
    aux = views[[n for n in b.tensors()].index("aux_hidden") + 1]
    assert isinstance(aux, memoryview)
    b.aux_hidden.view(-1)[0] = 7.0  # the contract: the caller must not modify the tensors until sent
    assert bytes(aux[:2]) == b.aux_hidden.view(-1)[:1].view(torch.uint8).numpy().tobytes()


def test_a_received_frame_is_decoded_in_place_and_kept_alive():
    zmq = pytest.importorskip("zmq")
    b = TapBatch.make_dummy(num_sequences=4, min_len=400, max_len=600, hidden_size=64)
    assert b.aux_hidden.numel() * 2 >= SHARE_MIN_BYTES
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        push.send_multipart(encode_views(b, KEY), copy=False)
        frames = pull.recv_multipart(copy=False)
        aux_frame = frames[[n for n in b.tensors()].index("aux_hidden") + 1]
        got = decode(frames, KEY)
        start = np.frombuffer(aux_frame.buffer, dtype=np.uint8).ctypes.data
        assert got.aux_hidden.data_ptr() == start  # no copy of the large frame
        small = got.cu_seqlens  # below SHARE_MIN_BYTES: copied
        assert not start <= small.data_ptr() < start + len(aux_frame)
        del frames, aux_frame
        gc.collect()
        assert_same(got, b)  # the tensor keeps its frame alive
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


@pytest.mark.parametrize("key", [None, KEY])
@pytest.mark.parametrize("cls", [HeadSync, DraftPublished, StepReport])
def test_other_kinds_round_trip(cls, key):
    msg = cls.make_dummy()
    assert_same(cls.from_frames(msg.to_frames(key), key), msg)


def test_step_report_keeps_none_and_floats():
    r = StepReport(run_id="r", step=3, policy_version=2, metrics={"a": None, "b": 1, "c": -2.5})
    got = decode(encode(r, KEY), KEY)
    assert got.metrics == {"a": None, "b": 1.0, "c": -2.5} and type(got.metrics["b"]) is float


def test_from_frames_checks_the_kind():
    with pytest.raises(WireError) as ei:
        TapBatch.from_frames(StepReport.make_dummy().to_frames(None), None)
    assert ei.value.reason == "kind"


def test_sequence_views():
    b = TapBatch.make_dummy(num_sequences=4, seed=1)
    cu = b.cu_seqlens.tolist()
    assert b.num_sequences == 4 and b.num_tokens == cu[-1]
    s = b.sequence(2)
    assert set(s) == {
        "input_ids",
        "loss_mask",
        "aux_hidden",
        "final_hidden",
        "next_logprob",
        "logit_lse",
        "topk_ids",
        "topk_logprobs",
    }
    assert torch.equal(s["input_ids"], b.input_ids[cu[2] : cu[3]])
    assert s["aux_hidden"].data_ptr() == b.aux_hidden[cu[2]].data_ptr()  # a view, not a copy
    assert torch.equal(b.sequence(-1)["input_ids"], b.input_ids[cu[3] :])
    with pytest.raises(IndexError):
        b.sequence(4)
    assert set(TapBatch.make_dummy(final=False, logprobs=False, topk=0).sequence(0)) == {
        "input_ids",
        "loss_mask",
        "aux_hidden",
    }


def test_pack_sequences_casts_and_concatenates():
    seqs = [
        {
            "input_ids": torch.tensor([1, 2, 3], dtype=torch.int32),
            "loss_mask": torch.tensor([0, 1, 1]),
            "aux_hidden": torch.full((3, 4), 0.5),
            "next_logprob": torch.tensor([-1.0, -2.0, 0.0], dtype=torch.float64),
        },
        {
            "input_ids": torch.tensor([4, 5]),
            "loss_mask": torch.tensor([False, True]),
            "aux_hidden": torch.full((2, 4), 2.0),
            "next_logprob": torch.tensor([-0.5, 0.0]),
        },
    ]
    header = BatchHeader(
        run_id="r",
        policy_version=1,
        source_rank=0,
        batch_id=7,
        step=2,
        aux_layer_ids=[1, 2],
        hidden_size=2,
        vocab_size=6,
        final_norm=None,
        temperature=0.7,
    )
    b = pack_sequences(seqs, header)
    assert b.cu_seqlens.tolist() == [0, 3, 5] and b.input_ids.tolist() == [1, 2, 3, 4, 5]
    assert b.input_ids.dtype == torch.int64 and b.aux_hidden.dtype == torch.bfloat16
    assert b.loss_mask.tolist() == [False, True, True, False, True]
    assert b.next_logprob.tolist() == [-1.0, -2.0, 0.0, -0.5, 0.0] and b.next_logprob.dtype == torch.float32
    assert b.aux_layer_ids == (1, 2) and b.final_hidden is None
    assert torch.equal(b.sequence(1)["aux_hidden"], torch.full((2, 4), 2.0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="at least one"):
        pack_sequences([], header)
    with pytest.raises(ValueError, match="has tensors"):
        pack_sequences([seqs[0], {k: v for k, v in seqs[1].items() if k != "next_logprob"}], header)
    with pytest.raises(ValueError, match="unknown"):
        pack_sequences([{**seqs[0], "logits": torch.zeros(3)}], header)
    with pytest.raises(WireError) as ei:  # a 1-token sequence
        pack_sequences([{k: v[:1] for k, v in seqs[0].items()}], header)
    assert ei.value.reason == "range"
    with pytest.raises(WireError) as ei:  # id 5 ≥ vocab 5
        pack_sequences(seqs, dataclasses.replace(header, vocab_size=5))
    assert ei.value.reason == "range"


# -------------------------------------------------------------------------------------------- rejections
def test_wire_error():
    e = WireError("mac", "bad")
    assert isinstance(e, ValueError) and e.reason == "mac" and e.detail == "bad" and str(e) == "mac: bad"
    with pytest.raises(ValueError, match="unknown WireError reason"):
        WireError("nope", "x")


B = TapBatch.make_dummy(num_sequences=3, seed=5)  # shared, never mutated


def test_rebuild_helper_is_faithful():
    frames, ref = rebuild(B, KEY), encode(B, KEY)
    assert json.loads(frames[0]) == json.loads(ref[0]) and frames[1:-1] == ref[1:-1]
    assert_same(decode(frames, KEY), B)


@pytest.mark.parametrize(
    ("header", "want"),
    [
        ({"version": 1}, "version"),  # schema 1 had no envelope
        ({"version": 3}, "version"),
        ({"version": True}, "version"),
        ({"version": "1"}, "version"),
        ({"schema": "other"}, "schema"),
        ({"kind": "Foo"}, "kind"),
        ({"kind": 3}, "kind"),
        ({"extra": 1}, "header"),
        ({"fields": [1]}, "fields"),
    ],
)
def test_header_rejections(header, want):
    assert reason(rebuild(B, header=header)) == want


def test_header_must_be_a_strict_json_object():
    good = encode(B, None)
    assert reason([b"\xff\xfe{", *good[1:]]) == "header"
    assert reason([b"[1, 2]", *good[1:]]) == "header"
    assert reason([good[0].replace(b'"schema"', b'"schema":1,"schema"', 1), *good[1:]]) == "header"  # dup key
    assert reason([good[0].replace(b'"temperature":1.0', b'"temperature":NaN'), *good[1:]]) == "header"
    h = json.loads(good[0])
    del h["tensors"]
    assert reason([json.dumps(h).encode(), b""]) == "header"
    assert reason([good[0].replace(b'"shape":[4]', b'"shape":[4],"x":0', 1), *good[1:]]) == "header"
    assert reason([good[0].replace(b'{"name":"cu_seqlens"', b'{"name":1', 1), *good[1:]]) == "header"


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"policy_version": True}, "fields"),  # bool is not an int
        ({"policy_version": 1.0}, "fields"),  # nor is a float
        ({"policy_version": -1}, "fields"),
        ({"batch_id": 2**63}, "fields"),
        ({"hidden_size": 0}, "fields"),
        ({"run_id": 3}, "fields"),
        ({"aux_layer_ids": [3, 2, 1]}, "fields"),
        ({"aux_layer_ids": [1, 1, 2]}, "fields"),
        ({"aux_layer_ids": []}, "fields"),
        ({"aux_layer_ids": [1, True, 3]}, "fields"),
        ({"final_norm": "mid"}, "fields"),
        ({"final_norm": None}, "fields"),  # final_hidden is present
        ({"temperature": -0.1}, "fields"),
        ({"temperature": "1"}, "fields"),
        ({"unknown": 1}, "fields"),
    ],
)
def test_tap_batch_field_rejections(fields, want):
    assert reason(rebuild(B, fields=fields)) == want


def test_json_overflow_to_inf_is_rejected():
    frames = rebuild(B, fields={"temperature": 12.5})
    assert decode(frames, None).temperature == 12.5
    assert reason([frames[0].replace(b"12.5", b"1e400"), *frames[1:]]) == "fields"  # json reads inf
    r = rebuild(StepReport.make_dummy(), fields={"metrics": {"a": 12345.5}})
    assert reason([r[0].replace(b"12345.5", b"-1e400"), *r[1:]]) == "fields"


def test_missing_field():
    h, ts = parts(B)
    del h["fields"]["step"]
    assert reason(raw_frames(h, ts, None)) == "fields"


def test_final_norm_needs_final_hidden():
    assert reason(rebuild(B, fields={"final_norm": "pre"}, drop={"final_hidden"})) == "fields"
    got = decode(rebuild(B, fields={"final_norm": None}, drop={"final_hidden"}), None)
    assert got.final_hidden is None and got.final_norm is None
    assert decode(rebuild(B, fields={"final_norm": "pre"}), None).final_norm == "pre"


def test_tensor_list_rejections():
    assert reason(rebuild(B, drop={"input_ids"})) == "fields"  # missing required
    bogus = tensor_entry("bogus", torch.zeros(3))
    assert reason(rebuild(B, drop={"topk_ids", "topk_logprobs"}, add=[bogus])) == "fields"  # extra
    assert reason(rebuild(B, add=[bogus])) == "fields"  # 10 tensors: as many as a TapBatch with stats_from
    full = TapBatch.make_dummy(stats_from=True)  # all 10 TapBatch tensors
    assert reason(rebuild(full, add=[bogus])) == "frames"  # more frames than any kind has (MAX_FRAMES)
    assert (
        reason(rebuild(B, add=[tensor_entry("logit_lse", B.logit_lse)], drop={"topk_ids", "topk_logprobs"}))
        == "fields"
    )  # dup
    assert reason(rebuild(B, drop={"topk_logprobs"})) == "fields"  # topk pair
    assert reason(rebuild(HeadSync.make_dummy(), add=[tensor_entry("extra", torch.zeros(1))])) == "fields"
    assert reason(rebuild(StepReport.make_dummy(), add=[tensor_entry("x", torch.zeros(1))])) == "fields"


def test_dtype_rejections():
    aux = B.aux_hidden
    as_f16 = ({"name": "aux_hidden", "dtype": "float16", "shape": list(aux.shape)}, tensor_entry("a", aux)[1])
    assert reason(rebuild(B, tensors={"aux_hidden": as_f16})) == "dtype"
    assert reason(rebuild(B, tensors={"input_ids": B.input_ids.int()})) == "dtype"
    bad = ({"name": "aux_hidden", "dtype": "complex32", "shape": list(aux.shape)}, tensor_entry("a", aux)[1])
    assert reason(rebuild(B, tensors={"aux_hidden": bad})) == "dtype"
    bad = ({"name": "aux_hidden", "dtype": ["bfloat16"], "shape": list(aux.shape)}, tensor_entry("a", aux)[1])
    assert reason(rebuild(B, tensors={"aux_hidden": bad})) == "dtype"
    with pytest.raises(WireError) as ei:  # the encoder refuses what the decoder would
        encode(dataclasses.replace(B, loss_mask=B.loss_mask.long()), None)
    assert ei.value.reason == "dtype"
    with pytest.raises(TypeError):
        encode({"kind": "TapBatch"}, None)


def test_shape_rejections():
    n = B.num_tokens
    assert reason(rebuild(B, fields={"hidden_size": 4})) == "shape"  # aux is [N, 3·8], fields say 3·4
    assert reason(rebuild(B, fields={"aux_layer_ids": [1, 2]})) == "shape"
    aux = B.aux_hidden.reshape(n * 2, -1)  # same bytes, other shape
    assert reason(rebuild(B, tensors={"aux_hidden": aux})) == "shape"
    assert reason(rebuild(B, tensors={"loss_mask": B.loss_mask[:-1]})) == "shape"
    assert reason(rebuild(B, tensors={"final_hidden": B.final_hidden[:, :4]})) == "shape"
    assert reason(rebuild(B, tensors={"topk_logprobs": B.topk_logprobs[:, :1]})) == "shape"
    assert reason(rebuild(B, tensors={"next_logprob": B.next_logprob[None]})) == "shape"  # rank
    assert reason(rebuild(B, tensors={"cu_seqlens": torch.zeros(1, dtype=torch.int64)})) == "shape"  # S = 0
    empty_k = (torch.zeros(n, 0, dtype=torch.int64), torch.zeros(n, 0))
    assert reason(rebuild(B, tensors={"topk_ids": empty_k[0], "topk_logprobs": empty_k[1]})) == "shape"
    neg = ({"name": "logit_lse", "dtype": "float32", "shape": [-1]}, b"")
    assert reason(rebuild(B, tensors={"logit_lse": neg})) == "shape"
    h = HeadSync.make_dummy()
    assert reason(rebuild(h, tensors={"rows": h.rows[:-1]})) == "shape"
    assert reason(rebuild(h, tensors={"norm_weight": h.norm_weight[:-1]})) == "shape"


def test_frame_rejections():
    good = encode(B, None)
    assert reason(good[:1]) == "frames"
    assert reason([]) == "frames"
    assert reason(good[:-2] + good[-1:]) == "frames"  # a tensor frame missing
    assert reason(good[:-1] + [b"x", good[-1]]) == "frames"  # an extra frame
    assert reason(good[:4] + [good[4][:-1]] + good[5:]) == "frames"  # truncated aux_hidden
    assert reason(good[:2] + [good[2] + b"\0" * 8] + good[3:]) == "frames"  # a longer frame
    assert reason([good[0], 42, *good[2:]]) == "frames"
    assert reason("not a list") == "frames"


def test_range_rejections():
    cu = B.cu_seqlens.clone()
    cu[1], cu[2] = cu[2].item(), cu[1].item()
    assert reason(rebuild(B, tensors={"cu_seqlens": cu})) == "range"  # not monotone
    assert reason(rebuild(B, tensors={"cu_seqlens": B.cu_seqlens + 1})) == "range"  # cu[0] ≠ 0
    cu = B.cu_seqlens.clone()
    cu[-1] -= 1
    assert reason(rebuild(B, tensors={"cu_seqlens": cu})) == "range"  # cu[S] ≠ N
    cu = B.cu_seqlens.clone()
    cu[1] = 1
    assert reason(rebuild(B, tensors={"cu_seqlens": cu})) == "range"  # a 1-token sequence
    q = 2**62  # differences that wrap around int64 must not pass for increasing
    wrap = torch.tensor([0, q, -2 * q, -q, B.num_tokens], dtype=torch.int64)
    assert bool(((wrap[1:] - wrap[:-1]) >= 2).all())
    assert reason(rebuild(B, tensors={"cu_seqlens": wrap})) == "range"
    ids = B.input_ids.clone()
    ids[3] = 50  # = vocab_size
    assert reason(rebuild(B, tensors={"input_ids": ids})) == "range"
    ids[3] = -1
    assert reason(rebuild(B, tensors={"input_ids": ids})) == "range"
    top = B.topk_ids.clone()
    top[0, 1] = 99
    assert reason(rebuild(B, tensors={"topk_ids": top})) == "range"
    e, d = tensor_entry("loss_mask", B.loss_mask)
    assert reason(rebuild(B, tensors={"loss_mask": (e, b"\x02" + d[1:])})) == "range"
    lp = B.next_logprob.clone()
    lp[2] = math.nan
    assert reason(rebuild(B, tensors={"next_logprob": lp})) == "range"
    lse = B.logit_lse.clone()
    lse[0] = math.inf
    assert reason(rebuild(B, tensors={"logit_lse": lse})) == "range"
    lp = B.topk_logprobs.clone()
    lp[0, 0] = -math.inf  # a zero probability is a valid log-prob
    assert torch.equal(decode(rebuild(B, tensors={"topk_logprobs": lp}), None).topk_logprobs, lp)


def test_head_sync_rejections():
    h = HeadSync.make_dummy(vocab_size=50, draft_vocab=16)
    d2t = h.draft_to_target.clone()
    d2t[1] = d2t[0]
    assert reason(rebuild(h, tensors={"draft_to_target": d2t})) == "range"  # not distinct
    d2t = h.draft_to_target.clone()
    d2t[-1] = 50
    assert reason(rebuild(h, tensors={"draft_to_target": d2t})) == "range"
    w = h.norm_weight.clone()
    w[0] = math.nan
    assert reason(rebuild(h, tensors={"norm_weight": w})) == "range"
    assert reason(rebuild(h, fields={"norm_eps": 0.0})) == "fields"
    assert reason(rebuild(h, fields={"vocab_size": 10})) == "range"  # d2t ids ≥ 10


def test_draft_published_and_step_report_rejections():
    d = DraftPublished.make_dummy()
    assert reason(rebuild(d, fields={"sha256": "ab" * 31})) == "fields"
    assert reason(rebuild(d, fields={"sha256": "zz" * 32})) == "fields"
    assert reason(rebuild(d, fields={"draft_version": 0})) == "fields"
    assert reason(rebuild(d, fields={"path": None})) == "fields"
    assert reason(rebuild(d, fields={"metrics": {"a": None}})) == "fields"  # DraftPublished: floats only
    assert reason(rebuild(d, fields={"metrics": {"a": "1"}})) == "fields"
    assert reason(rebuild(d, fields={"metrics": [1.0]})) == "fields"
    r = StepReport.make_dummy()
    assert reason(rebuild(r, fields={"metrics": {"a": True}})) == "fields"
    assert reason(rebuild(r, fields={"step": -3})) == "fields"
    with pytest.raises(WireError):
        encode(StepReport(run_id="r", step=0, policy_version=0, metrics={"x": math.nan}), None)
    with pytest.raises(WireError):
        encode(StepReport(run_id="r", step=0, policy_version=0, metrics={1: 1.0}), None)


def test_mac_rejections():
    good = encode(B, KEY)
    assert_same(decode(good, KEY), B)
    assert reason(good[:-1] + [bytes(32)], KEY) == "mac"  # forged
    assert reason(encode(B, OTHER_KEY), KEY) == "mac"  # another key
    assert reason(encode(B, None), KEY) == "mac"  # unauthenticated
    assert reason(good[:-1] + [good[-1][:16]], KEY) == "mac"
    assert reason(good, None) == "mac"  # a keyless receiver expects an empty MAC frame
    # the MAC is checked before the header is even parsed
    assert reason([b"not json", *good[1:]], KEY) == "mac"
    assert reason(rebuild(B, KEY, header={"version": 7}), KEY) == "version"  # validly MAC'd, then parsed
    # moving bytes between frames changes H(f) framing, so the MAC catches it
    moved = [good[0] + good[1][:1], good[1][1:], *good[2:]]
    assert reason(moved, KEY) == "mac"


def test_size_rejections():
    frames = encode(B, None)
    total = sum(map(len, frames))
    assert decode(frames, None, max_bytes=total).num_tokens == B.num_tokens
    assert reason(frames, None, max_bytes=total - 1) == "size"
    assert reason(encode(B, KEY), KEY, max_bytes=100) == "size"
    assert decode(frames, None, max_tokens=B.num_tokens).num_tokens == B.num_tokens
    assert reason(frames, None, max_tokens=B.num_tokens - 1) == "size"
    big = StepReport(run_id="r" * 70_000, step=0, policy_version=0)
    with pytest.raises(WireError) as ei:
        encode(big, None)
    assert ei.value.reason == "size"
    h = json.dumps(
        {
            "schema": "draft_align.wire",
            "version": 2,
            "kind": "StepReport",
            "sender": "",
            "seq": 0,
            "tensors": [],
            "fields": {"run_id": "r" * 70_000, "step": 0, "policy_version": 0, "metrics": {}},
        }
    )
    assert reason([h.encode(), b""]) == "size"


def test_validate_matches_decode():
    validate(B)
    with pytest.raises(WireError) as ei:
        validate(B, max_tokens=1)
    assert ei.value.reason == "size"
    with pytest.raises(WireError) as ei:
        validate(dataclasses.replace(B, hidden_size=3))
    assert ei.value.reason == "shape"


# ---------------------------------------------------------------------------------------------- fuzzing
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = TapBatch.make_dummy(num_sequences=2, max_len=4, hidden_size=4, aux_layer_ids=(1,), seed=9)
SMALL_PLAIN = encode(SMALL, None)
SMALL_KEYED = encode(SMALL, KEY)


def fixed_point(msg) -> None:
    """A decoded message re-encodes to frames that decode to the same message and re-encode identically."""
    frames = encode(msg, None)
    again = decode(frames, None)
    assert_same_or_nan(again, msg)
    assert encode(again, None) == frames


def assert_same_or_nan(a, b) -> None:
    """Equal fields; tensors compared bit for bit (a mutated bf16 may be NaN)."""
    for fd in dataclasses.fields(a):
        x, y = getattr(a, fd.name), getattr(b, fd.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        else:
            assert x == y


@st.composite
def mutations(draw, frames):
    """1-4 bytes at distinct places, each XOR-ed with a non-zero byte (so the frames always change)."""
    out = [bytearray(f) for f in frames]
    where = st.sampled_from([(i, p) for i, f in enumerate(out) for p in range(len(f))])
    for i, pos in draw(st.sets(where, min_size=1, max_size=4)):
        out[i][pos] ^= draw(st.integers(1, 255))
    return [bytes(f) for f in out]


@FUZZ
@given(st.data())
def test_fuzz_byte_mutations(data):
    frames = data.draw(mutations(SMALL_PLAIN))
    try:
        msg = decode(frames, None)
    except WireError:
        return
    fixed_point(msg)
    if frames[0] == SMALL_PLAIN[0]:  # only tensor bytes changed: re-encoding gives back exactly the input
        assert encode(msg, None) == frames


@FUZZ
@given(st.data())
def test_fuzz_keyed_mutations_fail_the_mac(data):
    frames = data.draw(mutations(SMALL_KEYED))
    assert reason(frames, KEY) == "mac"


@FUZZ
@given(st.data(), st.booleans())
def test_fuzz_truncations_and_frame_drops(data, keyed):
    good = SMALL_KEYED if keyed else SMALL_PLAIN
    key = KEY if keyed else None
    frames = list(good)
    if data.draw(st.booleans()):
        i = data.draw(st.sampled_from([i for i, f in enumerate(frames) if len(f)]))
        frames[i] = frames[i][: data.draw(st.integers(0, len(frames[i]) - 1))]
    else:
        drop = data.draw(st.sets(st.integers(0, len(frames) - 1), min_size=1, max_size=len(frames)))
        frames = [f for i, f in enumerate(frames) if i not in drop]
    try:
        msg = decode(frames, key)
    except WireError as e:
        if keyed:
            assert e.reason in ("mac", "frames")
        return
    assert not keyed
    fixed_point(msg)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6), st.sampled_from([None, KEY]))
def test_fuzz_garbage_frames_only_raise_wire_error(frames, key):
    with pytest.raises(WireError):
        decode(frames, key)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(
    st.sampled_from(["TapBatch", "HeadSync", "DraftPublished", "StepReport"]),
    st.dictionaries(
        st.sampled_from(
            [
                "run_id",
                "step",
                "policy_version",
                "metrics",
                "draft_version",
                "path",
                "sha256",
                "hidden_size",
                "x",
            ]
        ),
        JSON,
        max_size=6,
    ),
    st.lists(
        st.fixed_dictionaries(
            {
                "name": st.sampled_from(["input_ids", "rows", "cu_seqlens", "z"]),
                "dtype": st.sampled_from(["int64", "bfloat16", "bool", "f"]),
                "shape": st.lists(st.integers(-1, 3), max_size=3),
            }
        ),
        max_size=3,
    ),
    st.lists(st.binary(max_size=24), max_size=3),
)
def test_fuzz_structured_headers(kind, fields, tensors, blobs):
    header = {
        "schema": "draft_align.wire",
        "version": 2,
        "kind": kind,
        "sender": "",
        "seq": 0,
        "fields": fields,
        "tensors": tensors,
    }
    frames = [json.dumps(header).encode(), *blobs, b""]
    try:
        msg = decode(frames, None)
    except WireError:
        return
    fixed_point(msg)


# ------------------------------------------------------------------------------------------ drop_nonfinite
def test_drop_nonfinite_removes_only_bad_sequences():
    b = TapBatch.make_dummy(num_sequences=4, seed=2)
    cu = b.cu_seqlens.tolist()
    aux, final = b.aux_hidden.clone(), b.final_hidden.clone()
    aux[cu[1] + 1, 3] = math.nan  # sequence 1
    final[cu[3], 0] = -math.inf  # sequence 3
    bad = dataclasses.replace(b, aux_hidden=aux, final_hidden=final)
    kept, dropped = drop_nonfinite(bad)
    assert dropped == 2 and kept.num_sequences == 2
    for new_i, old_i in ((0, 0), (1, 2)):
        for name, t in kept.sequence(new_i).items():
            assert torch.equal(t, b.sequence(old_i)[name]), name
    lens = [cu[1] - cu[0], cu[3] - cu[2]]
    assert kept.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[1]]
    assert (kept.run_id, kept.aux_layer_ids, kept.batch_id) == (b.run_id, b.aux_layer_ids, b.batch_id)
    assert_same(decode(encode(kept, None), None), kept)


def test_drop_nonfinite_none_and_all():
    b = TapBatch.make_dummy(num_sequences=2, final=False)
    assert drop_nonfinite(b) == (b, 0)
    aux = b.aux_hidden.clone()
    aux[0, 0] = math.inf
    aux[-1, -1] = math.nan
    assert drop_nonfinite(dataclasses.replace(b, aux_hidden=aux)) == (None, 2)
    # non-finite hidden states do not fail decoding (the receiver drops them)
    got = decode(encode(dataclasses.replace(b, aux_hidden=aux), None), None)
    assert got.aux_hidden[0, 0].isinf() and got.aux_hidden[-1, -1].isnan()


def test_drop_nonfinite_keeps_finite_states_whose_sum_overflows():
    b = TapBatch.make_dummy(num_sequences=3, seed=5)
    aux = b.aux_hidden.clone()
    aux[:, :] = 3e38  # finite in bf16; their sum is not
    assert not torch.isfinite(aux.sum())
    big = dataclasses.replace(b, aux_hidden=aux)
    assert drop_nonfinite(big) == (big, 0)
    aux[1, 0] = math.inf  # +Inf among huge positives: the sum is +Inf as well, the exact test finds it
    kept, dropped = drop_nonfinite(dataclasses.replace(b, aux_hidden=aux))
    assert dropped == 1 and kept.num_sequences == 2


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_drop_nonfinite_finds_one_bad_value_among_cancelling_ones(bad):
    b = TapBatch.make_dummy(num_sequences=3, seed=6)
    final = b.final_hidden.clone()
    final[0, 0], final[0, 1] = math.inf, -math.inf  # a sum of NaN, not a cancellation to a finite value
    final[-1, -1] = bad
    kept, dropped = drop_nonfinite(dataclasses.replace(b, final_hidden=final))
    assert dropped == 2 and kept.num_sequences == 1  # sequences 0 and 2 (the last)
    assert torch.equal(kept.final_hidden, b.sequence(1)["final_hidden"])


# ------------------------------------------------------------------ huge numbers in JSON fields
HUGE = 10**400  # 401 digits: float() of it raises OverflowError


@pytest.mark.parametrize(
    "msg, fields",
    [
        (StepReport.make_dummy(), {"metrics": {"reward": HUGE}}),
        (TapBatch.make_dummy(), {"temperature": HUGE}),
        (HeadSync.make_dummy(), {"norm_eps": HUGE}),
    ],
)
def test_a_401_digit_float_field_is_a_fields_rejection(msg, fields):
    assert reason(rebuild(msg, fields=fields)) == "fields"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["metrics", "temperature", "norm_eps"]),
    st.one_of(
        st.integers(min_value=-(10**1000), max_value=10**1000),
        st.floats(),
        st.text(max_size=5),
        st.booleans(),
        st.none(),
        st.lists(st.integers(), max_size=2),
    ),
)
def test_any_number_in_a_float_field_decodes_or_is_a_wire_error(name, value):
    msg = {
        "metrics": StepReport.make_dummy(),
        "temperature": TapBatch.make_dummy(),
        "norm_eps": HeadSync.make_dummy(),
    }[name]
    fields = {"metrics": {"m": value}} if name == "metrics" else {name: value}
    try:
        frames = rebuild(msg, fields=fields)
    except ValueError:  # json.dumps refuses NaN/inf only with allow_nan=False; it is not, so never here
        return
    try:
        decode(frames, None)
    except WireError as e:
        assert e.reason in ("fields", "header")


# ------------------------------------------------------------------------------ stats_from (TapBatch)
def _stats_batch(**kw) -> TapBatch:
    return TapBatch.make_dummy(num_sequences=4, min_len=4, max_len=9, stats_from=True, seed=5, **kw)


def _firsts(b: TapBatch) -> list[int]:
    return [int(b.sequence(i)["loss_mask"].to(torch.int8).argmax()) for i in range(b.num_sequences)]


@pytest.mark.parametrize("key", [None, KEY])
@pytest.mark.parametrize("kw", [{}, {"topk": 0}, {"logprobs": False}])
def test_stats_from_round_trips(key, kw):
    b = _stats_batch(**kw)
    assert b.stats_from.dtype == torch.int32 and b.stats_from.tolist() == [f - 1 for f in _firsts(b)]
    frames = encode(b, key)
    assert [e["name"] for e in json.loads(frames[0])["tensors"]][-1] == "stats_from"
    assert np.frombuffer(frames[-2], "<i4").tolist() == b.stats_from.tolist()
    back = decode(frames, key)
    assert_same(back, b)
    assert [back.stats_start(i) for i in range(4)] == b.stats_from.tolist()
    assert "stats_from" not in back.sequence(0)  # per sequence, not per token


def test_without_stats_from_every_position_has_statistics():
    old = TapBatch.make_dummy(num_sequences=3, seed=5)  # an old sender's message
    back = decode(encode(old, None), None)
    assert back.stats_from is None and [back.stats_start(i) for i in range(3)] == [0, 0, 0]
    assert_same(back, old)


def test_stats_from_may_reach_the_first_response_token_or_the_end_of_a_promptless_sequence():
    b = _stats_batch()
    lse = b.logit_lse.clone()
    nxt = b.next_logprob.clone()
    k_ids, k_lp = b.topk_ids.clone(), b.topk_logprobs.clone()
    firsts = _firsts(b)
    for i, f in enumerate(firsts):  # statistics from the first response token itself
        a = int(b.cu_seqlens[i])
        for x in (lse, nxt, k_ids, k_lp):
            x[a : a + f] = 0
    at_first = dataclasses.replace(
        b,
        stats_from=torch.tensor(firsts, dtype=torch.int32),
        logit_lse=lse,
        next_logprob=nxt,
        topk_ids=k_ids,
        topk_logprobs=k_lp,
    )
    assert_same(decode(encode(at_first, None), None), at_first)
    # a sequence without a response token: its statistics may be absent altogether (stats_from = its length)
    n0 = int(b.cu_seqlens[1])
    mask = b.loss_mask.clone()
    mask[:n0] = False
    for x in (lse, nxt, k_ids, k_lp):
        x[:n0] = 0
    sf = torch.tensor([n0, *firsts[1:]], dtype=torch.int32)
    none = dataclasses.replace(
        at_first,
        loss_mask=mask,
        stats_from=sf,
        logit_lse=lse,
        next_logprob=nxt,
        topk_ids=k_ids,
        topk_logprobs=k_lp,
    )
    assert_same(decode(encode(none, None), None), none)


def _bad_stats_from(b: TapBatch, values) -> list[bytes]:
    return rebuild(b, tensors={"stats_from": torch.tensor(values, dtype=torch.int32)})


def test_stats_from_rejections():
    b = _stats_batch()
    good = b.stats_from.tolist()
    lengths = (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist()
    firsts = _firsts(b)

    def rejected(frames) -> WireError:
        with pytest.raises(WireError) as ei:
            decode(frames, None)
        return ei.value

    e = rejected(_bad_stats_from(b, [lengths[0] + 1, *good[1:]]))  # beyond the sequence
    assert e.reason == "range" and f"stats_from[0]={lengths[0] + 1} outside [0, length {lengths[0]}]" in str(
        e
    )
    e = rejected(_bad_stats_from(b, [*good[:2], -1, good[3]]))  # negative
    assert e.reason == "range" and "stats_from[2]=-1 outside" in str(e)
    e = rejected(_bad_stats_from(b, [good[0], firsts[1] + 1, *good[2:]]))  # after the first response token
    assert e.reason == "range" and f"after the sequence's first response token (position {firsts[1]})" in str(
        e
    )
    e = rejected(_bad_stats_from(b, good[:3]))  # not one per sequence
    assert e.reason == "shape" and "stats_from" in str(e)
    e = rejected(rebuild(b, tensors={"stats_from": b.stats_from.long()}))
    assert e.reason == "dtype"
    # without any statistics tensor
    bare = TapBatch.make_dummy(num_sequences=4, min_len=4, max_len=9, logprobs=False, topk=0, seed=5)
    entry = tensor_entry("stats_from", torch.zeros(4, dtype=torch.int32))
    e = rejected(rebuild(bare, add=[entry]))
    assert e.reason == "fields" and "stats_from without any statistics tensor" in str(e)
    # a statistic before stats_from is not 0: the sender says it is undefined there
    seq = next(i for i, g in enumerate(good) if g >= 1)
    lse = b.logit_lse.clone()
    lse[int(b.cu_seqlens[seq])] = -3.0
    e = rejected(rebuild(b, tensors={"logit_lse": lse}))
    assert e.reason == "range" and "logit_lse must be 0 before stats_from" in str(e)
    # the encoder refuses the same (validate, as pack_sequences and encode run it)
    for bad in ([lengths[0] + 1, *good[1:]], [good[0], firsts[1] + 1, *good[2:]]):
        with pytest.raises(WireError, match="stats_from"):
            validate(dataclasses.replace(b, stats_from=torch.tensor(bad, dtype=torch.int32)))


def test_pack_sequences_and_drop_nonfinite_keep_stats_from():
    b = _stats_batch()
    seqs = [b.sequence(i) for i in range(4)]
    kw = dict(
        run_id="dummy",
        policy_version=0,
        source_rank=0,
        batch_id=0,
        step=0,
        aux_layer_ids=b.aux_layer_ids,
        hidden_size=b.hidden_size,
        vocab_size=b.vocab_size,
        final_norm="post",
        temperature=1.0,
    )
    packed = pack_sequences(seqs, BatchHeader(**kw), stats_from=b.stats_from.tolist())
    assert_same(packed, b)
    with pytest.raises(ValueError, match="3 entries for 4 sequences"):
        pack_sequences(seqs, BatchHeader(**kw), stats_from=[0, 0, 0])
    aux = b.aux_hidden.clone()
    aux[int(b.cu_seqlens[1])] = math.nan  # sequence 1
    kept, dropped = drop_nonfinite(dataclasses.replace(b, aux_hidden=aux))
    assert dropped == 1 and kept.stats_from.tolist() == [b.stats_from[i].item() for i in (0, 2, 3)]
    assert_same(decode(encode(kept, None), None), kept)


def test_tap_part_split_refuses_stats_from():
    from draft_align.wire.messages import TapPart

    with pytest.raises(ValueError, match="TapPart carries no stats_from"):
        TapPart.split(_stats_batch(), ((1,), (2, 3)))


# ------------------------------------------------------------------ temperatures the sidecar can use
@pytest.mark.parametrize("t", [1e308, 5e-324, 1e-4, 100.5, 12345.5, -0.0 - 1e-9])
def test_a_signed_tap_batch_with_a_temperature_out_of_range_is_a_fields_rejection(t):
    """1e308 made both drafts' estimated acceptance k + 1 (every distribution uniform), 5e-324 made it NaN:
    refused at decode, one line naming the field and the range (the receiver counts it under ``fields``)."""
    key = b"k" * 32
    with pytest.raises(
        WireError, match=r"^fields: temperature=.* must be 0 \(greedy\) or in \[0\.001, 100\]$"
    ):
        decode(encode(dataclasses.replace(B, temperature=t), key), key)
    for ok in (0.0, 1e-3, 0.7, 100.0):
        assert decode(encode(dataclasses.replace(B, temperature=ok), key), key).temperature == ok
