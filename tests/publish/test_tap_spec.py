"""publish/tap_spec.py: what to tap, read from the manifest and the d2t tensor alone, verified."""

import pytest
import torch

from draft_align.publish import load_draft
from draft_align.publish.folder import CorruptCheckpointError
from draft_align.publish.tap_spec import TapSpec, read_tap_spec
from draft_align.publish.versions import version_dir, write_latest


@pytest.mark.parametrize("dialect", ["hf", "speculators"])
def test_equals_the_loaded_draft(e3, tmp_path, dialect):
    out = e3.export(e3.make_draft(e3.CUSTOM_IDS), tmp_path / "v0003", dialect=dialect)
    spec = read_tap_spec(out)
    draft, manifest = load_draft(out)
    assert isinstance(spec, TapSpec)
    assert spec.kind == draft.kind == "eagle3" and spec.format == manifest["format"]
    assert spec.aux_layer_ids == tuple(draft.cfg.aux_layer_ids) == e3.CUSTOM_IDS
    assert spec.draft_to_target.dtype == torch.int64
    assert torch.equal(spec.draft_to_target, draft.draft_to_target)
    assert spec.draft_to_target.tolist() == list(range(3, 43, 2))
    assert (spec.draft_version, spec.policy_version) == (3, 7)


def test_reads_a_run_folder_latest(e3, tmp_path):
    run = tmp_path / "run"
    out = e3.export(e3.make_draft(), version_dir(run, 1), draft_version=1)
    write_latest(run, out)
    assert read_tap_spec(run).aux_layer_ids == e3.DEFAULT_IDS


def test_tampered_weights_are_refused(e3, tmp_path):
    out = e3.export(e3.make_draft(), tmp_path / "v")
    sd_path = out / "model.safetensors"
    import safetensors.torch

    sd = safetensors.torch.load_file(str(sd_path))
    sd["d2t"] = torch.flip(sd["d2t"], (0,))  # another vocab map, same shape and size
    safetensors.torch.save_file(sd, str(sd_path), metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match="sha256 mismatch"):
        read_tap_spec(out)
    sd_path.write_bytes(sd_path.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match="bytes"):
        read_tap_spec(out)


@pytest.mark.parametrize("layout", ["deepseek_v3", "qwen3_next"])
def test_an_mtp_draft_taps_the_final_hidden_over_the_full_vocabulary(tiny_llama, tmp_path, layout):
    from draft_align.heads.mtp import MTPDraft
    from draft_align.publish import export_draft

    target = tiny_llama(4, 48, 32)
    out = export_draft(
        MTPDraft.attach(target, depth=1, layout=layout),
        tmp_path / "v",
        target_config=target.config,
        target_name="tiny",
        metrics={},
        draft_version=2,
        policy_version=1,
        tokenizer_fingerprint="fp",
    )
    spec = read_tap_spec(out)
    assert (spec.kind, spec.format, spec.aux_layer_ids) == ("llama_block_mtp", "draft_align.mtp", (4,))
    assert torch.equal(spec.draft_to_target, torch.arange(48))
    assert (spec.draft_version, spec.policy_version) == (2, 1)
