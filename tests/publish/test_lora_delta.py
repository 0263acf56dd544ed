"""publish/lora_delta.py: adapter-only deltas over a published base (EAGLE-3 and MTP) rebuild the merged
engine weights to the recorded sha256; deltas for another base, or tampered ones, are refused."""

from __future__ import annotations

import json

import pytest
import torch

from draft_align.heads.lora import AdapterMismatchError, LoraSettings, apply_lora
from draft_align.publish import engine_sha256, export_draft, load_draft
from draft_align.publish.folder import read_manifest
from draft_align.publish.lora_delta import ADAPTER_FILE, export_adapter, load_adapter, publish_adapter
from tests.helpers import perturb_adapters, random_draft

V, H, L = 48, 32, 6


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(L, V, H).requires_grad_(False)


def publish(d, path, target, dtype=torch.bfloat16, version=1):
    return export_draft(
        d,
        path,
        target_config=target.config,
        target_name="tiny",
        metrics={},
        draft_version=version,
        policy_version=0,
        tokenizer_fingerprint="fp",
        dtype=dtype,
    )


# ---------------------------------------------------------------- adapter-only deltas
@pytest.fixture(params=["eagle3", "llama_block_mtp"])
def published_base(request, target, tmp_path):
    """A base draft published in bf16 and the LoRA draft trained over it (loaded back from the folder)."""
    d = random_draft(request.param, target)
    base_dir = publish(d, tmp_path / "base" / "v0001", target)
    base, _ = load_draft(base_dir)
    apply_lora(base, LoraSettings(rank=2, alpha=4.0, target_modules=("q_proj", "gate_proj")))
    perturb_adapters(base, scale=0.05)
    return request.param, base_dir, base


def test_delta_round_trip_matches_sha(target, tmp_path, published_base):
    kind, base_dir, lora_draft = published_base
    info = export_adapter(
        lora_draft, tmp_path / "adapters" / "v0002", base_dir, draft_version=2, policy_version=3
    )
    man = json.loads((info.path / "manifest.json").read_text())
    assert man["base"]["sha256"] == read_manifest(base_dir)["files"]["model.safetensors"]["sha256"]
    assert man["lora"]["rank"] == 2 and man["merged_sha256"] == info.merged_sha256
    full = publish(lora_draft, tmp_path / "full" / "v0002", target, version=2)  # the merged publish
    full_sha = read_manifest(full)["files"]["model.safetensors"]["sha256"]
    assert info.merged_sha256 == full_sha  # delta + base rebuilds exactly the merged engine weights
    assert info.bytes < 0.5 * (full / "model.safetensors").stat().st_size
    rebuilt, man2 = load_adapter(info.path, base_dir)
    assert engine_sha256(rebuilt) == full_sha and man2["draft_version"] == 2
    out = publish_adapter(
        info.path,
        base_dir,
        tmp_path / "pub" / "v0002",
        target_config=target.config,
        target_name="tiny",
        tokenizer_fingerprint="fp",
    )
    assert read_manifest(out)["files"]["model.safetensors"]["sha256"] == full_sha
    assert read_manifest(out)["lora_delta"]["base_sha256"] == man["base"]["sha256"]


def test_delta_for_another_base_is_refused(target, tmp_path, published_base):
    kind, base_dir, lora_draft = published_base
    info = export_adapter(
        lora_draft, tmp_path / "adapters" / "v0002", base_dir, draft_version=2, policy_version=0
    )
    other = random_draft(kind, target, seed=9)
    other_dir = publish(other, tmp_path / "other" / "v0001", target)
    with pytest.raises(AdapterMismatchError, match="trained over base draft sha256"):
        load_adapter(info.path, other_dir)
    dest = tmp_path / "pub" / "v0002"
    with pytest.raises(AdapterMismatchError):
        publish_adapter(
            info.path,
            other_dir,
            dest,
            target_config=target.config,
            target_name="t",
            tokenizer_fingerprint="fp",
        )
    assert not dest.exists()
    assert not (tmp_path / "pub").exists() or not any((tmp_path / "pub").iterdir())  # no temp folder left
    with pytest.raises(AdapterMismatchError, match="trained over another base"):  # export checks its base too
        export_adapter(
            lora_draft, tmp_path / "adapters" / "v0003", other_dir, draft_version=3, policy_version=0
        )
    assert not (tmp_path / "adapters" / "v0003").exists()
    # a tampered adapter file, or a tampered recorded merge, is refused as well
    data = bytearray((info.path / ADAPTER_FILE).read_bytes())
    data[-1] ^= 1
    (info.path / ADAPTER_FILE).write_bytes(bytes(data))
    with pytest.raises(AdapterMismatchError, match="corrupt"):
        load_adapter(info.path, base_dir)


def test_recorded_merge_sha_is_checked(tmp_path, published_base):
    _, base_dir, lora_draft = published_base
    info = export_adapter(lora_draft, tmp_path / "a" / "v0002", base_dir, draft_version=2, policy_version=0)
    mpath = info.path / "manifest.json"
    man = json.loads(mpath.read_text())
    man["merged_sha256"] = "0" * 64
    mpath.write_text(json.dumps(man))
    with pytest.raises(AdapterMismatchError, match="hash to"):
        load_adapter(info.path, base_dir)
