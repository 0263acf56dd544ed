"""engines/vllm/load_check.py: our exports offered, tensor by tensor, to vLLM's own draft classes built on CPU
(Eagle3LlamaForCausalLM for both EAGLE-3 dialects; DeepSeekMTP, Qwen3NextMTP; a native MTP folder's own
MiMoMTP, Glm4MoeMTP, DeepSeekMTP).  Pins what vLLM 0.32 does with each tensor: every EAGLE-3 tensor lands; of
the Llama-block MTP exports only the MTP-specific tensors land, our Llama-shaped block does not fit either MTP
class; every tensor of a native folder lands (docs/engines.md, "Which client read which format")."""

from __future__ import annotations

import pytest
import torch

from draft_align.heads.mtp import MTPDraft
from draft_align.publish import export_draft

pytest.importorskip("vllm", reason="vllm not installed (pip install -e '.[vllm]')")

from draft_align.engines.vllm.load_check import vllm_load_isolated  # noqa: E402

N = 4  # target layers


def export(tiny_llama, tmp_path, layout):
    target = tiny_llama(N, 48, 32)
    d = MTPDraft.attach(target, depth=1, layout=layout)
    return export_draft(
        d,
        tmp_path / layout,
        target_config=target.config,
        target_name="tiny",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="fp",
        dtype=torch.float32,
    )


# the kit's default ids (left out of config.json) and explicit ones
@pytest.mark.parametrize(
    ("dialect", "aux"), [("hf", (2, 4, 5)), ("hf", (1, 2, 3)), ("speculators", (1, 2, 3))]
)
def test_eagle3_folder_through_vllm_eagle3_llama(e3, tmp_path, dialect, aux):
    out = e3.export(e3.make_draft(aux), tmp_path / "v", dialect=dialect, dtype=torch.float32)
    rep = vllm_load_isolated(out)
    accounted(rep, out)
    assert rep.vllm_class == "Eagle3LlamaForCausalLM"
    assert rep.ok, rep.problems()
    assert len(rep.landed) == 14 and rep.skipped == ["t2d"]  # vLLM skips t2d by design
    assert rep.landed["d2t"] == ["draft_id_to_target_id"]
    assert rep.aux_ids == (None if aux == e3.DEFAULT_IDS else list(aux))  # vLLM id = HF index


def accounted(rep, folder):
    import safetensors.torch

    names = set(safetensors.torch.load_file(str(folder / "model.safetensors")))
    parts = [set(rep.landed), set(rep.dropped), set(rep.skipped), set(rep.refused)]
    assert set().union(*parts) == names  # every tensor we wrote has a verdict
    assert sum(map(len, parts)) == len(names)  # exactly one


def test_deepseek_v3_layout_through_vllm_deepseek_mtp(tiny_llama, tmp_path):
    out = export(tiny_llama, tmp_path, "deepseek_v3")
    rep = vllm_load_isolated(out)
    accounted(rep, out)
    p = f"model.layers.{N}."
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head"):
        assert rep.landed[p + name + ".weight"] == [p + name + ".weight"]
    assert rep.landed[p + "mlp.gate_proj.weight"] == [p + "mtp_block.mlp.gate_up_proj.weight"]
    assert rep.landed[p + "self_attn.o_proj.weight"] == [p + "mtp_block.self_attn.o_proj.weight"]
    # deepseek_mtp.load_weights has no q/k/v → qkv_proj stacking: KeyError, and qkv_proj stays unwritten
    assert sorted(rep.refused) == [p + f"self_attn.{x}_proj.weight" for x in "kqv"]
    assert all("KeyError" in e for e in rep.refused.values())
    assert rep.unloaded == [p + "mtp_block.self_attn.qkv_proj.weight"]
    assert not rep.dropped and not rep.ok


