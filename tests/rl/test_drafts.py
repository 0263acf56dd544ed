"""DraftSource: the frozen and adapted drafts of the RL job, picked up from the sidecar's notifications or
from ``latest``, each version verified once and checked against the frozen draft."""

import logging
import time

import pytest
import torch

from draft_align.publish.folder import ExportError, read_manifest
from draft_align.publish.versions import resolve_draft_dir, version_dir
from draft_align.rl.drafts import DraftSource
from draft_align.wire.messages import DraftPublished


def same_weights(a, b) -> bool:
    sa, sb = a.engine_state_dict(), b.engine_state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class ListNotifications:
    """The Subscriber interface over a list: ``poll(0)`` hands out what was queued, then None."""

    def __init__(self):
        self.queue = []

    def poll(self, timeout_ms=0):
        return self.queue.pop(0) if self.queue else None


def announce(path, version, sha=None) -> DraftPublished:
    sha = (
        sha if sha is not None else read_manifest(path, verify=False)["files"]["model.safetensors"]["sha256"]
    )
    return DraftPublished(
        run_id="run", draft_version=version, policy_version=version, path=str(path), sha256=sha
    )


def test_before_any_publish_adapted_is_frozen(tmp_path, frozen_dir, kit, target_config):
    w = DraftSource(tmp_path / "run", frozen_dir)
    assert w.adapted is w.frozen and w.adapted_version is None and w.current_version == 0
    assert w.frozen_version.path == frozen_dir and w.frozen_version.version == 1
    assert w.frozen_version.sha256 == read_manifest(frozen_dir)["files"]["model.safetensors"]["sha256"]
    assert same_weights(w.frozen, kit.make(target_config, seed=1))
    assert not any(p.requires_grad for p in w.frozen.parameters())
    assert w.poll() is False and w.failures == 0
    assert torch.equal(w.draft_to_target, torch.arange(3, 51))


def test_frozen_path_may_be_a_run_folder(tmp_path, frozen_dir):
    assert resolve_draft_dir(frozen_dir.parent.parent) == frozen_dir
    assert DraftSource(tmp_path / "run", frozen_dir.parent.parent).frozen_path == frozen_dir
    with pytest.raises(ExportError, match="neither a draft folder"):
        resolve_draft_dir(tmp_path)


def test_picks_up_new_versions_and_ignores_old_ones(tmp_path, frozen_dir, kit, target_config):
    run = tmp_path / "run"
    w = DraftSource(run, frozen_dir)
    d1 = kit.make(target_config, seed=11)
    kit.publish(d1, run, target_config, draft_version=1, policy_version=3)
    assert w.poll() is True
    assert (w.adapted_version.version, w.adapted_version.policy_version) == (1, 3)
    assert w.adapted_version.path == version_dir(run, 1) and w.notified == 0
    assert same_weights(w.adapted, d1) and not same_weights(w.frozen, d1)
    assert w.adapted is not w.frozen and w.poll() is False  # nothing newer: no reload
    d3 = kit.make(target_config, seed=13)
    kit.publish(d3, run, target_config, draft_version=3, policy_version=5)
    assert w.poll() is True and w.adapted_version.version == 3 and same_weights(w.adapted, d3)
    # `latest` moved back to an older version: not newer, kept v3, not a failure
    (run / "latest").write_text("drafts/v0001\n")
    assert w.poll() is False and w.adapted_version.version == 3 and w.failures == 0


