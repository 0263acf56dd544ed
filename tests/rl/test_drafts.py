import logging

import pytest
import torch

from draft_align.publish.folder import ExportError
from draft_align.publish.versions import resolve_draft_dir, version_dir
from draft_align.rl.drafts import DraftWatcher


def same_weights(a, b) -> bool:
    sa, sb = a.engine_state_dict(), b.engine_state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_before_any_publish_adapted_is_frozen(tmp_path, frozen_dir, kit, target_config):
    w = DraftWatcher(tmp_path / "run", frozen_dir)
    assert w.adapted is w.frozen and w.adapted_version == 0 and w.adapted_policy_version == 0
    assert same_weights(w.frozen, kit.make(target_config, seed=1))
    assert not any(p.requires_grad for p in w.frozen.parameters())
    assert w.refresh() is False and w.failures == 0
    assert torch.equal(w.draft_to_target, torch.arange(3, 51))


def test_frozen_path_may_be_a_run_folder(tmp_path, frozen_dir):
    assert resolve_draft_dir(frozen_dir.parent.parent) == frozen_dir
    assert DraftWatcher(tmp_path / "run", frozen_dir.parent.parent).frozen_path == frozen_dir
    with pytest.raises(ExportError, match="neither a draft folder"):
        resolve_draft_dir(tmp_path)


def test_picks_up_new_versions_and_ignores_old_ones(tmp_path, frozen_dir, kit, target_config):
    run = tmp_path / "run"
    w = DraftWatcher(run, frozen_dir)
    d1 = kit.make(target_config, seed=11)
    kit.publish(d1, run, target_config, draft_version=1, policy_version=3)
    assert w.refresh() is True
    assert (w.adapted_version, w.adapted_policy_version) == (1, 3)
    assert same_weights(w.adapted, d1) and not same_weights(w.frozen, d1)
    assert w.adapted is not w.frozen and w.refresh() is False  # nothing newer: no reload
    d3 = kit.make(target_config, seed=13)
    kit.publish(d3, run, target_config, draft_version=3, policy_version=5)
    assert w.refresh() is True and w.adapted_version == 3 and same_weights(w.adapted, d3)
    # `latest` moved back to an older version: not newer, kept v3, not a failure
    (run / "latest").write_text("drafts/v0001\n")
    assert w.refresh() is False and w.adapted_version == 3 and w.failures == 0


def test_corrupt_publish_keeps_previous_draft(tmp_path, frozen_dir, kit, target_config, caplog):
    run = tmp_path / "run"
    w = DraftWatcher(run, frozen_dir)
    kit.publish(kit.make(target_config, seed=11), run, target_config, 1, 1)
    assert w.refresh()
    before = w.adapted
    bad = kit.publish(kit.make(target_config, seed=12), run, target_config, 2, 2)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated after `latest` already points at it
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.drafts"):
        assert w.refresh() is False
    assert "keeping draft v0001" in caplog.text and "bytes" in caplog.text
    assert (
        w.adapted is before and w.adapted_version == 1 and w.adapted_policy_version == 1 and w.failures == 1
    )
    assert w.refresh() is False and w.failures == 1  # the same broken folder is not re-read every step
    kit.publish(kit.make(target_config, seed=14), run, target_config, 3, 3)
    assert w.refresh() is True and w.adapted_version == 3


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("aux", "aux_layer_ids = (1, 2, 4)"),
        ("vocab", "draft_to_target differs"),
        ("latest_missing", "does not exist"),
        ("latest_outside", "expected a folder path relative"),
    ],
)
def test_mismatched_or_unreadable_publish_is_rejected(
    tmp_path, frozen_dir, kit, target_config, change, why, caplog
):
    run = tmp_path / "run"
    w = DraftWatcher(run, frozen_dir)
    if change == "aux":
        kit.publish(kit.make(target_config, seed=11, aux=(1, 2, 4)), run, target_config, 1, 1)
    elif change == "vocab":
        kit.publish(kit.make(target_config, seed=11, vocab=torch.arange(10, 58)), run, target_config, 1, 1)
    else:
        run.mkdir(parents=True)
        (run / "latest").write_text(
            "drafts/v0009\n" if change == "latest_missing" else "../warm/drafts/v0001\n"
        )
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.drafts"):
        assert w.refresh() is False
    assert why in caplog.text
    assert w.failures == 1 and w.adapted is w.frozen and w.adapted_version == 0
    assert not version_dir(run, 9).exists()
