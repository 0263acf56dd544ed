import dataclasses
import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from torch import nn

from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.publish import export as ex
from draft_align.publish.export import (
    CorruptCheckpointError,
    ExportError,
    check_compatible,
    export_draft,
    load_draft,
    next_version,
    read_latest,
    tokenizer_fingerprint,
    version_dir,
    write_latest,
)

L = 8  # target layers: engine default aux ids (2, 4, 5)
DEFAULT_IDS = (2, 4, 5)
CUSTOM_IDS = (1, 2, 3)
ENGINE_NAMES = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}  # fmt: skip


def target_cfg(**kw):
    base = dict(
        num_hidden_layers=L, hidden_size=24, vocab_size=50, max_position_embeddings=128,
        num_attention_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


def make_draft(aux=DEFAULT_IDS, seed=0, **kw) -> Eagle3Draft:
    base = dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=50, draft_vocab_size=20, target_hidden_size=24, aux_layer_ids=aux,
        target_num_layers=L, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    base.update(kw)
    torch.manual_seed(seed)
    d = Eagle3Draft(Eagle3Config(**base))
    for p in d.parameters():
        nn.init.normal_(p, std=0.3)
    d.set_vocab(torch.arange(3, 43, 2))
    return d


def export(draft, out, **kw):
    args = dict(
        target_config=target_cfg(), target_name="tiny/target", metrics={"acc_len": 1.5},
        draft_version=3, policy_version=7, tokenizer_fingerprint="0123456789abcdef",
    )  # fmt: skip
    args.update(kw)
    return export_draft(draft, out, **args)


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ----------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("dialect", ["hf", "speculators"])
@pytest.mark.parametrize("aux", [DEFAULT_IDS, CUSTOM_IDS])
def test_round_trip_identical_tensors(tmp_path, dialect, aux):
    d = make_draft(aux)
    out = export(d, tmp_path / "v0001", dialect=dialect)
    loaded, manifest = load_draft(out)
    assert manifest["dialect"] == dialect
    assert loaded.cfg == dataclasses.replace(d.cfg, torch_dtype="bfloat16")
    a, b = d.engine_state_dict(), loaded.engine_state_dict()
    assert set(a) == set(b) == ENGINE_NAMES
    for k in a:
        if a[k].is_floating_point():
            assert b[k].dtype == torch.float32
            torch.testing.assert_close(b[k], a[k].to(torch.bfloat16).float(), rtol=0, atol=0)
            torch.testing.assert_close(b[k], a[k], rtol=1e-2, atol=1e-2)  # bf16 rounding
        else:
            assert torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
    assert all(p.requires_grad and p.device.type == "cpu" for p in loaded.parameters())
    # The rebuilt module computes: same logits as the original through bf16 weights.
    ref = make_draft(aux)
    ref.load_state_dict(
        {k: (v.to(torch.bfloat16).float() if v.is_floating_point() else v) for k, v in a.items()}
    )
    torch.manual_seed(1)
    hidden = torch.randn(5, 72)
    emb = torch.randn(5, 32)
    pos = torch.arange(5)
    got = loaded.step(loaded.new_cache(), hidden, emb, pos, from_target=True)[0]
    want = ref.step(ref.new_cache(), hidden, emb, pos, from_target=True)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_weights_file_dtypes_and_names(tmp_path):
    out = export(make_draft(), tmp_path / "hf")
    sd = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert set(sd) == ENGINE_NAMES  # no "model." prefix, no embed_tokens
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in sd.items() if k not in ("d2t", "t2d"))
    out = export(make_draft(), tmp_path / "spec", dialect="speculators", dtype=torch.float16)
    sd = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert {k.replace("layers.0.", "midlayer.") for k in sd} == ENGINE_NAMES
    assert not any(k.startswith("midlayer.") for k in sd)
    assert sd["fc.weight"].dtype == torch.float16