def test_corrupt_publish_keeps_previous_draft(tmp_path, frozen_dir, kit, target_config, caplog):
    run = tmp_path / "run"
    w = DraftSource(run, frozen_dir)
    kit.publish(kit.make(target_config, seed=11), run, target_config, 1, 1)
    assert w.poll()
    before = w.adapted
    bad = kit.publish(kit.make(target_config, seed=12), run, target_config, 2, 2)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated after `latest` already points at it
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.drafts"):
        assert w.poll() is False
    assert "keeping draft v0001" in caplog.text and "bytes" in caplog.text
    assert (
        w.adapted is before
        and w.adapted_version.version == 1
        and w.adapted_version.policy_version == 1
        and w.failures == 1
    )
    assert w.poll() is False and w.failures == 1  # the same broken folder is not re-read every step
    kit.publish(kit.make(target_config, seed=14), run, target_config, 3, 3)
    assert w.poll() is True and w.adapted_version.version == 3


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("aux", "aux_layer_ids = (1, 2, 4)"),
        ("vocab", "draft_to_target differs"),
        ("draft_vocab", "draft_vocab_size = 24"),
        ("hidden", "hidden_size = 32"),
        ("latest_missing", "does not exist"),
        ("latest_outside", "expected a folder path relative"),
    ],
)
def test_mismatched_or_unreadable_publish_is_rejected(
    tmp_path, frozen_dir, kit, target_config, change, why, caplog
):
    from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft

    run = tmp_path / "run"
    w = DraftSource(run, frozen_dir)
    if change == "aux":
        kit.publish(kit.make(target_config, seed=11, aux=(1, 2, 4)), run, target_config, 1, 1)
    elif change == "vocab":
        kit.publish(kit.make(target_config, seed=11, vocab=torch.arange(10, 58)), run, target_config, 1, 1)
    elif change in ("draft_vocab", "hidden"):  # shapes an engine could not load in place
        base = kit.make(target_config, seed=11)
        size = {"draft_vocab_size": 24} if change == "draft_vocab" else {"hidden_size": 32, "head_dim": 8}
        cfg = Eagle3Config.from_dict({**base.cfg.to_dict(), **size})
        d = Eagle3Draft(cfg)
        d.set_vocab(torch.arange(3, 3 + cfg.draft_vocab_size))
        kit.publish(d, run, target_config, 1, 1)
    else:
        run.mkdir(parents=True)
        (run / "latest").write_text(
            "drafts/v0009\n" if change == "latest_missing" else "../warm/drafts/v0001\n"
        )
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.drafts"):
        assert w.poll() is False
    assert why in caplog.text
    assert w.failures == 1 and w.adapted is w.frozen and w.adapted_version is None
    assert not version_dir(run, 9).exists()


# --------------------------------------------------------------------------------------- notifications
def test_notifications_first_latest_as_fallback(tmp_path, frozen_dir, kit, target_config, caplog):
    run = tmp_path / "run"
    notes = ListNotifications()
    w = DraftSource(run, frozen_dir, notifications=notes)
    v1 = kit.publish(kit.make(target_config, seed=11), run, target_config, 1, 1)
    assert w.poll() is True and w.notified == 0  # no notification came: `latest`
    # a notification that arrives before `latest` moved: the announced folder is taken
    v2 = kit.publish(kit.make(target_config, seed=12), run, target_config, 2, 2)
    (run / "latest").write_text("drafts/v0001\n")
    notes.queue += [announce(v1, 1), announce(v2, 2)]  # drained at once: the newest counts
    assert w.poll() is True and w.notified == 1 and w.adapted_version.path == v2
    # a notification whose sha256 is not the folder's is refused, and the folder is not re-read from `latest`
    v3 = kit.publish(kit.make(target_config, seed=13), run, target_config, 3, 3)
    notes.queue.append(announce(v3, 3, sha="0" * 64))
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.drafts"):
        assert w.poll() is False
    assert "sha256 differs" in caplog.text and w.failures == 1 and w.adapted_version.version == 2
    assert w.poll() is False and w.failures == 1
    # only stale notifications: `latest` still decides
    v4 = kit.publish(kit.make(target_config, seed=14), run, target_config, 4, 4)
    notes.queue.append(announce(v1, 1))
    assert w.poll() is True and w.adapted_version.path == v4 and w.notified == 1


