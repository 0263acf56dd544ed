"""check_sglang_compatible: a real export passes, each way of breaking SGLang's loader is reported."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from torch import nn

from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.publish import export_draft
from draft_align.publish.sglang import (
    check_sglang_compatible,
    expected_shapes,
    sglang_capture,
    sglang_default_capture,
)

L = 8  # target layers: engine default aux ids (2, 4, 5)
DEFAULT_IDS = (2, 4, 5)
CUSTOM_IDS = (1, 2, 3)
H = 32  # draft hidden == target hidden: SGLang shares the target's embedding only then


def target_cfg(**kw):
    base = dict(
        num_hidden_layers=L,
        hidden_size=H,
        vocab_size=50,
        max_position_embeddings=128,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    base.update(kw)
    return SimpleNamespace(**base)


def make_draft(aux=DEFAULT_IDS, **kw) -> Eagle3Draft:
    base = dict(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=50,
        draft_vocab_size=20,
        target_hidden_size=H,
        aux_layer_ids=aux,
        target_num_layers=L,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    base.update(kw)
    torch.manual_seed(0)
    d = Eagle3Draft(Eagle3Config(**base))
    for p in d.parameters():
        nn.init.normal_(p, std=0.3)
    d.set_vocab(torch.arange(3, 43, 2))
    return d


def export(out: Path, aux=DEFAULT_IDS, dialect="hf", target=None, **kw) -> Path:
    return export_draft(
        make_draft(aux, **kw),
        out,
        dialect=dialect,
        target_config=target or target_cfg(),
        target_name="tiny/target",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="0123456789abcdef",
    )


def edit_config(d: Path, fn) -> None:
    c = json.loads((d / "config.json").read_text())
    fn(c)
    (d / "config.json").write_text(json.dumps(c))


def edit_weights(d: Path, fn) -> None:
    sd = safetensors.torch.load_file(str(d / "model.safetensors"))
    fn(sd)
    safetensors.torch.save_file(sd, str(d / "model.safetensors"))


def one(problems: list[str], *words: str) -> None:
    """Exactly the expected problem(s) and nothing else: every problem mentions all ``words``."""
    assert problems, "the checker found nothing"
    for p in problems:
        assert all(w in p for w in words), (words, problems)


# ----------------------------------------------------------------------------- what passes
@pytest.mark.parametrize("aux", [DEFAULT_IDS, CUSTOM_IDS])
def test_exported_hf_draft_passes(tmp_path, aux):
    out = export(tmp_path / "v0001", aux)
    assert check_sglang_compatible(out) == []
    assert check_sglang_compatible(out, target_cfg()) == []


def test_exported_names_and_config_match_sglang_rules(tmp_path):
    out = export(tmp_path / "v0001", CUSTOM_IDS)
    c = json.loads((out / "config.json").read_text())
    sd = safetensors.torch.load_file(str(out / "model.safetensors"))
    shapes = expected_shapes(c)
    assert {k: tuple(v.shape) for k, v in sd.items()} == shapes
    assert shapes["fc.weight"] == (H, 3 * H) and shapes["midlayer.self_attn.q_proj.weight"] == (32, 2 * H)
    assert shapes["lm_head.weight"] == (20, H) and shapes["d2t"] == (20,) and shapes["t2d"] == (50,)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1
    assert c["draft_vocab_size"] == 20 and c["target_hidden_size"] == c["hidden_size"] == H
    assert c["tie_word_embeddings"] is False and c["norm_before_residual"] is False
    # SGLang reads eagle_config ids and captures id + 1; vLLM reads the top-level key as HF indices.
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert sglang_capture(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == list(CUSTOM_IDS)
    assert c["eagle_aux_hidden_state_layer_ids"] == list(CUSTOM_IDS)
    # Default ids: nothing written, SGLang's default equals what the draft was trained on.
    out2 = export(tmp_path / "v0002", DEFAULT_IDS)
    c2 = json.loads((out2 / "config.json").read_text())
    assert "eagle_config" not in c2 and "eagle_aux_hidden_state_layer_ids" not in c2
    assert sglang_default_capture(L) == list(DEFAULT_IDS)


def test_sglang_capture_index_is_hf_hidden_states_index():
    """SGLang captures `hidden_states + residual` before running layer i (llama.py LlamaModel.forward):
    on an HF Llama that is the input of decoder layer i == output_hidden_states[i]."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=40,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(cfg).eval()
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen.__setitem__(i, (a[0] if a else kw["hidden_states"])), with_kwargs=True
        )
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        hs = model(torch.arange(1, 9)[None], output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    for sglang_id in (0, 1, 2, 4):
        captured = seen[sglang_id + 1]  # set_eagle3_layers_to_capture: layers_to_capture = id + 1
        (k,) = sglang_capture([sglang_id])
        torch.testing.assert_close(captured, hs[k], rtol=0, atol=0)
        assert not torch.equal(captured, hs[sglang_id])  # the off-by-one would be visible


# ----------------------------------------------------------------------------- what fails
def test_renamed_tensor_is_reported(tmp_path):
    out = export(tmp_path / "v", DEFAULT_IDS)
    edit_weights(
        out,
        lambda sd: sd.__setitem__("midlayer.hidden_layernorm.weight", sd.pop("midlayer.hidden_norm.weight")),
    )
    p = check_sglang_compatible(out)
    assert len(p) == 2
    assert any("midlayer.hidden_norm.weight missing" in x and "uninitialised" in x for x in p)
    assert any("unexpected tensor midlayer.hidden_layernorm.weight" in x for x in p)


def test_layers0_names_are_reported(tmp_path):
    """SGLang has no layers.0.* → midlayer.* mapping: the speculators layout loads nothing into the layer."""
    out = export(tmp_path / "v", DEFAULT_IDS)
    edit_weights(
        out,
        lambda sd: [
            sd.__setitem__("layers.0." + k[len("midlayer.") :], sd.pop(k))
            for k in list(sd)
            if k.startswith("midlayer.")
        ],
    )
    p = check_sglang_compatible(out)
    assert sum("layers.0" in x and "no layers.0.* → midlayer.* mapping" in x for x in p) == 10
    assert sum("missing" in x for x in p) == 10


def test_speculators_dialect_is_reported(tmp_path):
    out = export(tmp_path / "v", DEFAULT_IDS, dialect="speculators")
    p = check_sglang_compatible(out)
    assert any("architectures" in x and "speculators dialect" in x for x in p)
    assert any("hidden_size is None" in x for x in p)  # the layer fields are nested, SGLang reads top level


@pytest.mark.parametrize(
    "field, words",
    [
        ("draft_vocab_size", ("draft_vocab_size", "target's full lm_head")),
        ("target_hidden_size", ("target_hidden_size is missing",)),
        ("head_dim", ("head_dim",)),
        ("architectures", ("architectures",)),
    ],
)
def test_missing_config_field_is_reported(tmp_path, field, words):
    out = export(tmp_path / "v", DEFAULT_IDS)
    edit_config(out, lambda c: c.pop(field))
    p = check_sglang_compatible(out)
    assert any(all(w in x for w in words) for x in p), p


def test_missing_rope_theta_is_reported(tmp_path):
    out = export(tmp_path / "v", DEFAULT_IDS)
    edit_config(out, lambda c: (c.pop("rope_theta"), c.pop("rope_parameters")))
    one(check_sglang_compatible(out), "rope_theta", "10000")


def test_wrong_draft_vocab_size_is_reported(tmp_path):
    out = export(tmp_path / "v", DEFAULT_IDS)
    edit_config(out, lambda c: c.__setitem__("draft_vocab_size", 19))
    p = check_sglang_compatible(out)
    assert any("lm_head.weight has shape [20, 32], SGLang builds [19, 32]" in x for x in p), p
    assert any("d2t has shape [20]" in x for x in p), p


def test_d2t_of_wrong_length_is_reported(tmp_path):
    out = export(tmp_path / "v", DEFAULT_IDS)
    edit_weights(out, lambda sd: sd.__setitem__("d2t", sd["d2t"][:19].clone()))
    one(check_sglang_compatible(out), "d2t has shape [19]", "[20]")


def test_bad_d2t_values_and_dtype_are_reported(tmp_path):
    out = export(tmp_path / "v", DEFAULT_IDS)
    edit_weights(out, lambda sd: sd["d2t"].__setitem__(1, sd["d2t"][0] - 1))  # draft 1 → same target as 0
    one(check_sglang_compatible(out), "same target id")
    edit_weights(out, lambda sd: sd["d2t"].__setitem__(19, 100))
    assert any("outside the target vocab" in x for x in check_sglang_compatible(out))
    edit_weights(out, lambda sd: sd.__setitem__("d2t", sd["d2t"].to(torch.int32)))
    assert any("d2t has dtype I32" in x for x in check_sglang_compatible(out))


def test_aux_ids_in_hf_convention_are_reported(tmp_path):
    """Writing HF indices (vLLM's convention) into eagle_config shifts SGLang's capture by one layer."""
    out = export(tmp_path / "v", CUSTOM_IDS)
    edit_config(out, lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [1, 2, 3]))
    p = check_sglang_compatible(out)
    assert any("aux ids disagree" in x for x in p), p
    assert any("wrong aux layers" in x and "[2, 3, 4]" in x and "[1, 2, 3]" in x for x in p), p


