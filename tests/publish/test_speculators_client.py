"""publish/speculators.py against the real speculators library (0.9): our speculators-dialect export loads
with its own ``SpeculatorModel.from_pretrained`` and its Eagle3 forward gives our draft logits at every
TTT step; a draft that speculators saved imports into draft_align and re-exports to the same tensors."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from transformers import AutoConfig

from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.publish import export_draft, load_draft

pytest.importorskip("speculators", reason="speculators not installed (pip install -e '.[speculators]')")

from draft_align.publish.speculators import (  # noqa: E402
    compare_tensors,
    import_speculators,
    speculators_load,
    speculators_step_logits,
)

pytestmark = pytest.mark.usefixtures("one_thread")
AUX = (1, 3, 4)  # the tiny target has 6 layers (tests/conftest.py)
STEPS = 4


def our_draft(target_config, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    d = Eagle3Draft(Eagle3Config.from_target(target_config, draft_vocab_size=40, aux_layer_ids=AUX))
    for name, p in d.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3 if "norm" in name else 0.15)
    d.set_vocab(torch.arange(3, 83, 2))
    return d.eval()


def export_spec(d, target_dir, out, dtype=torch.float32):
    tc = AutoConfig.from_pretrained(target_dir)
    return export_draft(
        d,
        out,
        dialect="speculators",
        target_config=tc,
        target_name=str(target_dir),
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="fp",
        dtype=dtype,
    )


@pytest.fixture(scope="module")
def target(tiny_world):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_world.model).eval()


def test_our_export_loads_and_every_tensor_lands(tiny_world, target, tmp_path):
    d = our_draft(target.config)
    out = export_spec(d, tiny_world.model, tmp_path / "spec", dtype=torch.bfloat16)
    model, rep = speculators_load(out)
    assert rep.model_class == "Eagle3DraftModel"
    assert rep.ok, (rep.missing, rep.differ, rep.problems)
    assert len(rep.landed) == 15 and not rep.missing  # every tensor we wrote is one of its parameters/buffers
    assert rep.aux_ids == list(AUX)  # speculators' ids = HF hidden_states indices = vLLM's
    emb = model.embed_tokens.weight
    assert torch.equal(
        emb, target.model.embed_tokens.weight.to(emb.dtype)
    )  # the verifier's, after the reload
    assert model.config.norm_before_residual is False


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_same_draft_logits_every_ttt_step(tiny_world, target, tmp_path, attn):
    """fp32 export; speculators' forward (teacher-forced TTT) vs our unroll on the same aux states and
    tokens: max |Δlogit| ≤ 1e-5 at every step (measured 1.1e-6 – 2.7e-6 on logits up to 4.6)."""
    d = our_draft(target.config, seed=1)
    out = export_spec(d, tiny_world.model, tmp_path / "spec")
    model, _ = speculators_load(out, attn_implementation=attn)
    ours, _ = load_draft(out)
    t = 24
    torch.manual_seed(2)
    aux = torch.randn(1, t, 3 * target.config.hidden_size)
    x = torch.randint(0, target.config.vocab_size, (1, t))
    theirs = speculators_step_logits(model, aux, x, STEPS)
    with torch.no_grad():
        mine = ours.unroll(
            aux,
            target.model.embed_tokens,
            x,
            torch.ones(1, t, dtype=torch.bool),
            torch.arange(t).unsqueeze(0),
            torch.ones(1, t, dtype=torch.bool),
            STEPS,
        )
    assert len(theirs) == STEPS
    for j in range(STEPS):
        n = t - 1 - j  # positions whose step-j token exists (speculators pads with 0 where we clamp)
        a, b = theirs[j][0, :n], mine[j][0, :n]
        assert b.abs().max() > 1.0  # logits of a real size, not a vacuous comparison
        assert (a - b).abs().max().item() <= 1e-5, f"step {j}: max |Δ| {(a - b).abs().max().item():.3g}"
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_speculators_saved_draft_imports_and_reexports_same_tensors(tiny_world, target, tmp_path):
    """speculators' own construction (``from_training_args``) and save path (``save_pretrained``)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    d = our_draft(target.config, seed=3)  # only its vocabulary map is reused
    vc = AutoConfig.from_pretrained(tiny_world.model)
    vc.num_hidden_layers = 1  # speculators' train CLI builds the draft layer config with num_layers
    torch.manual_seed(4)
    m = Eagle3DraftModel.from_training_args(
        vc,
        t2d=d.t2d.clone(),
        d2t=d.d2t.clone(),
        draft_vocab_size=40,
        norm_before_residual=False,
        ttt_steps=3,
        verifier_name_or_path=str(tiny_world.model),
        target_layer_ids=list(AUX),
        draft_attn_impl="eager",
    )
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_")):
                p.normal_(std=0.2)
    m.save_pretrained(tmp_path / "theirs")
    saved = safetensors.torch.load_file(str(tmp_path / "theirs" / "model.safetensors"))
    assert "embed_tokens.weight" in saved  # speculators saves its copy of the target's embedding

    imported = import_speculators(tmp_path / "theirs", target.config)
    assert imported.cfg.aux_layer_ids == AUX and imported.cfg.draft_vocab_size == 40
    again = export_spec(imported, tiny_world.model, tmp_path / "ours")
    reexported = safetensors.torch.load_file(str(again / "model.safetensors"))
    expect = {k: v for k, v in saved.items() if k != "embed_tokens.weight"}
    assert compare_tensors(expect, reexported) == []
    # and the re-export loads back into speculators with the same tensors in place
    _, rep = speculators_load(again)
    assert rep.ok and len(rep.landed) == 15


def test_import_refuses_forward_flags(tiny_world, target, tmp_path):
    from draft_align.publish.folder import ExportError

    out = export_spec(our_draft(target.config), tiny_world.model, tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    cfg["norm_before_residual"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="norm_before_residual"):
        import_speculators(out, target.config)
