"""publish/folder.py: a published folder appears complete or not at all, and any change to a listed file
is caught on load."""

import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from draft_align.publish import folder, load_draft
from draft_align.publish.folder import CorruptCheckpointError, ExportError


def test_existing_out_dir_refused(e3, tmp_path):
    out = e3.export(e3.make_draft(), tmp_path / "v")
    with pytest.raises(ExportError, match="already exists"):
        e3.export(e3.make_draft(seed=1), out)


# ----------------------------------------------------------------------------- corruption
def test_corrupted_byte_detected(e3, tmp_path):
    out = e3.export(e3.make_draft(), tmp_path / "v")
    w = out / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors: sha256 mismatch"):
        load_draft(out)


def test_truncated_file_detected(e3, tmp_path):
    out = e3.export(e3.make_draft(), tmp_path / "v")
    w = out / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors: .* bytes"):
        load_draft(out)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors: \d+ bytes, manifest says"):
        load_draft(out, verify=False)  # even unverified, sizes are checked: a truncated file is not loaded


def test_missing_or_broken_manifest(e3, tmp_path):
    out = e3.export(e3.make_draft(), tmp_path / "v")
    (out / "manifest.json").write_text('{"format": "draft_align.eag')
    with pytest.raises(CorruptCheckpointError, match="unparsable.*half-written or not a draft_align"):
        load_draft(out)
    (out / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="missing: half-written or not a draft_align"):
        load_draft(out)


def test_missing_listed_file(e3, tmp_path):
    out = e3.export(e3.make_draft(), tmp_path / "v")
    (out / "config.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"config\.json is listed in the manifest but missing"):
        load_draft(out)


# ----------------------------------------------------------------------------- atomicity
def test_crash_in_weight_save_leaves_nothing(e3, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        e3.export(e3.make_draft(), tmp_path / "v0001")
    assert list(tmp_path.iterdir()) == []


def test_crash_at_rename_leaves_nothing(e3, tmp_path, monkeypatch):
    def boom(src, dst):
        raise OSError("crash during rename")

    monkeypatch.setattr(folder.os, "replace", boom)
    with pytest.raises(OSError, match="crash during rename"):
        e3.export(e3.make_draft(), tmp_path / "v0001")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_swaps_in_the_new_draft(e3, tmp_path):
    out = e3.export(e3.make_draft(seed=0), tmp_path / "v")
    new = e3.make_draft(seed=1)
    e3.export(new, out, overwrite=True, draft_version=4)
    loaded, m = load_draft(out)
    assert m["draft_version"] == 4
    torch.testing.assert_close(loaded.fc.weight, new.fc.weight.to(torch.bfloat16).float())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]


def test_overwrite_crash_keeps_the_old_draft(e3, tmp_path, monkeypatch):
    out = e3.export(e3.make_draft(seed=0), tmp_path / "v")
    before = (out / "manifest.json").read_bytes()
    real = os.replace
    calls = []

    def second_fails(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:  # old → .old-*, then new → v fails
            raise OSError("crash during swap")
        return real(src, dst)

    monkeypatch.setattr(folder.os, "replace", second_fails)
    with pytest.raises(OSError, match="crash during swap"):
        e3.export(e3.make_draft(seed=1), out, overwrite=True)
    assert (out / "manifest.json").read_bytes() == before  # rolled back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]
    load_draft(out)


# --------------------------------------------------------------------------------------- sizes first, no links out
def _refuse_hashing(path):
    """In place of folder.digest: a check that hashes before it looks at sizes fails here at once (instead of
    reading gigabytes of a sparse file)."""
    raise AssertionError(f"{path} hashed before its size was checked")


@pytest.mark.parametrize("manifest_agrees", [False, True])
def test_a_huge_weights_file_is_refused_by_its_size_before_any_hashing(
    e3, tmp_path, monkeypatch, manifest_agrees
):
    import json

    from draft_align.engines.client_check import check_with_client

    out = e3.export(e3.make_draft(), tmp_path / "v")
    os.truncate(out / "model.safetensors", 8 << 30)  # 8 GiB, sparse
    if manifest_agrees:  # re-listed at its new size: only the head config can tell
        man = json.loads((out / "manifest.json").read_text())
        man["files"]["model.safetensors"]["bytes"] = 8 << 30
        (out / "manifest.json").write_text(json.dumps(man))
    monkeypatch.setattr(folder, "digest", _refuse_hashing)
    why = "the head config implies" if manifest_agrees else "8589934592 bytes, manifest says"
    for verify in (True, False):
        with pytest.raises(CorruptCheckpointError, match=why):
            load_draft(out, verify=verify)
    with pytest.raises(CorruptCheckpointError, match=why):  # `export --check`'s first step
        check_with_client(out, "vllm", e3.target_cfg())


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "manifest.json"])
def test_a_file_linked_out_of_the_folder_is_refused(e3, tmp_path, name):
    from draft_align.engines.client_check import check_with_client

    out = e3.export(e3.make_draft(), tmp_path / "v")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / name).rename(elsewhere / name)  # the very same bytes, outside: sha256 and size still match
    (out / name).symlink_to(elsewhere / name)
    for verify in (True, False):
        with pytest.raises(CorruptCheckpointError, match=f"{name} is a link to .*outside .*refused"):
            load_draft(out, verify=verify)
    with pytest.raises(CorruptCheckpointError, match="outside"):
        check_with_client(out, "vllm", e3.target_cfg())


def test_a_link_inside_the_folder_is_followed(e3, tmp_path):
    out = e3.export(e3.make_draft(), tmp_path / "v")
    (out / "model.safetensors").rename(out / "blob")
    (out / "model.safetensors").symlink_to("blob")
    draft, _ = load_draft(out)
    assert draft.cfg == e3.make_draft().cfg


# ----------------------------------------------------------------------------- config.json vs the weights
def _edit_config_and_rehash(out: Path, edit) -> None:
    """What an operator (or an attacker with write access) does: config.json edited, its size and sha256 put
    back into the manifest so that every hash verifies."""
    import hashlib
    import json

    cpath = out / "config.json"
    config = json.loads(cpath.read_text())
    edit(config)
    cpath.write_text(json.dumps(config))
    man = json.loads((out / "manifest.json").read_text())
    data = cpath.read_bytes()
    man["files"]["config.json"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (out / "manifest.json").write_text(json.dumps(man))


@pytest.mark.parametrize("dialect", ["hf", "speculators"])
@pytest.mark.parametrize(
    ("key", "value"),
    [("vocab_size", 51), ("hidden_size", 48), ("draft_vocab_size", 21), ("num_attention_heads", "4")],
)
def test_a_rehashed_config_json_that_no_longer_fits_the_weights_is_refused(e3, tmp_path, dialect, key, value):
    """config.json is what the engines build the draft from: edited to another vocabulary or hidden size and
    re-hashed, every sha256 verifies, but it no longer describes the weights: loading refuses it in one line."""
    out = e3.export(e3.make_draft(), tmp_path / "v", dialect=dialect)
    load_draft(out)  # as exported: loads
    block = key not in ("draft_vocab_size",) and dialect == "speculators"

    def edit(config):
        (config["transformer_layer_config"] if block else config)[key] = value

    _edit_config_and_rehash(out, edit)
    folder.read_manifest(out)  # every hash verifies
    with pytest.raises(
        CorruptCheckpointError, match=rf"config\.json: {key} is {value}, the weights say \d+: "
    ):
        load_draft(out)
