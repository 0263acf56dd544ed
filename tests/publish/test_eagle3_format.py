"""publish/eagle3_format.py through export_draft / load_draft: round trip, both config.json dialects,
the manifest, and every way a draft is refused before anything is written."""

import dataclasses
import hashlib
import json

import pytest
import safetensors.torch
import torch
from torch import nn

from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft, expected_shapes
from draft_align.publish import export_draft, load_draft
from draft_align.publish.compat import check_compatible
from draft_align.publish.folder import ExportError

DEFAULT_IDS = (2, 4, 5)  # the kit's (tests/publish/conftest.py), for parametrize
CUSTOM_IDS = (1, 2, 3)


# ----------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("dialect", ["hf", "speculators"])
@pytest.mark.parametrize("aux", [DEFAULT_IDS, CUSTOM_IDS])
def test_round_trip_identical_tensors(e3, tmp_path, dialect, aux):
    d = e3.make_draft(aux)
    out = e3.export(d, tmp_path / "v0001", dialect=dialect)
    loaded, manifest = load_draft(out)
    assert manifest["dialect"] == dialect
    assert loaded.cfg == dataclasses.replace(d.cfg, torch_dtype="bfloat16")
    a, b = d.engine_state_dict(), loaded.engine_state_dict()
    assert set(a) == set(b) == e3.ENGINE_NAMES
    for k in a:
        if a[k].is_floating_point():
            assert b[k].dtype == torch.float32
            torch.testing.assert_close(b[k], a[k].to(torch.bfloat16).float(), rtol=0, atol=0)
            torch.testing.assert_close(b[k], a[k], rtol=1e-2, atol=1e-2)  # bf16 rounding
        else:
            assert torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
    assert all(p.requires_grad and p.device.type == "cpu" for p in loaded.parameters())
    # The rebuilt module computes: same logits as the original through bf16 weights.
    ref = e3.make_draft(aux)
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


def test_weights_file_dtypes_and_names(e3, tmp_path):
    out = e3.export(e3.make_draft(), tmp_path / "hf")
    sd = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert set(sd) == e3.ENGINE_NAMES  # no "model." prefix, no embed_tokens
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in sd.items() if k not in ("d2t", "t2d"))
    out = e3.export(e3.make_draft(), tmp_path / "spec", dialect="speculators", dtype=torch.float16)
    sd = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert {k.replace("layers.0.", "midlayer.") for k in sd} == e3.ENGINE_NAMES
    assert not any(k.startswith("midlayer.") for k in sd)
    assert sd["fc.weight"].dtype == torch.float16


@pytest.mark.parametrize("dialect", ["hf", "speculators"])
def test_a_full_vocabulary_draft_is_stored_without_d2t_in_target_order(e3, tmp_path, dialect):
    """Draft vocabulary = the target's: vLLM's EAGLE-3 model has no d2t parameter then and refuses one, so
    the export leaves d2t/t2d out and stores lm_head's rows in target-id order (select_vocab orders by
    count, not by id); loaded back, the draft proposes the same target ids with the same logits."""
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(3))  # draft id i -> target id perm[i]
    d = e3.make_draft(vocab=perm, draft_vocab_size=50)
    out = e3.export(d, tmp_path / "v0001", dialect=dialect)
    sd = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert "d2t" not in sd and "t2d" not in sd
    assert set(expected_shapes(d.cfg)) == e3.ENGINE_NAMES - {"d2t", "t2d"}
    loaded, _ = load_draft(out)
    assert torch.equal(loaded.draft_to_target, torch.arange(50)) and bool(loaded.t2d.all())
    torch.manual_seed(1)
    hidden, emb, pos = torch.randn(5, 72), torch.randn(5, 32), torch.arange(5)
    got = loaded.step(loaded.new_cache(), hidden, emb, pos, from_target=True)[0]
    want = d.step(d.new_cache(), hidden, emb, pos, from_target=True)[0]
    on_target = torch.empty_like(want)
    on_target[..., d.draft_to_target] = want  # the original's logits, indexed by target id
    torch.testing.assert_close(got, on_target, rtol=2e-2, atol=2e-2)  # bf16 weights
    assert torch.equal(got.argmax(-1), on_target.argmax(-1))
    from draft_align.publish.tap_spec import read_tap_spec

    assert torch.equal(read_tap_spec(out).draft_to_target, torch.arange(50))  # what the Tap ships for it
    # exported again, the loaded draft writes the same tensors
    again = safetensors.torch.load_file(
        str(e3.export(loaded, tmp_path / "v0002", dialect=dialect) / "model.safetensors")
    )
    assert all(torch.equal(sd[k], again[k]) for k in sd)


