"""draft_align.publish.native_mtp_format: the folder vLLM's MTP drafter loads (the target's config.json, the MTP
tensors under the family's names plus the shared embedding / head), read back bit for bit; refusals in one line."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from benchmarks.common.mtp_checkpoints import family_config, mtp_names, save_checkpoint
from draft_align.heads.draft_head import DraftConfigError
from draft_align.heads.native_mtp import NativeMTPConfig, from_checkpoint
from draft_align.publish import load_draft, write_draft
from draft_align.publish.folder import ExportError, ExportRequest
from draft_align.publish.native_mtp_format import NATIVE_MTP_FORMAT, load_native_mtp, write_native_mtp

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["mimo", "glm4_moe", "deepseek_v3"])
def ckpt(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    cfg, tensors = save_checkpoint(request.param, out)
    return request.param, cfg, tensors


def request_for(cfg, **kw):
    return ExportRequest(
        target_config=cfg,
        target_name="tiny",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="none",
        dtype=torch.float32,
        **kw,
    )


def test_write_then_load_back(ckpt, tmp_path):
    family, cfg, tensors = ckpt
    draft = from_checkpoint(NativeMTPConfig.from_target(cfg), tensors)
    with torch.no_grad():
        draft.layers[0].proj.weight.add_(0.5)  # a trained head: not the checkpoint's values
    manifest = write_native_mtp(draft, tmp_path / "d", request_for(cfg))
    assert manifest["format"] == NATIVE_MTP_FORMAT and manifest["family"] == family
    written = safetensors.torch.load_file(str(tmp_path / "d" / "model.safetensors"))
    shared = {"model.embed_tokens.weight"} | ({"lm_head.weight"} if family == "mimo" else set())
    assert set(written) == mtp_names(family, tensors) | shared
    assert torch.equal(written["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == cfg.architectures and config["num_nextn_predict_layers"] == 1
    back = load_native_mtp(tmp_path / "d")
    a, b = draft.state_dict(), back.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_refuses_another_target(ckpt, tmp_path):
    family, cfg, tensors = ckpt
    draft = from_checkpoint(NativeMTPConfig.from_target(cfg), tensors)
    other = family_config("glm4_moe" if family == "mimo" else "mimo")
    with pytest.raises(ExportError, match="target config has family="):
        write_native_mtp(draft, tmp_path / "d", request_for(other))
    assert not (tmp_path / "d").exists()


def test_refuses_a_checkpoint_without_the_shared_embedding(ckpt):
    family, cfg, tensors = ckpt
    partial = {k: v for k, v in tensors.items() if k != "model.embed_tokens.weight"}
    with pytest.raises(DraftConfigError, match=r"lacks MTP tensors \['model.embed_tokens.weight'\]"):
        from_checkpoint(NativeMTPConfig.from_target(cfg), partial)


def test_the_generic_writer_and_reader_take_a_native_head(ckpt, tmp_path):
    """publish.write_draft / load_draft (what the warm-start and the sidecar call) pick the native format by
    the head's kind and the manifest's format; the sizes check passes and the head reads back bit for bit."""
    family, cfg, tensors = ckpt
    draft = from_checkpoint(NativeMTPConfig.from_target(cfg), tensors)
    manifest = write_draft(draft, tmp_path / "d", request_for(cfg))
    assert manifest["format"] == NATIVE_MTP_FORMAT
    back, man = load_draft(tmp_path / "d")
    assert back.kind == "native_mtp" and man["native_mtp_config"]["steps_run"] == "first"
    a, b = draft.state_dict(), back.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ExportError, match="dialect 'speculators'"):
        write_draft(draft, tmp_path / "e", request_for(cfg, dialect="speculators"))