def test_qwen3_next_layout_through_vllm_qwen3_next_mtp(tiny_llama, tmp_path):
    out = export(tiny_llama, tmp_path, "qwen3_next")
    rep = vllm_load_isolated(out)
    accounted(rep, out)
    for ours, theirs in [
        ("mtp.fc.weight", "model.fc.weight"),
        ("mtp.norm.weight", "model.norm.weight"),
        ("mtp.pre_fc_norm_embedding.weight", "model.pre_fc_norm_embedding.weight"),
        ("mtp.pre_fc_norm_hidden.weight", "model.pre_fc_norm_hidden.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ]:
        assert rep.landed[ours] == [theirs]
    # its block is sparse-MoE with a gated q_proj (2× rows) and q/k norms: our dense Llama block misses
    assert {f"mtp.layers.0.mlp.{x}_proj.weight" for x in ("gate", "up", "down")} <= set(rep.refused)
    assert "mtp.layers.0.self_attn.q_proj.weight" in rep.refused
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= set(
        rep.unloaded
    )
    assert not rep.dropped and not rep.ok


@pytest.fixture(scope="module", params=["mimo", "glm4_moe", "deepseek_v3"])
def native(request, tmp_path_factory):
    """A tiny checkpoint's own MTP layer published in the native format (what ``warmstart`` writes)."""
    from benchmarks.common.mtp_checkpoints import save_checkpoint
    from draft_align.heads.native_mtp import NativeMTPConfig, from_checkpoint
    from draft_align.publish.folder import ExportRequest
    from draft_align.publish.native_mtp_format import write_native_mtp

    cfg, tensors = save_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")
    draft = from_checkpoint(NativeMTPConfig.from_target(cfg), tensors)
    req = ExportRequest(
        target_config=cfg,
        target_name="tiny",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="fp",
        dtype=torch.float32,
    )
    out = tmp_path_factory.mktemp(request.param) / "native"
    write_native_mtp(draft, out, req)
    return request.param, out


def test_native_mtp_folder_through_the_familys_own_drafter(native):
    family, out = native
    rep = vllm_load_isolated(out)
    accounted(rep, out)
    assert (
        rep.vllm_class == {"mimo": "MiMoMTP", "glm4_moe": "Glm4MoeMTP", "deepseek_v3": "DeepSeekMTP"}[family]
    )
    assert rep.ok, rep.problems()
    assert not (rep.dropped or rep.refused or rep.unloaded)  # every tensor lands, every parameter written
    assert rep.landed["model.embed_tokens.weight"] == ["model.embed_tokens.weight"]
    # vLLM takes embedding and head from the target at engine load: reported apart, never a fault
    assert "model.embed_tokens.weight" in rep.shared
    assert any("shared with the target" in ln for ln in rep.lines())
    if family == "mimo":  # the checkpoint's layer 0 is vLLM's layer N, q/k/v fused into qkv_proj
        p = "model.mtp_layers."
        assert rep.landed[p + "0.input_proj.weight"] == [p + "2.input_proj.weight"]
        assert rep.landed[p + "0.self_attn.q_proj.weight"] == [p + "2.mtp_block.self_attn.qkv_proj.weight"]
        assert rep.shared == ["lm_head.weight", "model.embed_tokens.weight"]
    else:  # experts one by one into the fused w13 / w2; the per-depth head copy is shared
        p = "model.layers.2."
        assert rep.landed[p + "eh_proj.weight"] == [p + "eh_proj.weight"]
        assert rep.landed[p + "mlp.experts.1.up_proj.weight"] == [
            p + "mtp_block.mlp.experts.routed_experts.w13_weight"
        ]
        assert p + "shared_head.head.weight" in rep.shared


def _rewrite(src, dst, edit):
    """A copy of the folder with its tensors edited and the manifest's sha256 left alone (vllm_load reads
    the files as they are; check_with_client verifies sha256 first)."""
    import shutil

    import safetensors.torch

    shutil.copytree(src, dst)
    tensors = safetensors.torch.load_file(str(dst / "model.safetensors"))
    safetensors.torch.save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_native_mtp_folder_with_a_renamed_or_missing_tensor_fails_naming_it(native, tmp_path):
    family, out = native
    mimo = family == "mimo"
    name = "model.mtp_layers.0.input_proj.weight" if mimo else "model.layers.2.eh_proj.weight"
    renamed = name.replace("_proj.", "_projection.")
    bad = _rewrite(
        out, tmp_path / "renamed", lambda t: {renamed if k == name else k: v for k, v in t.items()}
    )
    rep = vllm_load_isolated(bad)
    accounted(rep, bad)
    assert not rep.ok
    assert renamed in rep.dropped or renamed in rep.refused
    problems = rep.problems()
    assert any(p.startswith(renamed + ": ") for p in problems), problems
    assert all("\n" not in p for p in problems)
    gone = _rewrite(out, tmp_path / "removed", lambda t: {k: v for k, v in t.items() if k != name})
    rep = vllm_load_isolated(gone)
    vllm_param = "model.mtp_layers.2.input_proj.weight" if mimo else name
    assert rep.unloaded == [vllm_param]
    assert rep.problems() == [f"vLLM parameter {vllm_param} is never written (keeps its initial values)"]


def test_an_all_nan_folder_is_not_compatible(native, tmp_path):
    """``vllm_load`` (``--check vllm`` called as a function) reported an all-NaN MTP folder compatible: vLLM
    loads NaN without a word, and the draft then proposes garbage."""
    _, out = native
    bad = _rewrite(
        out,
        tmp_path / "nan",
        lambda t: {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in t.items()},
    )
    rep = vllm_load_isolated(bad)
    assert not rep.ok and rep.nonfinite
    assert all(p.endswith("holds NaN or Inf values") for p in rep.problems()[: len(rep.nonfinite)])


def test_native_mtp_check_with_client_reports_every_tensor(native):
    """What ``draft-align export --check vllm`` prints for a native folder: each tensor's parameter, the
    shared ones apart, no problem."""
    from draft_align.engines.client_check import check_with_client

    family, out = native
    if family != "mimo":
        pytest.skip("one family is enough for the client wrapper")
    res = check_with_client(out, "vllm", None)
    assert res.real and "MiMoMTP.load_weights" in res.ran and not res.problems
    assert "model.mtp_layers.0.input_proj.weight → model.mtp_layers.2.input_proj.weight" in res.report
    assert res.report[-1].startswith("shared with the target at engine load")