def test_a_full_vocabulary_draft_with_a_broken_map_is_refused(e3, tmp_path):
    d = e3.make_draft(vocab=torch.arange(50), draft_vocab_size=50)
    d.d2t[1] = -1  # draft ids 0 and 1 both map to target id 0
    with pytest.raises(ExportError, match="d2t/t2d"):
        e3.export(d, tmp_path / "v0001")
    assert not (tmp_path / "v0001").exists()


# ----------------------------------------------------------------------------- config.json
def test_hf_config_fields_exact_default_ids(e3, tmp_path):
    out = e3.export(e3.make_draft(e3.DEFAULT_IDS), tmp_path / "v")
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


def test_hf_config_custom_ids_and_rope_scaling(e3, tmp_path):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    d = e3.make_draft(e3.CUSTOM_IDS, rope_parameters=rope)
    out = e3.export(d, tmp_path / "v", target_config=e3.target_cfg(rope_parameters=dict(rope)))
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


def test_hf_config_loads_in_transformers(e3, tmp_path):
    from transformers import LlamaConfig

    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    out = e3.export(
        e3.make_draft(e3.CUSTOM_IDS, rope_parameters=rope),
        tmp_path / "v",
        target_config=e3.target_cfg(rope_parameters=dict(rope)),
    )
    c = LlamaConfig.from_pretrained(out)
    assert c.num_hidden_layers == 1 and c.hidden_size == 32 and c.head_dim == 8
    assert c.rope_parameters["rope_type"] == "linear" and c.rope_parameters["rope_theta"] == 500000.0
    assert c.draft_vocab_size == 20 and c.target_hidden_size == 24
    assert c.eagle_aux_hidden_state_layer_ids == [1, 2, 3]


@pytest.mark.parametrize("aux", [DEFAULT_IDS, CUSTOM_IDS])
def test_speculators_config_fields(e3, tmp_path, aux):
    out = e3.export(e3.make_draft(aux), tmp_path / "v", dialect="speculators")
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
    if aux == e3.DEFAULT_IDS:
        assert "eagle_aux_hidden_state_layer_ids" not in c
    else:
        assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    # vLLM's SpeculatorsConfig.validate_speculators_config reads exactly these paths.
    _ = sc["proposal_methods"][0]["speculative_tokens"], sc["verifier"]["name_or_path"]
    assert isinstance(c["transformer_layer_config"], dict)