# ----------------------------------------------------------------------------- config.json
def test_hf_config_fields_exact_default_ids(tmp_path):
    out = export(make_draft(DEFAULT_IDS), tmp_path / "v")
    config = json.loads((out / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 128,
        "vocab_size": 50,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "draft_vocab_size": 20,
        "target_hidden_size": 24,
        "norm_before_residual": False,
    }


def test_hf_config_custom_ids_and_rope_scaling(tmp_path):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    d = make_draft(CUSTOM_IDS, rope_parameters=rope)
    out = export(d, tmp_path / "v", target_config=target_cfg(rope_parameters=dict(rope)))
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM reads this: HF indices
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}  # SGLang adds one
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert config["rope_parameters"] == rope
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["aux_layer_ids"]["hf"] == [1, 2, 3]
    assert manifest["aux_layer_ids"]["vllm"] == [1, 2, 3]
    assert manifest["aux_layer_ids"]["sglang"] == [0, 1, 2]
    assert manifest["aux_layer_ids"]["in_config"] is True


def test_hf_config_loads_in_transformers(tmp_path):
    from transformers import LlamaConfig

    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    out = export(make_draft(CUSTOM_IDS, rope_parameters=rope), tmp_path / "v",
                 target_config=target_cfg(rope_parameters=dict(rope)))  # fmt: skip
    c = LlamaConfig.from_pretrained(out)
    assert c.num_hidden_layers == 1 and c.hidden_size == 32 and c.head_dim == 8
    assert c.rope_parameters["rope_type"] == "linear" and c.rope_parameters["rope_theta"] == 500000.0
    assert c.draft_vocab_size == 20 and c.target_hidden_size == 24
    assert c.eagle_aux_hidden_state_layer_ids == [1, 2, 3]