def test_draft_published_over_the_wire_is_picked_up(tmp_path, frozen_dir, kit, target_config):
    """The sidecar's PUB socket and a DraftSource on its SUB side: a version `latest` does not name yet."""
    from draft_align.wire.channel import Publisher, Subscriber, default_endpoint

    key = bytes(range(32))
    run = tmp_path / "run"
    v1 = kit.publish(kit.make(target_config, seed=11), run, target_config, 1, 1)
    (run / "latest").unlink()
    ep = default_endpoint(tmp_path, "notify")
    with Publisher(ep, key) as pub, Subscriber(ep, key) as sub:
        w = DraftSource(run, frozen_dir, notifications=sub)
        took, deadline = False, time.monotonic() + 10
        while not took and time.monotonic() < deadline:  # PUB/SUB slow joiner: repeat until heard
            pub.publish(announce(v1, 1))
            time.sleep(0.05)
            took = w.poll()
        assert took and w.notified == 1 and w.adapted_version.path == v1 and w.failures == 0
        assert w.poll() is False  # repeats of the same version are not newer


# --------------------------------------------------------------------------------------- hostile folders
def test_a_manifest_claiming_a_later_version_is_refused(tmp_path, frozen_dir, kit, target_config, caplog):
    import json

    run = tmp_path / "run"
    w = DraftSource(run, frozen_dir)
    forged = kit.publish(kit.make(target_config, seed=11), run, target_config, 1, 1)
    man = json.loads((forged / "manifest.json").read_text())
    (forged / "manifest.json").write_text(json.dumps({**man, "draft_version": 999}))
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.drafts"):
        assert w.poll() is False
    assert "draft_version 999, the folder is version 1" in caplog.text and w.failures == 1
    # a notification naming the forged folder is refused too
    notes = ListNotifications()
    w2 = DraftSource(run, frozen_dir, notifications=notes)
    notes.queue.append(announce(forged, 999))
    assert w2.poll() is False and w2.adapted_version is None
    # the genuine later version is taken
    d2 = kit.make(target_config, seed=12)
    kit.publish(d2, run, target_config, 2, 2)
    assert w.poll() is True and w.current_version == 2 and same_weights(w.adapted, d2)
    # a notification whose version is not the folder's: refused (counted); `latest` still names the genuine v2
    notes.queue.append(announce(version_dir(run, 2), 7))
    assert w2.poll() is True and w2.current_version == 2 and w2.failures == 3 and w2.notified == 0


@pytest.mark.parametrize("latest", [b"drafts/v\xff0001\n", "dir"])
def test_unreadable_latest_never_raises_out_of_poll(tmp_path, frozen_dir, kit, target_config, latest, caplog):
    run = tmp_path / "run"
    w = DraftSource(run, frozen_dir)
    kit.publish(kit.make(target_config, seed=11), run, target_config, 1, 1)
    assert w.poll() is True
    (run / "latest").unlink()
    if latest == "dir":
        (run / "latest").mkdir()
    else:
        (run / "latest").write_bytes(latest)
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.drafts"):
        assert w.poll() is False
    assert ("is a directory" if latest == "dir" else "not UTF-8") in caplog.text
    assert w.failures == 1 and w.current_version == 1


# --------------------------------------------------------------------------------------- only this run's folders
def test_a_notification_naming_a_folder_outside_the_run_is_refused_and_pins_nothing(
    tmp_path, frozen_dir, kit, target_config, caplog
):
    """A DraftPublished naming another run's v0009 (well-formed, and fitting the frozen draft) or carrying
    another run_id is refused, counted and logged; the genuine later versions are taken."""
    run, evil = tmp_path / "run", tmp_path / "evil"
    notes = ListNotifications()
    w = DraftSource(run, frozen_dir, notifications=notes)
    outside = kit.publish(kit.make(target_config, seed=66), evil, target_config, 9, 9)
    v1 = kit.publish(kit.make(target_config, seed=11), run, target_config, 1, 1)
    (run / "latest").unlink()  # only notifications say where the versions are
    notes.queue += [announce(outside, 9), announce(v1, 1)]
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.drafts"):
        assert w.poll() is True
    assert w.current_version == 1 and w.adapted_version.path == v1 and w.failures == 1
    assert "a path or link out of the run" in caplog.text and "refused" in caplog.text
    v2 = kit.publish(kit.make(target_config, seed=12), run, target_config, 2, 2)
    (run / "latest").unlink()
    notes.queue.append(DraftPublished(**{**vars(announce(v2, 2)), "run_id": "another-run"}))
    assert (
        w.poll() is False
        and w.failures == 2
        and "other runs ignored since the last such line ('another-run'" in caplog.text
    )
    # announced in this run's folder under a path with a link in it: the same folder, taken
    (tmp_path / "alias").symlink_to(run)
    notes.queue.append(announce(tmp_path / "alias" / "drafts" / "v0002", 2))
    assert w.poll() is True and w.current_version == 2 and w.adapted_version.path == v2


