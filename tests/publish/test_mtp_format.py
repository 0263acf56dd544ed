"""publish/mtp_format.py: MTP heads in DeepSeek-V3's and Qwen3-Next's layouts round-trip exactly, import
from whole or sharded checkpoints, fail with clear errors, and go through the generic export / load."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig

from draft_align.heads.mtp import MTPConfig, MTPDraft
from draft_align.publish import export_draft, load_draft
from draft_align.publish.compat import check_compatible
from draft_align.publish.folder import ExportError, read_manifest
from draft_align.publish.mtp_format import (
    from_layout,
    head_copies,
    import_mtp,
    import_mtp_from_folder,
    layout_names,
    to_layout,
    with_layout,
)
from draft_align.publish.versions import resolve_draft_dir, write_latest
from tests.helpers import make_mtp_head, peaky

V, H, L = 48, 32, 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama):
    return peaky(tiny_llama(L, V, H))


# ---------------------------------------------------------------- layouts: round trip and errors
def target_config(**kw):
    return dataclasses.replace(target_cfg_ns(), **kw) if kw else target_cfg_ns()


@dataclasses.dataclass
class target_cfg_ns:  # noqa: N801 - a stand-in for an HF config
    num_hidden_layers: int = L
    hidden_size: int = H
    vocab_size: int = V
    max_position_embeddings: int = 128
    rope_parameters: dict = dataclasses.field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    bos_token_id: int = 1
    eos_token_id: int = 2


@pytest.mark.parametrize(("layout", "depth"), [("deepseek_v3", 1), ("deepseek_v3", 2), ("qwen3_next", 1)])
def test_export_import_round_trip_identical(target, tmp_path, layout, depth):
    d = make_mtp_head(target, layout, depth)
    out = export_draft(
        d,
        tmp_path / "v1",
        target_config=target.config,
        target_name="tiny",
        metrics={"x": 1.0},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="fp",
        dtype=torch.float32,
    )
    man = read_manifest(out)  # sha256 of both files verified
    assert man["format"] == "draft_align.mtp" and man["layout"] == layout
    assert man["mtp_config"]["depth"] == depth
    import safetensors.torch

    names = set(safetensors.torch.load_file(str(out / "model.safetensors")))
    copies = {c for _, c in head_copies(d.cfg, layout)}
    assert names == set(layout_names(d.cfg, layout).values()) | copies
    assert len(copies) == (2 * (depth - 1) if layout == "deepseek_v3" else 0)
    if layout == "deepseek_v3":
        assert (
            f"model.layers.{L}.eh_proj.weight" in names
            and f"model.layers.{L}.shared_head.head.weight" in names
        )
        assert f"model.layers.{L + depth - 1}.mlp.down_proj.weight" in names
        assert f"model.layers.{L + depth - 1}.shared_head.head.weight" in names
    else:
        assert {
            "mtp.fc.weight",
            "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight",
        } <= names
    back, _ = load_draft(out)
    a, b = d.engine_state_dict(), back.engine_state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and through the generic loader / compatibility check (dispatch on the manifest's format)
    back2, man2 = load_draft(out)
    assert isinstance(back2, MTPDraft) and man2["layout"] == layout
    check_compatible(man2, target.config, "fp")
    with pytest.raises(ExportError, match="hidden size"):
        check_compatible(man2, target_config(hidden_size=H * 2), None)


def test_import_from_a_whole_checkpoint_ignores_the_trunk(target):
    d = make_mtp_head(target, "deepseek_v3", depth=2)
    ckpt = {**target.state_dict(), **to_layout(d)}
    for i in range(2):  # DeepSeek-V3 checkpoints carry the shared embedding per MTP layer
        ckpt[f"model.layers.{L + i}.embed_tokens.weight"] = target.model.embed_tokens.weight
        ckpt[f"model.layers.{L + i}.shared_head.norm.weight"] = d.norm.weight
        ckpt[f"model.layers.{L + i}.shared_head.head.weight"] = d.lm_head.weight
    back = import_mtp(ckpt, d.cfg)
    for k, v in d.engine_state_dict().items():
        assert torch.equal(v, back.engine_state_dict()[k]), k
    q = make_mtp_head(target, "qwen3_next", depth=1)
    ckpt = {**target.state_dict(), **{k: v for k, v in to_layout(q).items() if k != "lm_head.weight"}}
    ckpt["lm_head.weight"] = q.lm_head.weight  # the target's own head, as in a Qwen3-Next checkpoint
    back = import_mtp(ckpt, q.cfg)
    assert torch.equal(back.layers[0].eh_proj.weight, q.layers[0].eh_proj.weight)


@pytest.mark.parametrize("layout", ["deepseek_v3", "qwen3_next"])
def test_import_from_a_sharded_checkpoint_folder(target, tmp_path, layout):
    import safetensors.torch

    d = make_mtp_head(target, layout, depth=1)
    full = {k: v.contiguous().clone() for k, v in {**target.state_dict(), **to_layout(d)}.items()}
    names = sorted(full)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):  # two shards, MTP tensors in either
        safetensors.torch.save_file(
            {k: full[k] for k in part}, str(tmp_path / f"model-{i:05d}-of-00002.safetensors")
        )
    cfg = target.config.to_dict()
    cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    back = import_mtp_from_folder(tmp_path, layout)
    for k, v in d.engine_state_dict().items():
        assert torch.equal(v, back.engine_state_dict()[k]), k
    with pytest.raises(ExportError, match="depth mismatch"):
        import_mtp_from_folder(tmp_path, layout, depth=2)
    if layout == "deepseek_v3":  # an MoE block (DeepSeek-V3's own) is not this head's Llama block
        moe = {**full, f"model.layers.{L}.mlp.experts.0.gate_proj.weight": torch.zeros(4, H)}
        for f in tmp_path.glob("*.safetensors"):
            f.unlink()
        safetensors.torch.save_file(moe, str(tmp_path / "model.safetensors"))
        with pytest.raises(
            ExportError, match=r"unexpected \['model.layers.4.mlp.experts.0.gate_proj.weight'\]"
        ):
            import_mtp_from_folder(tmp_path, layout)


def test_qwen3_next_without_head_needs_the_targets(target):
    q = make_mtp_head(target, "qwen3_next")
    mtp_only = {k: v for k, v in to_layout(q).items() if k.startswith("mtp.")}
    with pytest.raises(ExportError, match="no lm_head.weight.*pass the target's lm_head"):
        from_layout(mtp_only, q.cfg)
    back = import_mtp(mtp_only, q.cfg, lm_head=target.lm_head.weight)
    assert torch.equal(back.lm_head.weight, target.lm_head.weight)


def test_import_errors_are_clear(target):
    d = make_mtp_head(target, "deepseek_v3", depth=1)
    sd = to_layout(d)
    with pytest.raises(
        ExportError, match="depth mismatch: the checkpoint has 1 MTP layers, the config expects 2"
    ):
        from_layout(sd, dataclasses.replace(d.cfg, depth=2))
    big = MTPConfig.from_target(
        LlamaConfig(
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=L,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=V,
            max_position_embeddings=128,
        )
    )
    with pytest.raises(
        ExportError, match=r"hidden size mismatch: model.layers.4.eh_proj.weight is \[32, 64\]"
    ):
        from_layout(sd, big)
    missing = {k: v for k, v in sd.items() if not k.endswith("hnorm.weight")}
    with pytest.raises(ExportError, match=r"missing \['model.layers.4.hnorm.weight'\]"):
        from_layout(missing, d.cfg)
    extra = {**sd, "model.layers.4.mtp_block.bogus.weight": torch.zeros(1)}
    with pytest.raises(ExportError, match="unexpected.*mtp_block.bogus"):
        from_layout(extra, d.cfg)
    qsd = to_layout(with_layout(d, "qwen3_next"))
    with pytest.raises(
        ExportError, match="no MTP weights in the deepseek_v3 layout.*looks like the qwen3_next"
    ):
        from_layout(qsd, d.cfg)
    with pytest.raises(ExportError, match="numbered from the target's"):
        from_layout(sd, dataclasses.replace(d.cfg, target_num_layers=2))
    with pytest.raises(ExportError, match="would change its outputs"):
        to_layout(d, "qwen3_next")
    deep = make_mtp_head(target, "qwen3_next", depth=2)
    with pytest.raises(ExportError, match="shares mtp.fc"):
        to_layout(deep)


def test_load_refuses_a_tampered_or_mismatched_folder(target, tmp_path):
    d = make_mtp_head(target, "deepseek_v3")
    out = export_draft(
        d,
        tmp_path / "v1",
        target_config=target.config,
        target_name="tiny",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="fp",
    )
    import json

    man = json.loads((out / "manifest.json").read_text())
    man["mtp_config"]["depth"] = 2
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ExportError, match="the head config implies"):  # sizes, checked before anything else
        load_draft(out)
    with pytest.raises(ExportError, match="vocab size mismatch"):
        export_draft(
            d,
            tmp_path / "v2",
            target_config=target_config(vocab_size=V + 1),
            target_name="t",
            metrics={},
            draft_version=2,
            policy_version=0,
            tokenizer_fingerprint="fp",
        )
    assert not (tmp_path / "v2").exists()


@pytest.mark.parametrize(
    ("key", "value"), [("vocab_size", V + 7), ("hidden_size", H * 2), ("num_nextn_predict_layers", 2)]
)
def test_load_refuses_a_rehashed_config_json_that_no_longer_fits_the_weights(target, tmp_path, key, value):
    import hashlib
    import json

    from draft_align.publish.folder import CorruptCheckpointError

    out = export_draft(
        make_mtp_head(target, "deepseek_v3"),
        tmp_path / "v1",
        target_config=target.config,
        target_name="tiny",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="fp",
    )
    load_draft(out)
    config = json.loads((out / "config.json").read_text())
    config[key] = value
    data = json.dumps(config).encode()
    (out / "config.json").write_bytes(data)
    man = json.loads((out / "manifest.json").read_text())
    man["files"]["config.json"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CorruptCheckpointError, match=rf"config\.json: {key} is {value}, the weights say"):
        load_draft(out)


def test_load_refuses_an_unusable_config_or_unreadable_weights(target, tmp_path):
    """The loaders' shared readers (folder.read_head_config / read_weights) name the file that is wrong."""
    import json

    from draft_align.publish.folder import CorruptCheckpointError

    d = make_mtp_head(target, "deepseek_v3")
    out = export_draft(
        d,
        tmp_path / "v1",
        target_config=target.config,
        target_name="tiny",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="fp",
    )
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 8 + data[8:])  # the right size, a header length past the end
    with pytest.raises(
        CorruptCheckpointError, match=r"^model\.safetensors: unreadable .*truncated or corrupt$"
    ):
        load_draft(out, verify=False)
    weights.write_bytes(data)
    man = json.loads((out / "manifest.json").read_text())
    del man["mtp_config"]
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ExportError, match=r"manifest\.json: mtp_config unusable: 'mtp_config'$") as err:
        load_draft(out)
    assert not isinstance(err.value, CorruptCheckpointError)
    man["mtp_config"] = ["not", "a", "mapping"]
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ExportError, match=r"mtp_config unusable"):
        load_draft(out)


