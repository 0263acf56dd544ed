"""publish/versions.py: version folders, the ``latest`` pointer, leftovers of killed publishes, and
publish_version (the one publish both loops use)."""

import hashlib
import logging

import pytest
import torch

from draft_align.heads.lora import AdapterMismatchError, LoraSettings, apply_lora
from draft_align.publish import load_draft
from draft_align.publish.folder import ExportError, read_manifest
from draft_align.publish.lora_delta import load_adapter, read_delta_manifest
from draft_align.publish.versions import (
    Published,
    adapter_dir,
    discard_tmp_versions,
    next_version,
    publish_version,
    read_latest,
    resolve_draft_dir,
    run_version_dir,
    version_dir,
    write_latest,
)


def test_versions_and_latest_pointer(e3, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert read_latest(run) is None
    assert next_version(run) == 1
    v1 = e3.export(e3.make_draft(), version_dir(run, next_version(run)))
    assert v1 == run / "drafts" / "v0001"
    write_latest(run, v1)
    assert (run / "latest").read_text() == "drafts/v0001\n"
    assert read_latest(run) == v1
    assert next_version(run) == 2
    v2 = e3.export(e3.make_draft(seed=1), version_dir(run, 2), draft_version=2)
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


def test_latest_and_version_folders_never_lead_out_of_the_run(e3, tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    v1 = e3.export(e3.make_draft(), version_dir(run, 1))
    outside = e3.export(e3.make_draft(seed=1), version_dir(elsewhere, 2), draft_version=2)
    version_dir(run, 2).symlink_to(outside, target_is_directory=True)
    (run / "latest").write_text("drafts/v0002\n")
    with pytest.raises(ExportError, match="outside"):
        read_latest(run)
    with pytest.raises(ExportError, match="link out of the run"):
        run_version_dir(run, version_dir(run, 2))
    with pytest.raises(ExportError, match="link out of the run"):
        run_version_dir(run, outside, 2)  # a notification naming another run's folder
    with pytest.raises(ExportError, match="link out of the run"):
        run_version_dir(run, v1, 2)  # a version that is not the folder's
    with pytest.raises(ExportError, match="does not exist"):
        run_version_dir(run, version_dir(run, 3))
    (tmp_path / "alias").symlink_to(run)  # a link above the run folder is the run folder itself
    assert run_version_dir(run, tmp_path / "alias" / "drafts" / "v0001") == v1 == run_version_dir(run, v1)


def test_discard_tmp_versions(e3, tmp_path):
    run = tmp_path / "run"
    v1 = e3.export(e3.make_draft(), version_dir(run, 1))
    (run / "drafts" / ".tmp-v0002-killed").mkdir()
    (run / "drafts" / ".tmp-v0002-killed" / "model.safetensors").write_bytes(b"half")
    discard_tmp_versions(run)
    assert sorted(p.name for p in (run / "drafts").iterdir()) == ["v0001"]
    load_draft(v1)
    discard_tmp_versions(tmp_path / "nothing-here")  # no drafts folder: nothing to do


# ----------------------------------------------------------------------------- publish_version
def publish(e3, run, draft, **kw):
    args = dict(
        target_config=e3.target_cfg(),
        target_name="tiny/target",
        tokenizer_fingerprint="0123456789abcdef",
        metrics={"gate_diff": 0.25},
        policy_version=7,
    )
    args.update(kw)
    return publish_version(run, draft, **args)


def test_publish_version_numbers_latest_and_sha(e3, tmp_path):
    run = tmp_path / "run"
    p1 = publish(e3, run, e3.make_draft(seed=0))
    assert isinstance(p1, Published) and p1.version == 1 and p1.path == version_dir(run, 1)
    assert read_latest(run) == p1.path and p1.delta_path is None
    assert p1.weights_sha256 == hashlib.sha256((p1.path / "model.safetensors").read_bytes()).hexdigest()
    assert p1.manifest == read_manifest(p1.path)  # what was written, files and hashes included
    assert p1.manifest["draft_version"] == 1 and p1.manifest["policy_version"] == 7
    assert p1.manifest["metrics"] == {"gate_diff": 0.25}
    p2 = publish(e3, run, e3.make_draft(seed=1), extra_manifest={"run": "r"})
    assert p2.version == 2 and read_latest(run) == p2.path and p2.manifest["run"] == "r"
    assert p2.weights_sha256 != p1.weights_sha256
    p5 = publish(e3, run, e3.make_draft(seed=2), at_least=5)  # the sidecar's own count may run ahead
    assert p5.version == 5 and p5.path == version_dir(run, 5) and next_version(run) == 6
    assert resolve_draft_dir(run) == p5.path
    assert not (run / "adapters").exists()


def test_publish_version_refuses_before_touching_latest(e3, tmp_path):
    run = tmp_path / "run"
    p1 = publish(e3, run, e3.make_draft())
    with pytest.raises(ExportError, match="hidden size mismatch"):
        publish(e3, run, e3.make_draft(), target_config=e3.target_cfg(hidden_size=16))
    assert read_latest(run) == p1.path and next_version(run) == 2


@pytest.fixture
def lora_over_base(e3, tmp_path):
    """A base draft published at base/drafts/v0001 and a LoRA draft trained (perturbed) over it."""
    base_dir = publish(e3, tmp_path / "base", e3.make_draft()).path
    draft, _ = load_draft(base_dir)
    apply_lora(draft, LoraSettings(rank=2, alpha=4.0, target_modules=("q_proj", "down_proj")))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if "lora_" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return base_dir, draft


def test_publish_version_writes_the_delta_only_when_asked(e3, tmp_path, lora_over_base):
    base_dir, draft = lora_over_base
    run = tmp_path / "run"
    plain = publish(e3, run, draft)
    assert plain.delta_path is None and not (run / "adapters").exists()
    pub = publish(e3, run, draft, delta_base=base_dir)
    assert pub.version == 2 and pub.delta_path == adapter_dir(run, 2) == run / "adapters" / "v0002"
    man = read_delta_manifest(pub.delta_path)
    assert man["draft_version"] == 2 and man["policy_version"] == 7 and man["metrics"] == {"gate_diff": 0.25}
    assert man["merged_sha256"] == pub.weights_sha256 == plain.weights_sha256  # delta + base = the version
    rebuilt, _ = load_adapter(pub.delta_path, base_dir)
    assert read_latest(run) == pub.path


def test_publish_version_delta_for_another_base(e3, tmp_path, lora_over_base, caplog):
    _, draft = lora_over_base
    other = publish(e3, tmp_path / "other", e3.make_draft(seed=9)).path
    run = tmp_path / "run"
    with pytest.raises(AdapterMismatchError, match="another base"):
        publish(e3, run, draft, delta_base=other)
    assert read_latest(run) == version_dir(run, 1)  # the version itself was published first
    with caplog.at_level(logging.WARNING, logger="draft_align.publish.versions"):
        pub = publish(e3, run, draft, delta_base=other, strict_delta=False)
    assert pub.version == 2 and pub.delta_path is None and read_latest(run) == pub.path
    assert "adapter delta v0002 not published" in caplog.text
    assert not adapter_dir(run, 2).exists()


# ----------------------------------------------------------------------------- hostile folders, full disks
def test_latest_that_is_not_text_or_a_directory_is_a_one_line_export_error(e3, tmp_path):
    run = tmp_path / "run"
    publish(e3, run, e3.make_draft())
    (run / "latest").write_bytes(b"drafts/v\xff\xfe0001\n")
    with pytest.raises(ExportError, match="not UTF-8"):
        read_latest(run)
    with pytest.raises(ExportError, match="not UTF-8"):
        resolve_draft_dir(run)
    (run / "latest").write_bytes(b"drafts/v0001\x00\n")
    with pytest.raises(ExportError, match="relative"):
        read_latest(run)
    (run / "latest").unlink()
    (run / "latest").mkdir()
    with pytest.raises(ExportError, match="is a directory"):
        read_latest(run)


def test_the_version_is_the_folders_name_not_the_manifests(e3, tmp_path):
    import json

    from draft_align.publish.versions import check_folder_version, folder_version

    run = tmp_path / "run"
    p1 = publish(e3, run, e3.make_draft())
    assert folder_version(p1.path) == 1 and folder_version(tmp_path) is None
    assert check_folder_version(p1.path, read_manifest(p1.path)) == 1
    forged = dict(read_manifest(p1.path), draft_version=999)
    with pytest.raises(ExportError, match="draft_version 999, the folder is version 1"):
        check_folder_version(p1.path, forged)
    with pytest.raises(ExportError, match="draft_version '1'"):
        check_folder_version(p1.path, dict(forged, draft_version="1"))
    assert check_folder_version(tmp_path, forged) is None  # a starting draft outside drafts/
    (p1.path / "manifest.json").write_text(json.dumps(forged))
    assert next_version(run) == 2  # the folder names count, not what a manifest claims


def test_prune_keeps_the_newest_and_latest(e3, tmp_path):
    from draft_align.publish.versions import prune_versions, published_versions

    run = tmp_path / "run"
    for seed in range(5):
        publish(e3, run, e3.make_draft(seed=seed))
    write_latest(run, version_dir(run, 2))  # e.g. the engine rolled back
    assert prune_versions(run, keep=2) == [3, 1]
    assert [p.name for p in published_versions(run)] == ["v0005", "v0004", "v0002"]
    assert read_latest(run) == version_dir(run, 2)
    assert prune_versions(run, keep=1, protect=(version_dir(run, 4),)) == []
    assert [p.name for p in (run / "drafts").iterdir() if p.name.startswith(".")] == []
    with pytest.raises(ValueError, match="keep"):
        prune_versions(run, keep=0)


def test_disk_full_at_publish_leaves_no_folder_and_latest_unchanged(e3, tmp_path, monkeypatch):
    import errno
    import os

    from draft_align.publish import versions

    run = tmp_path / "run"
    p1 = publish(e3, run, e3.make_draft())

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    def full_safetensors(*a, **k):  # safetensors' own error type for a full disk (not an OSError)
        from safetensors import SafetensorError

        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    for where, fail in (
        ("safetensors.torch.save_file", full_safetensors),
        ("draft_align.publish.versions.write_latest", full),
    ):
        with monkeypatch.context() as m:
            m.setattr(where, fail)
            with pytest.raises(OSError) as e:
                publish(e3, run, e3.make_draft(seed=1))
            assert e.value.errno == errno.ENOSPC
        assert read_latest(run) == p1.path
        assert sorted(os.listdir(run / "drafts")) == ["v0001"]  # no temp folder, no unannounced version
    assert versions.next_version(run) == 2


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_published_versions_are_group_readable_whatever_the_umask(e3, tmp_path, lora_over_base, umask):
    """The file-mode policy (storage.py): what engines load is 0750 folders / 0640 files, never world-readable,
    never owner-only (an engine may run as another user of the run folder's group)."""
    import os
    import stat

    def mode(p):
        return stat.S_IMODE(os.lstat(p).st_mode)

    base_dir, draft = lora_over_base
    old = os.umask(umask)
    try:
        run = tmp_path / "out" / "run"  # nothing of it exists yet
        pub = publish(e3, run, draft, delta_base=base_dir)
    finally:
        os.umask(old)
    made = [tmp_path / "out", run, run / "drafts", pub.path, run / "adapters", pub.delta_path]
    assert all(mode(p) == 0o750 for p in made), {str(p): oct(mode(p)) for p in made}
    files = [*pub.path.iterdir(), *pub.delta_path.iterdir(), run / "latest"]
    assert len(files) == 6 and all(mode(p) == 0o640 for p in files), {str(p): oct(mode(p)) for p in files}