def test_a_version_folder_linked_out_of_the_run_is_refused_through_latest(
    tmp_path, frozen_dir, kit, target_config, caplog
):
    run, evil = tmp_path / "run", tmp_path / "evil"
    w = DraftSource(run, frozen_dir)
    kit.publish(kit.make(target_config, seed=11), run, target_config, 1, 1)
    assert w.poll() is True and w.current_version == 1
    outside = kit.publish(kit.make(target_config, seed=66), evil, target_config, 2, 2)
    version_dir(run, 2).symlink_to(outside, target_is_directory=True)
    (run / "latest").write_text("drafts/v0002\n")
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.drafts"):
        assert w.poll() is False
    assert "outside" in caplog.text and "keeping draft v0001" in caplog.text
    assert w.current_version == 1 and w.failures == 1
    # the whole drafts/ folder linked elsewhere: refused the same way
    notes = ListNotifications()
    w2 = DraftSource(tmp_path / "run2", frozen_dir, notifications=notes)
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "drafts").symlink_to(evil / "drafts", target_is_directory=True)
    notes.queue.append(announce(version_dir(tmp_path / "run2", 2), 2))
    assert w2.poll() is False and w2.current_version == 0 and w2.failures == 1


def test_notifications_of_versions_pruned_since_cost_nothing_when_a_newer_one_is_good(
    tmp_path, frozen_dir, kit, target_config
):
    """A sidecar that publishes faster than the RL job polls prunes versions it announced: only the newest
    announced version is examined (older ones only when it is refused)."""
    import shutil

    run = tmp_path / "run"
    notes = ListNotifications()
    w = DraftSource(run, frozen_dir, notifications=notes)
    paths = [kit.publish(kit.make(target_config, seed=10 + v), run, target_config, v, v) for v in (1, 2, 3)]
    notes.queue += [announce(p, v) for v, p in zip((1, 2, 3), paths, strict=True)]
    shutil.rmtree(paths[0])  # retention deleted v0001 after announcing it
    shutil.rmtree(paths[1])
    assert w.poll() is True and w.current_version == 3 and w.failures == 0 and w.notified == 1


def test_announced_versions_all_pruned_before_the_poll_are_superseded_and_latest_is_taken(
    tmp_path, frozen_dir, kit, target_config
):
    """The RL job polls late (seen once under load): every announced version was pruned, and the newest one
    was published but not yet announced.  Nothing failed: the pruned ones are superseded, ``latest`` is taken;
    an announced version that never existed, newer than ``latest``, is still a failure."""
    import shutil

    run = tmp_path / "run"
    notes = ListNotifications()
    w = DraftSource(run, frozen_dir, notifications=notes)
    paths = [kit.publish(kit.make(target_config, seed=10 + v), run, target_config, v, v) for v in (1, 2, 3)]
    notes.queue += [announce(p, v) for v, p in zip((1, 2), paths, strict=False)]
    shutil.rmtree(paths[0])
    shutil.rmtree(paths[1])
    assert w.poll() is True and w.current_version == 3 and w.failures == 0 and w.superseded == 2
    notes.queue.append(announce(paths[2], 9))  # forged: v0009 was never published
    assert w.poll() is False and w.current_version == 3 and w.failures == 1