@pytest.mark.parametrize("aux", [DEFAULT_IDS, CUSTOM_IDS])
def test_speculators_config_fields(tmp_path, aux):
    out = export(make_draft(aux), tmp_path / "v", dialect="speculators")
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3"
    assert c["architectures"] == ["Eagle3Speculator"]
    assert c["norm_before_residual"] is False  # vLLM's update_eagle3 defaults it to True when absent
    assert c["draft_vocab_size"] == 20 and c["target_hidden_size"] == 24
    layer = c["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["vocab_size"] == 50 and layer["hidden_size"] == 32 and layer["head_dim"] == 8
    assert layer["max_position_embeddings"] == 128 and layer["rope_theta"] == 10000.0
    sc = c["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"] == {"name_or_path": "tiny/target", "architectures": ["LlamaForCausalLM"]}
    if aux == DEFAULT_IDS:
        assert "eagle_aux_hidden_state_layer_ids" not in c
    else:
        assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    # vLLM's SpeculatorsConfig.validate_speculators_config reads exactly these paths.
    _ = sc["proposal_methods"][0]["speculative_tokens"], sc["verifier"]["name_or_path"]
    assert isinstance(c["transformer_layer_config"], dict)


def test_sglang_loader_rules(tmp_path):
    """The HF dialect against SGLang's EAGLE-3 loader rules (REFERENCE.md §1)."""
    out = export(make_draft(CUSTOM_IDS), tmp_path / "v")
    config = json.loads((out / "config.json").read_text())
    sd = safetensors.torch.load_file(str(out / "model.safetensors"))
    # Names: no "model." prefix (the loader adds it to everything but lm_head), midlayer.* or layers.0.*.
    assert not any(k.startswith("model.") for k in sd)
    assert "embed_tokens.weight" not in sd
    layer_names = [k for k in sd if "." in k and k.split(".")[0] not in ("fc", "norm", "lm_head")]
    assert layer_names and all(k.startswith(("midlayer.", "layers.0.")) for k in layer_names)
    params = {"model." + k for k in ENGINE_NAMES if k not in ("lm_head.weight", "d2t", "t2d")} | {
        "lm_head.weight"
    }
    for k in sd:
        if k in ("d2t", "t2d"):
            continue
        assert (k if k in params else "model." + k) in params
    # The vocab map: hot_token_id = d2t + arange gives the target ids; d2t int64 [draft_vocab].
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (config["draft_vocab_size"],)
    assert (sd["d2t"] + torch.arange(20)).tolist() == list(range(3, 43, 2))
    assert sd["lm_head.weight"].shape == (config["draft_vocab_size"], config["hidden_size"])
    assert sd["fc.weight"].shape == (config["hidden_size"], 3 * config["target_hidden_size"])
    assert not config["tie_word_embeddings"]
    # Aux ids: SGLang reads eagle_config[...] and captures layer id+1, i.e. HF hidden_states[id+1].
    sglang_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert [i + 1 for i in sglang_ids] == list(CUSTOM_IDS)
    # vLLM reads the top-level key as HF indices.
    assert config["eagle_aux_hidden_state_layer_ids"] == list(CUSTOM_IDS)


# ----------------------------------------------------------------------------- manifest
def test_manifest_contents_and_hashes(tmp_path):
    out = export(make_draft(), tmp_path / "v0003", extra_manifest={"trainer_step": 42})
    m = json.loads((out / "manifest.json").read_text())
    assert set(m["files"]) == {"config.json", "model.safetensors"}
    for name, info in m["files"].items():
        data = (out / name).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert m["draft_version"] == 3 and m["policy_version"] == 7
    assert m["target"] == {"name": "tiny/target", "num_hidden_layers": 8, "hidden_size": 24,
                           "vocab_size": 50, "max_position_embeddings": 128}  # fmt: skip
    assert m["aux_layer_ids"]["hf"] == [2, 4, 5] and m["aux_layer_ids"]["in_config"] is False
    assert m["aux_layer_ids"]["sglang"] == [1, 3, 4]
    assert m["draft_vocab_size"] == 20 and m["tokenizer_fingerprint"] == "0123456789abcdef"
    assert m["metrics"] == {"acc_len": 1.5} and m["trainer_step"] == 42
    assert m["architecture"] == "LlamaForCausalLMEagle3" and m["dialect"] == "hf"
    assert m["draft_align_version"] and m["created"]
    assert Eagle3Config.from_dict(m["eagle3_config"]).aux_layer_ids == (2, 4, 5)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    assert leftovers(tmp_path) == []


def test_extra_manifest_cannot_shadow(tmp_path):
    with pytest.raises(ExportError, match="shadow"):
        export(make_draft(), tmp_path / "v", extra_manifest={"metrics": {}})
    assert not (tmp_path / "v").exists()


# ----------------------------------------------------------------------------- validation
def _swap_fc(d: Eagle3Draft) -> Eagle3Draft:
    d.fc = nn.Linear(48, 32, bias=False)
    return d


def _nan(d: Eagle3Draft) -> Eagle3Draft:
    with torch.no_grad():
        d.midlayer.mlp.up_proj.weight[0, 0] = float("nan")
    return d


def _dup_ids(d: Eagle3Draft) -> Eagle3Draft:
    object.__setattr__(d.cfg, "aux_layer_ids", (2, 4, 4))  # Eagle3Config itself would refuse this
    return d


def _bad_d2t(d: Eagle3Draft) -> Eagle3Draft:
    d.d2t[1] = d.d2t[0] - 1  # draft ids 0 and 1 map to the same target id
    return d


@pytest.mark.parametrize(
    ("mutate", "target_kw", "match"),
    [
        (_swap_fc, {}, "fc width mismatch"),
        (lambda d: d, {"hidden_size": 16}, "hidden size mismatch"),
        (lambda d: d, {"vocab_size": 64}, "vocab size mismatch"),
        (lambda d: d, {"max_position_embeddings": 4096}, "max_position_embeddings 128 is smaller"),
        (lambda d: d, {"num_hidden_layers": 12}, "num layers mismatch"),
        (lambda d: d, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope mismatch"),
        (_nan, {}, r"non-finite .* midlayer\.mlp\.up_proj\.weight"),
        (_dup_ids, {}, "not distinct"),
        (_bad_d2t, {}, "d2t/t2d"),
    ],
)
def test_validation_failures_write_nothing(tmp_path, mutate, target_kw, match):
    d = mutate(make_draft())
    with pytest.raises(ExportError, match=match):
        export(d, tmp_path / "v0001", target_config=target_cfg(**target_kw))
    assert list(tmp_path.iterdir()) == []


def test_aux_ids_must_be_capturable(tmp_path):
    with pytest.raises(ExportError, match="out of range"):
        export(make_draft((2, 4, 8)), tmp_path / "v")  # HF index L is after the final norm
    with pytest.raises(ExportError, match="exactly 3"):
        export(make_draft((2, 4)), tmp_path / "v")
    assert list(tmp_path.iterdir()) == []


def test_existing_out_dir_refused(tmp_path):
    out = export(make_draft(), tmp_path / "v")
    with pytest.raises(ExportError, match="already exists"):
        export(make_draft(seed=1), out)


# ----------------------------------------------------------------------------- corruption
def test_corrupted_byte_detected(tmp_path):
    out = export(make_draft(), tmp_path / "v")
    w = out / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors: sha256 mismatch"):
        load_draft(out)


def test_truncated_file_detected(tmp_path):
    out = export(make_draft(), tmp_path / "v")
    w = out / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors: .* bytes"):
        load_draft(out)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors: unreadable"):
        load_draft(out, verify=False)  # even unverified, a truncated safetensors file is not loaded


def test_missing_or_broken_manifest(tmp_path):
    out = export(make_draft(), tmp_path / "v")
    (out / "manifest.json").write_text('{"format": "draft_align.eag')
    with pytest.raises(CorruptCheckpointError, match="unparsable.*half-written or not a draft_align"):
        load_draft(out)
    (out / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="missing: half-written or not a draft_align"):
        load_draft(out)


def test_missing_listed_file(tmp_path):
    out = export(make_draft(), tmp_path / "v")
    (out / "config.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"config\.json is listed in the manifest but missing"):
        load_draft(out)


# ----------------------------------------------------------------------------- atomicity
def test_crash_in_weight_save_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        export(make_draft(), tmp_path / "v0001")
    assert list(tmp_path.iterdir()) == []


def test_crash_at_rename_leaves_nothing(tmp_path, monkeypatch):
    def boom(src, dst):
        raise OSError("crash during rename")

    monkeypatch.setattr(ex.os, "replace", boom)
    with pytest.raises(OSError, match="crash during rename"):
        export(make_draft(), tmp_path / "v0001")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_swaps_in_the_new_draft(tmp_path):
    out = export(make_draft(seed=0), tmp_path / "v")
    new = make_draft(seed=1)
    export(new, out, overwrite=True, draft_version=4)
    loaded, m = load_draft(out)
    assert m["draft_version"] == 4
    torch.testing.assert_close(loaded.fc.weight, new.fc.weight.to(torch.bfloat16).float())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]


def test_overwrite_crash_keeps_the_old_draft(tmp_path, monkeypatch):
    out = export(make_draft(seed=0), tmp_path / "v")
    before = (out / "manifest.json").read_bytes()
    real = os.replace
    calls = []

    def second_fails(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:  # old → .old-*, then new → v fails
            raise OSError("crash during swap")
        return real(src, dst)

    monkeypatch.setattr(ex.os, "replace", second_fails)
    with pytest.raises(OSError, match="crash during swap"):
        export(make_draft(seed=1), out, overwrite=True)
    assert (out / "manifest.json").read_bytes() == before  # rolled back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]
    load_draft(out)


# ----------------------------------------------------------------------------- compatibility
class FakeTokenizer:
    def __init__(self, vocab, special=("<s>", "</s>")):
        self.vocab = dict(vocab)
        self.all_special_tokens = list(special)
        self.special_tokens_map = {"bos_token": special[0], "eos_token": special[1]}

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_fingerprint():
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    fp = tokenizer_fingerprint(FakeTokenizer(vocab))
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fp == tokenizer_fingerprint(FakeTokenizer(dict(reversed(list(vocab.items())))))  # order-free
    assert fp != tokenizer_fingerprint(FakeTokenizer({**vocab, "b": 4}))
    assert fp != tokenizer_fingerprint(FakeTokenizer(vocab, special=("</s>", "<s>")))


def test_check_compatible(tmp_path):
    tok = FakeTokenizer({"<s>": 0, "</s>": 1, "a": 2})
    fp = tokenizer_fingerprint(tok)
    _, m = load_draft(export(make_draft(), tmp_path / "v", tokenizer_fingerprint=fp))
    check_compatible(m, target_cfg(), fp)
    check_compatible(m, target_cfg(), None)
    with pytest.raises(ExportError, match="tokenizer fingerprint mismatch"):
        check_compatible(m, target_cfg(), tokenizer_fingerprint(FakeTokenizer({"<s>": 0, "</s>": 1, "b": 2})))
    with pytest.raises(ExportError, match="hidden size mismatch"):
        check_compatible(m, target_cfg(hidden_size=48), fp)
    with pytest.raises(ExportError, match="vocab size mismatch"):
        check_compatible(m, target_cfg(vocab_size=51), fp)
    with pytest.raises(ExportError, match="max_position_embeddings"):
        check_compatible(m, target_cfg(max_position_embeddings=4096), fp)
    with pytest.raises(ExportError, match="out of range"):
        check_compatible(m, target_cfg(num_hidden_layers=5), fp)
    # Default ids were left out of config.json: a 10-layer target's default (2, 5, 7) is not (2, 4, 5).
    with pytest.raises(ExportError, match="default aux layers"):
        check_compatible(m, target_cfg(num_hidden_layers=10), fp)
    # Explicit ids travel with the config, so a deeper target is fine.
    _, m2 = load_draft(export(make_draft(CUSTOM_IDS), tmp_path / "w", tokenizer_fingerprint=fp))
    check_compatible(m2, target_cfg(num_hidden_layers=10), fp)


# ----------------------------------------------------------------------------- versions
def test_versions_and_latest_pointer(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert read_latest(run) is None
    assert next_version(run) == 1
    v1 = export(make_draft(), version_dir(run, next_version(run)))
    assert v1 == run / "drafts" / "v0001"
    write_latest(run, v1)
    assert (run / "latest").read_text() == "drafts/v0001\n"
    assert read_latest(run) == v1
    assert next_version(run) == 2
    v2 = export(make_draft(seed=1), version_dir(run, 2), draft_version=2)
    (run / "drafts" / ".tmp-v0009-crashed").mkdir()  # a crashed export's leftovers do not count
    assert next_version(run) == 3
    write_latest(run, v2)
    assert read_latest(run) == v2
    _, m = load_draft(read_latest(run))
    assert m["draft_version"] == 2
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == []
    with pytest.raises(ExportError, match="not inside"):
        write_latest(run, tmp_path)
    (run / "drafts" / "v0003").mkdir()
    with pytest.raises(ExportError, match="not a published checkpoint"):
        write_latest(run, run / "drafts" / "v0003")
    (run / "latest").write_text("../elsewhere\n")
    with pytest.raises(ExportError, match="relative"):
        read_latest(run)


def test_real_llama_target_config(tmp_path):
    """A transformers LlamaConfig as the target, the draft shaped by Eagle3Config.from_target."""
    from transformers import LlamaConfig

    target = LlamaConfig(
        hidden_size=24, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=L, vocab_size=50, max_position_embeddings=128,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    d = Eagle3Draft(Eagle3Config.from_target(target, draft_vocab_size=20))
    d.set_vocab(torch.arange(20))
    out = export_draft(
        d, tmp_path / "v", target_config=target, target_name="t", metrics={}, draft_version=1,
        policy_version=0, tokenizer_fingerprint="f" * 16,
    )  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == target.bos_token_id and config["eos_token_id"] == target.eos_token_id
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config
    loaded, m = load_draft(out)
    check_compatible(m, target, "f" * 16)
    assert loaded.cfg.rope_parameters == target.rope_parameters