def test_generic_export_dispatches_to_mtp(target, tmp_path):
    d = make_mtp_head(target)
    out = export_draft(
        d,
        tmp_path / "drafts" / "v0001",
        target_config=target.config,
        target_name="t",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="fp",
    )
    man = read_manifest(out)
    assert man["format"] == "draft_align.mtp" and len(man["files"]["model.safetensors"]["sha256"]) == 64
    write_latest(tmp_path, out)
    assert resolve_draft_dir(tmp_path) == out


def test_non_finite_weights_are_refused_before_and_after_the_cast(target, tmp_path):
    """NaN is refused as it is; a weight finite in float32 but beyond float16's range (65504) is refused once
    cast to the storage dtype, under its layout name; nothing is written either way, and bfloat16 holds it."""
    kw = dict(
        target_config=target.config,
        target_name="t",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="fp",
    )
    d = make_mtp_head(target)
    with torch.no_grad():
        d.layers[0].eh_proj.weight[0, 0] = float("nan")
    with pytest.raises(ExportError, match=r"non-finite values \(NaN/Inf\) in layers\.0\.eh_proj\.weight$"):
        export_draft(d, tmp_path / "v0001", **kw)
    with torch.no_grad():
        d.layers[0].eh_proj.weight[0, 0] = 1e5
    with pytest.raises(
        ExportError, match=rf"in model\.layers\.{L}\.eh_proj\.weight after casting to torch\.float16$"
    ):
        export_draft(d, tmp_path / "v0001", dtype=torch.float16, **kw)
    assert list(tmp_path.iterdir()) == []
    out = export_draft(d, tmp_path / "v0001", dtype=torch.bfloat16, **kw)
    assert read_manifest(out)["format"] == "draft_align.mtp"