def test_a_version_pruned_while_it_is_verified_is_superseded_not_failed(
    tmp_path, frozen_dir, kit, target_config, monkeypatch
):
    """Retention removes the folder between the notification and the read (seen under load in CI): counted as
    superseded, not as a failure, and the newer version is taken at the next poll."""
    import shutil

    import draft_align.rl.drafts as drafts_mod

    run = tmp_path / "run"
    notes = ListNotifications()
    w = DraftSource(run, frozen_dir, notifications=notes)
    p1 = kit.publish(kit.make(target_config, seed=11), run, target_config, 1, 1)
    notes.queue.append(announce(p1, 1))
    real = drafts_mod.load_verified_draft

    def pruned_meanwhile(path, **kw):
        if path == p1:  # the sidecar publishes v2 and prunes v1 while this thread reads v1
            kit.publish(kit.make(target_config, seed=12), run, target_config, 2, 2)
            shutil.rmtree(p1)
        return real(path, **kw)

    monkeypatch.setattr(drafts_mod, "load_verified_draft", pruned_meanwhile)
    assert w.poll() is False and w.failures == 0 and w.superseded == 1
    assert w.poll() is True and w.current_version == 2 and w.failures == 0
    # a folder that vanished with no newer version named by latest is still a failure
    p3 = kit.publish(kit.make(target_config, seed=13), run, target_config, 3, 3)
    (run / "latest").write_text("drafts/v0002\n")
    notes.queue.append(announce(p3, 3))
    shutil.rmtree(version_dir(run, 2))
    (run / "latest").unlink()
    monkeypatch.setattr(
        drafts_mod, "load_verified_draft", lambda path, **kw: (shutil.rmtree(path), real(path, **kw))[1]
    )
    assert w.poll() is False and w.failures == 1


# --------------------------------------------------------------------------------------- off the job's thread
def test_background_poll_never_waits_for_a_slow_hash(tmp_path, frozen_dir, kit, target_config, monkeypatch):
    """The verifier thread hashes and loads; ``poll`` on the job's thread only swaps in what is ready."""
    import draft_align.rl.drafts as drafts_mod

    run = tmp_path / "run"
    w = DraftSource(run, frozen_dir, background=True, poll_interval_s=0.02)
    try:
        slow = drafts_mod.load_verified_draft
        hashing = []

        def slow_hash(path, **kw):
            hashing.append(path)
            time.sleep(1.5)
            return slow(path, **kw)

        monkeypatch.setattr(drafts_mod, "load_verified_draft", slow_hash)
        d1 = kit.make(target_config, seed=11)
        kit.publish(d1, run, target_config, 1, 1)
        deadline = time.monotonic() + 5
        while not hashing and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hashing, "the verifier thread never started on the new version"
        t0 = time.perf_counter()
        assert w.poll() is False  # still hashing over there: nothing to take, and no wait here
        assert time.perf_counter() - t0 < 0.2
        assert w.adapted is w.frozen and w.adapted_version is None
        assert w.wait_verified(10.0)
        t0 = time.perf_counter()
        assert w.poll() is True and time.perf_counter() - t0 < 0.2
        assert w.adapted_version.version == 1 and same_weights(w.adapted, d1)
        assert w.adapted_version.weights is not None  # the verified tensors the engine loads
        assert w.verify_s >= 1.5 and w.poll() is False
    finally:
        w.close()


def test_background_failed_verification_is_never_served(tmp_path, frozen_dir, kit, target_config, until):
    run = tmp_path / "run"
    w = DraftSource(run, frozen_dir, background=True, poll_interval_s=0.02)
    try:
        bad = kit.publish(kit.make(target_config, seed=12), run, target_config, 1, 1)
        weights = bad / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        assert until(lambda: w.failures >= 1, 10)
        time.sleep(0.2)  # the truncating write may have been seen half-done: a changed file is read again
        failed = w.failures
        time.sleep(0.2)  # more verifier rounds: the same broken folder is neither re-read nor handed over
        assert w.poll() is False and w.adapted is w.frozen and w.adapted_version is None
        assert w.failures == failed and not w.wait_verified(0.1)
        kit.publish(kit.make(target_config, seed=13), run, target_config, 2, 2)
        assert w.wait_verified(10.0) and w.poll() is True and w.adapted_version.version == 2
    finally:
        w.close()