def test_top_level_ids_without_eagle_config_are_reported(tmp_path):
    out = export(tmp_path / "v", CUSTOM_IDS)
    edit_config(out, lambda c: c.pop("eagle_config"))
    p = check_sglang_compatible(out)
    assert any("never reads the top-level key" in x for x in p), p
    assert any("wrong aux layers" in x and "default" in x and "[2, 4, 5]" in x for x in p), p


def test_default_ids_on_another_depth_are_reported(tmp_path):
    """No ids in config: SGLang's default follows the serving target's depth, not the training target's."""
    out = export(tmp_path / "v", DEFAULT_IDS)
    assert check_sglang_compatible(out, target_cfg(num_hidden_layers=12)) == [
        "wrong aux layers: SGLang captures HF hidden_states [2, 6, 9] (its default (2, L//2, L-3)) but the "
        "draft was trained on [2, 4, 5]"
    ]


def test_uncapturable_or_duplicate_ids_are_reported(tmp_path):
    out = export(tmp_path / "v", CUSTOM_IDS)
    edit_config(
        out,
        lambda c: (
            c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [0, 1, 7]),
            c.pop("eagle_aux_hidden_state_layer_ids"),
        ),
    )
    assert any("never fires" in x and "[8]" in x for x in check_sglang_compatible(out))
    edit_config(out, lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [0, 1, 1]))
    assert any("distinct and ascending" in x for x in check_sglang_compatible(out))


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("tie_word_embeddings", True, ("tie_word_embeddings",)),
        ("num_hidden_layers", 2, ("num_hidden_layers",)),
        ("norm_before_residual", True, ("norm_before_residual",)),
        ("bias", True, ("bias",)),
    ],
)
def test_unsupported_config_values_are_reported(tmp_path, key, value, words):
    out = export(tmp_path / "v", DEFAULT_IDS)
    edit_config(out, lambda c: c.__setitem__(key, value))
    one(check_sglang_compatible(out), *words)