def test_sglang_loader_rules(e3, tmp_path):
    """The HF dialect against SGLang's EAGLE-3 loader rules (docs/formats.md §1)."""
    out = e3.export(e3.make_draft(e3.CUSTOM_IDS), tmp_path / "v")
    config = json.loads((out / "config.json").read_text())
    sd = safetensors.torch.load_file(str(out / "model.safetensors"))
    # Names: no "model." prefix (the loader adds it to everything but lm_head), midlayer.* or layers.0.*.
    assert not any(k.startswith("model.") for k in sd)
    assert "embed_tokens.weight" not in sd
    layer_names = [k for k in sd if "." in k and k.split(".")[0] not in ("fc", "norm", "lm_head")]
    assert layer_names and all(k.startswith(("midlayer.", "layers.0.")) for k in layer_names)
    params = {"model." + k for k in e3.ENGINE_NAMES if k not in ("lm_head.weight", "d2t", "t2d")} | {
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
    assert [i + 1 for i in sglang_ids] == list(e3.CUSTOM_IDS)
    # vLLM reads the top-level key as HF indices.
    assert config["eagle_aux_hidden_state_layer_ids"] == list(e3.CUSTOM_IDS)


# ----------------------------------------------------------------------------- manifest
def test_manifest_contents_and_hashes(e3, tmp_path):
    out = e3.export(e3.make_draft(), tmp_path / "v0003", extra_manifest={"trainer_step": 42})
    m = json.loads((out / "manifest.json").read_text())
    assert set(m["files"]) == {"config.json", "model.safetensors"}
    for name, info in m["files"].items():
        data = (out / name).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert m["draft_version"] == 3 and m["policy_version"] == 7
    assert m["target"] == {
        "name": "tiny/target",
        "num_hidden_layers": 8,
        "hidden_size": 24,
        "vocab_size": 50,
        "max_position_embeddings": 128,
    }
    assert m["aux_layer_ids"]["hf"] == [2, 4, 5] and m["aux_layer_ids"]["in_config"] is False
    assert m["aux_layer_ids"]["sglang"] == [1, 3, 4]
    assert m["draft_vocab_size"] == 20 and m["tokenizer_fingerprint"] == "0123456789abcdef"
    assert m["metrics"] == {"acc_len": 1.5} and m["trainer_step"] == 42
    assert m["architecture"] == "LlamaForCausalLMEagle3" and m["dialect"] == "hf"
    assert m["draft_align_version"] and m["created"]
    assert Eagle3Config.from_dict(m["eagle3_config"]).aux_layer_ids == (2, 4, 5)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    assert e3.leftovers(tmp_path) == []


def test_extra_manifest_cannot_shadow(e3, tmp_path):
    with pytest.raises(ExportError, match="shadow"):
        e3.export(e3.make_draft(), tmp_path / "v", extra_manifest={"metrics": {}})
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
def test_validation_failures_write_nothing(e3, tmp_path, mutate, target_kw, match):
    d = mutate(e3.make_draft())
    with pytest.raises(ExportError, match=match):
        e3.export(d, tmp_path / "v0001", target_config=e3.target_cfg(**target_kw))
    assert list(tmp_path.iterdir()) == []


def test_weights_beyond_the_storage_dtype_are_refused_after_the_cast(e3, tmp_path):
    """Finite in float32, inf in float16 (largest finite 65504): refused in either dialect
    under its module name (checked before the speculators rename), nothing written."""
    d = e3.make_draft()
    with torch.no_grad():
        d.midlayer.mlp.up_proj.weight[0, 0] = 1e5
    for dialect in ("hf", "speculators"):
        with pytest.raises(
            ExportError, match=r"NaN/Inf\) in midlayer\.mlp\.up_proj\.weight after casting to torch\.float16$"
        ):
            e3.export(d, tmp_path / "v0001", dialect=dialect, dtype=torch.float16)
    assert list(tmp_path.iterdir()) == []
    assert e3.export(d, tmp_path / "v0001", dtype=torch.bfloat16).is_dir()  # bfloat16 holds 1e5


def test_aux_ids_must_be_capturable(e3, tmp_path):
    with pytest.raises(ExportError, match="out of range"):
        e3.export(e3.make_draft((2, 4, 8)), tmp_path / "v")  # HF index L is after the final norm
    with pytest.raises(ExportError, match="exactly 3"):
        e3.export(e3.make_draft((2, 4)), tmp_path / "v")
    assert list(tmp_path.iterdir()) == []


def test_real_llama_target_config(e3, tmp_path):
    """A transformers LlamaConfig as the target, the draft shaped by Eagle3Config.from_target."""
    from transformers import LlamaConfig

    target = LlamaConfig(
        hidden_size=24,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=e3.L,
        vocab_size=50,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
    )
    torch.manual_seed(0)
    d = Eagle3Draft(Eagle3Config.from_target(target, draft_vocab_size=20))
    d.set_vocab(torch.arange(20))
    out = export_draft(
        d,
        tmp_path / "v",
        target_config=target,
        target_name="t",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="f" * 16,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == target.bos_token_id and config["eos_token_id"] == target.eos_token_id
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config
    loaded, m = load_draft(out)
    check_compatible(m, target, "f" * 16)
    assert loaded.cfg.rope_parameters == target.rope_parameters


def test_expected_shapes_are_the_engine_state_dict(e3):
    d = e3.make_draft(e3.CUSTOM_IDS)
    assert expected_shapes(d.cfg) == {k: tuple(v.shape) for k, v in d.engine_state_dict().items()}


def test_load_refuses_an_unusable_eagle3_config(e3, tmp_path):
    out = e3.export(e3.make_draft(), tmp_path / "v0001")
    man = json.loads((out / "manifest.json").read_text())
    man["eagle3_config"]["bogus_field"] = 1
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ExportError, match=r"manifest\.json: eagle3_config unusable: .*bogus_field"):
        load_draft(out)
    del man["eagle3_config"]
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ExportError, match=r"manifest\.json: eagle3_config unusable: 'eagle3_config'$"):
        load_draft(out)