# --------------------------------------------------------------------------------------- silent-zero guard
def tally(rounds, per_pos):
    from draft_align.acceptance import AcceptanceTally

    return AcceptanceTally(float(rounds), [float(x) for x in per_pos])


def test_counter_guard_verdicts():
    from draft_align.rl.draft_guard import CounterGuard

    g = CounterGuard(min_ratio=0.5)
    frozen = tally(200, [80, 30, 10])  # L = 1.6
    assert g.verdict(tally(200, [0, 0, 0]), frozen) == "collapse"  # a wiped draft: L = 1
    assert g.verdict(tally(200, [90, 40, 10]), frozen) == "pass"
    assert g.verdict(tally(200, [50, 20, 5]), frozen) == "pass"  # lower, but above half the gain
    assert g.verdict(tally(4, [0, 0, 0]), frozen) == "undecided"  # too few rounds to say
    assert g.verdict(tally(200, [0, 0, 0]), None) == "undecided"
    assert g.verdict(tally(200, [0, 0, 0]), tally(200, [0, 0, 0])) == "undecided"  # the reference gains 0
    # weak drafts: 1.10 vs 1.04 over 30 rounds each is below half the gain but inside the noise
    assert g.verdict(tally(30, [1, 0, 0]), tally(30, [3, 0, 0])) == "pass"
    with pytest.raises(ValueError, match="min_ratio"):
        CounterGuard(min_ratio=0.0)


@pytest.mark.parametrize("background", [False, True])
def test_collapsed_draft_is_rolled_back_after_its_first_step(
    tmp_path, frozen_dir, kit, target_config, background
):
    from draft_align.rl.draft_guard import CounterGuard

    run = tmp_path / "run"
    w = DraftSource(run, frozen_dir, background=background, guard=CounterGuard(), poll_interval_s=0.02)
    try:

        def take():
            if background:
                assert w.wait_verified(10.0)
            assert w.poll() is True

        frozen_tally = tally(100, [50, 20, 5])
        d1 = kit.make(target_config, seed=11)
        kit.publish(d1, run, target_config, 1, 1)
        take()
        assert w.probation == w.adapted_version
        # a step that served v1 passes it; v1 is then the version a rollback goes back to
        assert (
            w.judge(w.adapted_version, {"adapted": tally(100, [55, 20, 6]), "frozen": frozen_tally}) is False
        )
        assert w.probation is None and w.adapted_version.version == 1
        kit.publish(kit.make(target_config, seed=12), run, target_config, 2, 2)
        take()
        v2 = w.adapted_version
        assert v2.version == 2 and w.probation == v2
        # v2 served one step and accepted nothing: back to v1 for the next step
        assert w.judge(v2, {"adapted": tally(100, [0, 0, 0]), "frozen": frozen_tally}) is True
        assert w.adapted_version.version == 1 and same_weights(w.adapted, d1)
        assert (w.rollbacks, w.alarms) == (1, 1) and w.probation is None
        time.sleep(0.1)
        assert w.poll() is False and w.adapted_version.version == 1  # `latest` still names v2: not re-taken
        # a step without frozen rollouts is judged against the last good adapted draft's tally
        kit.publish(kit.make(target_config, seed=13), run, target_config, 3, 3)
        take()
        v3 = w.adapted_version
        assert w.judge(v3, {"adapted": tally(100, [0, 0, 0]), "frozen": tally(0, [0, 0, 0])}) is True
        assert w.adapted_version.version == 1
    finally:
        w.close()