def test_hidden_size_differing_from_target_is_reported(tmp_path):
    """SGLang's set_embed refuses to share the target embedding then: the draft embeds with garbage."""
    out = export(tmp_path / "v", DEFAULT_IDS, target=target_cfg(hidden_size=24), target_hidden_size=24)
    one(check_sglang_compatible(out), "hidden_size 32 != target_hidden_size 24", "set_embed")


def test_target_mismatch_is_reported(tmp_path):
    out = export(tmp_path / "v", DEFAULT_IDS)
    p = check_sglang_compatible(out, target_cfg(vocab_size=64, max_position_embeddings=4096))
    assert any("vocab_size 50 != target vocab_size 64" in x for x in p), p
    assert any("max_position_embeddings 128 < the target's 4096" in x for x in p), p


def test_missing_files_are_reported(tmp_path):
    assert check_sglang_compatible(tmp_path) == [f"{tmp_path / 'config.json'} is missing"]
    out = export(tmp_path / "v", DEFAULT_IDS)
    (out / "model.safetensors").unlink()
    one(check_sglang_compatible(out), "model.safetensors is missing")


# ----------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("target_hidden, rc", [(H, 0), (24, 1)])
def test_cli_export_check_sglang(tmp_path, monkeypatch, capsys, target_hidden, rc):
    from draft_align import cli
    from draft_align.cli import draft_commands
    from draft_align.publish import compat

    target = target_cfg(hidden_size=target_hidden)
    draft = make_draft(DEFAULT_IDS, target_hidden_size=target_hidden)
    manifest = {"target": {"name": "tiny/target"}, "metrics": {}, "draft_version": 1, "policy_version": 0}
    monkeypatch.setattr(
        draft_commands,
        "_load_target_and_draft",
        lambda t, d: (SimpleNamespace(config=target), None, draft, manifest, d),
    )
    monkeypatch.setattr(compat, "tokenizer_fingerprint", lambda tok: "0123456789abcdef")
    out = tmp_path / "hf"
    assert cli.main(["export", "--draft", "src", "--out", str(out), "--check", "sglang"]) == rc
    text = capsys.readouterr().out
    assert ("sglang: compatible" in text) == (rc == 0)
    assert ("set_embed" in text) == (rc == 1)