def test_collapse_with_no_good_version_goes_back_to_the_frozen_draft(
    tmp_path, frozen_dir, kit, target_config
):
    from draft_align.rl.draft_guard import CounterGuard

    run = tmp_path / "run"
    w = DraftSource(run, frozen_dir, guard=CounterGuard())
    kit.publish(kit.make(target_config, seed=12), run, target_config, 1, 1)
    assert w.poll() is True
    other = DraftPublished(run_id="t", draft_version=9, policy_version=9, path="x", sha256="0" * 64)
    served = w.adapted_version
    assert w.judge(None, {"adapted": tally(100, [0, 0, 0])}) is False  # nothing adapted served
    assert (
        w.judge(type(served)(served.path, served.manifest, other.sha256), {}) is False
    )  # not the one on probation
    assert w.judge(served, {"adapted": tally(100, [0, 0, 0]), "frozen": tally(100, [40, 10, 0])}) is True
    assert w.adapted is w.frozen and w.adapted_version is None and w.current_version == 0


def test_a_notification_flood_is_coalesced_and_logged_in_one_line(
    tmp_path, frozen_dir, kit, target_config, caplog
):
    """100,000 notifications for other runs and of stale versions cost one poll 14.3 s and ~80k warning lines;
    a poll now drains at most MAX_NOTIFICATIONS, logs them in one line, and `latest` still brings the new one."""
    from draft_align.rl.drafts import MAX_NOTIFICATIONS

    run = tmp_path / "run"
    notes = ListNotifications()
    w = DraftSource(run, frozen_dir, notifications=notes)
    d2 = kit.make(target_config, seed=12)
    kit.publish(d2, run, target_config, draft_version=2, policy_version=2)
    bogus = DraftPublished(
        run_id="other", draft_version=9, policy_version=0, path="/x/drafts/v0009", sha256="0" * 64
    )
    notes.queue = [bogus] * 100_000
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.drafts"):
        t0 = time.perf_counter()
        assert w.poll() is True and w.adapted_version.version == 2  # from `latest`
        assert time.perf_counter() - t0 < 2.0
    assert len(notes.queue) == 100_000 - MAX_NOTIFICATIONS  # the rest waits for later polls
    assert w.failures == MAX_NOTIFICATIONS
    assert len([r for r in caplog.records if "other runs" in r.getMessage()]) == 1
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.drafts"):
        for _ in range(20):  # draining the rest: counted, one line a minute at most
            w.poll()
    assert len([r for r in caplog.records if "other runs" in r.getMessage()]) == 1
    assert w.failures == 21 * MAX_NOTIFICATIONS


def test_the_module_served_is_built_from_exactly_the_bytes_verified(
    tmp_path, frozen_dir, kit, target_config, monkeypatch
):
    """The weights were hashed, then read a second time to build the module: a file swapped in between made
    the served module differ from the recorded sha256 (9 of 10 trials).  Now the module is built from the
    tensors parsed out of the hashed buffer."""
    import shutil

    import draft_align.publish as publish
    from draft_align.publish import folder

    run = tmp_path / "run"
    d1, d2 = kit.make(target_config, seed=21), kit.make(target_config, seed=22)
    kit.publish(d1, run, target_config, draft_version=1, policy_version=1)
    kit.publish(d2, tmp_path / "other", target_config, draft_version=1, policy_version=1)
    weights = version_dir(run, 1) / "model.safetensors"
    swapped = version_dir(tmp_path / "other", 1) / "model.safetensors"
    recorded = read_manifest(version_dir(run, 1), verify=False)["files"]["model.safetensors"]["sha256"]
    w = DraftSource(run / "rl", frozen_dir)

    def swap_after(fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            shutil.copyfile(swapped, weights)  # the file is swapped right after each check
            return out

        return wrapper

    for name in ("read_verified_weights", "verify_file", "verify_files"):
        real = getattr(folder, name)
        monkeypatch.setattr(folder, name, swap_after(real))
        if hasattr(publish, name):
            monkeypatch.setattr(publish, name, swap_after(real))
    version, draft = w.verify(version_dir(run, 1))
    assert version.sha256 == recorded
    assert same_weights(draft, d1) and not same_weights(draft, d2)  # what was verified, not what is there now
