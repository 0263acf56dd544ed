"""draft_align.sidecar surviving what a cluster does to it: a record whose cap leaves only prompt, versions at
the end of the wire's range, a restart under replayed traffic, and a second sidecar on the same run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draft_align.sidecar.ingest import Ingest
from draft_align.sidecar.state import Rates, SidecarState
from draft_align.train.replay import ReplayBuffer
from draft_align.wire.messages import BatchHeader, HeadSync, StepReport
from draft_align.wire.packing import pack_sequences

H, V, AUX = 8, 50, (1, 2, 3)
ROOT = Path(__file__).resolve().parents[2]


def _ingest() -> Ingest:
    head = HeadSync.make_dummy(hidden_size=H, vocab_size=V)
    return Ingest(
        ReplayBuffer(10_000, 2.0, 0, 0),
        SidecarState(),
        Rates(),
        aux_ids=AUX,
        hidden=H,
        vocab=V,
        draft_to_target=head.draft_to_target,
    )


def _seq(t: int, prompt: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(3, V, (t,), generator=g),
        "loss_mask": torch.arange(t) >= prompt,
        "aux_hidden": torch.randn(t, len(AUX) * H, generator=g),
        "final_hidden": torch.randn(t, H, generator=g),
    }


def _batch(seqs, *, version: int = 0, step: int = 0, batch_id: int = 0):
    return pack_sequences(
        seqs,
        BatchHeader(
            run_id="dummy",
            policy_version=version,
            source_rank=0,
            batch_id=batch_id,
            step=step,
            aux_layer_ids=AUX,
            hidden_size=H,
            vocab_size=V,
            final_norm="post",
            temperature=1.0,
        ),
    )


# ------------------------------------------------------------------ 1: a cut must keep targets
def test_a_record_without_a_trainable_target_is_dropped_counted():
    """A response that starts at position 1 has no chain start (a step predicts t + 2 from t): dropped at
    ingest, counted, and the count reaches the monitoring row."""
    from draft_align.sidecar.state import sidecar_stats

    ing = _ingest()
    ing.on_batch(_batch([_seq(2, 1, 0), _seq(6, 1, 1), _seq(5, 3, 2)]))
    assert ing.state.untrainable_records == 1 and ing.buffer.stats()["records"] == 2
    stats = sidecar_stats(ing.state, ing.buffer.stats(), Rates(), {})
    assert stats.to_dict()["untrainable_records"] == 1


@pytest.mark.parametrize("sidecar_world", [{"sidecar.train.max_seq_tokens": 12}], indirect=True)
def test_records_whose_cap_leaves_only_prompt_train_instead_of_killing_the_loop(sidecar_world, until):
    """Chat prompts of the tiny world are longer than 12 tokens: the plain cut left no target and the
    next train step raised 'cannot reshape tensor of 0 elements'."""
    recipe, sc, feeder = sidecar_world
    feeder.step(0, 0)
    assert until(lambda: sc.state.monitor_rows >= 1, 30, every=lambda: sc.drain(0.1, 100))
    for _ in range(3):
        assert sc.train_one()
    assert sc.state.train_steps == 3
    assert sc.trainer.progress.prompt_cut_sequences > 0


# ------------------------------------------------------------------ 4: one sidecar per run folder
def test_a_second_sidecar_on_the_same_run_is_refused_naming_the_holder(sidecar_world):
    """The second one used to bind the same ipc socket (the first then received nothing) and write the same
    folder; it is refused before it touches the run, and the lock is released at close."""
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.lock import RunInUseError
    from draft_align.sidecar.loop import Sidecar

    recipe, sc, _ = sidecar_world
    second = Sidecar(recipe, starting_draft(recipe))
    with pytest.raises(RunInUseError, match=rf"in use by another sidecar \(pid {os.getpid()}, lock "):
        second.setup()
    assert not hasattr(second, "receiver")  # refused before binding anything
    sc.close()
    third = Sidecar(recipe, starting_draft(recipe)).setup()
    assert third.lock is not None and third.lock.held
    third.close()
    assert not third.lock.held


def test_the_lock_of_a_killed_sidecar_is_recovered(tmp_path):
    from draft_align.sidecar.lock import RunInUseError, RunLock

    path = tmp_path / "run" / "sidecar" / "lock"
    path.parent.mkdir(parents=True)
    code = (
        "import sys, time; from draft_align.sidecar.lock import RunLock; "
        f"RunLock.acquire({str(path)!r}); print('held', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(RunInUseError, match=rf"pid {child.pid}, lock {path}\): stop that one first"):
            RunLock.acquire(path)
    finally:
        child.kill()
        child.wait()
    lock = RunLock.acquire(path)  # the kernel dropped the dead holder's lock
    assert path.read_text().strip() == str(os.getpid())
    lock.release()
    lock.release()  # idempotent
    link = path.with_name("lock-rank1")
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        RunLock.acquire(link)


# ------------------------------------------------------------------ 3: replay protection outlives a restart
def _head(recipe, sc, version: int) -> HeadSync:
    d2t = sc.frozen.draft_to_target
    dummy = HeadSync.make_dummy(hidden_size=sc.hidden, vocab_size=sc.vocab, draft_vocab=d2t.numel())
    return dataclasses.replace(dummy, run_id=recipe.run, policy_version=version, draft_to_target=d2t.clone())


def _push(endpoint: str, key: bytes, captured: list[list[bytes]]) -> None:
    """Send frames as captured (a key holder's raw socket: it passes the handshake)."""
    import zmq

    from draft_align.wire.sockets import authenticate

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    authenticate(sock, key)
    sock.connect(endpoint)
    for frames in captured:
        sock.send_multipart(frames)
    sock.close()
    ctx.term()


def test_a_restarted_sidecar_refuses_what_it_accepted_before(sidecar_world, until, monkeypatch, caplog):
    """Captured signed messages were all accepted again by a restarted sidecar, and an old HeadSync was
    taken as an RL restart (shifting every later policy version); the sequence guard is now saved and loaded."""
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar
    from draft_align.wire.codec import encode

    recipe, sc, _ = sidecar_world
    msgs = [_head(recipe, sc, 5), _head(recipe, sc, 6)]
    msgs += [StepReport(run_id=recipe.run, step=s, policy_version=6, metrics={"r": 1.0}) for s in range(3)]
    captured = [encode(m, sc.wire_key, sender="captured", seq=i) for i, m in enumerate(msgs)]
    _push(sc.receiver.endpoint, sc.wire_key, captured)
    assert until(lambda: sc.state.monitor_rows >= 3, 60, every=lambda: sc.drain(0.1, 100))
    assert sc.state.head_policy_version == 6 and sc.state.rl_restarts == 0
    sc.checkpoint()
    sc.close()
    again = Sidecar(recipe, starting_draft(recipe)).setup()
    try:
        assert again.resumed and again.state.head_policy_version == 6
        _push(again.receiver.endpoint, again.wire_key, captured)
        assert until(
            lambda: again.receiver.rejected["sequence"] >= 5, 60, every=lambda: again.drain(0.1, 100)
        )
        assert again.receiver.rejected == {"sequence": 5}
        assert again.state.rl_restarts == 0 and again.state.head_policy_version == 6
        assert again.state.monitor_rows == 3 and not again.has_head
        # a full disk when the guard is saved: one ERROR line, the loop goes on, the next save catches up
        from draft_align.sidecar import loop
        from draft_align.wire.codec import Origin

        def full(*a, **k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(loop, "save_guard", full)
        again.receiver.guard.check(Origin("after-disk-full", 0))
        with caplog.at_level("ERROR"):
            again.save_guard_state(force=True)
            again.save_guard_state(force=True)
        assert caplog.text.count("cannot save the sequence guard") == 1
        monkeypatch.undo()
        again.save_guard_state(force=True)
        assert "after-disk-full" in again.guard_file.read_text()
    finally:
        again.close()


# ------------------------------------------------------------------ 2: versions at the end of the wire's range
TOP = 2**63 - 1


def test_a_head_at_the_top_of_the_range_pins_nothing():
    """A HeadSync at 2^63 − 1 was accepted, and the real v1 after it was refused until a restart (its restart
    offset would pass the top).  A first head above 2^40, or a later one more than 2^20 ahead of the head in
    use, is now refused and counted; the real versions go on."""
    from draft_align.sidecar.ingest import MAX_VERSION_JUMP

    ing = _ingest()
    assert not ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=TOP))
    assert ing.state.version_overflows == 1 and not ing.has_head
    assert ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=1))
    assert ing.state.head_policy_version == 1 and ing.state.rl_restarts == 0
    far = 1 + MAX_VERSION_JUMP + 1
    assert not ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=far))
    assert ing.state.version_overflows == 2 and ing.state.head_policy_version == 1
    assert ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=far - 1))
    assert ing.accept_head(
        HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=0)
    )  # an RL restart
    assert ing.state.rl_restarts == 1 and ing.state.head_policy_version == far


def test_a_restart_near_the_top_of_the_range_is_refused_counted():
    """The restart offset after a head near 2^63 − 1 (a state reached by legitimate steps) made later versions
    pass the top: a batch the shift would carry past it is refused and counted."""
    ing = _ingest()
    assert ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=5))
    ing.state.head_policy_version = TOP - 10  # as after a long run of versions
    assert ing.accept_head(HeadSync.make_dummy(hidden_size=H, vocab_size=V, policy_version=0))
    assert ing.state.head_policy_version == TOP - 9 and ing.state.policy_offset == TOP - 9
    ing.on_batch(_batch([_seq(6, 2)], version=10))
    assert ing.state.version_overflows == 1 and ing.buffer.stats()["records"] == 0
    ing.on_batch(_batch([_seq(6, 2)], version=9, batch_id=1))
    assert ing.state.newest_policy_version == TOP


def test_version_folders_past_the_range_are_not_versions_and_never_written(tmp_path):
    from draft_align.publish.folder import ExportError
    from draft_align.publish.versions import folder_version, next_version, publish_version

    (tmp_path / "drafts" / f"v{10**30 + 1}").mkdir(parents=True)
    (tmp_path / "drafts" / "v0003").mkdir()
    assert folder_version(tmp_path / "drafts" / f"v{10**30 + 1}") is None
    assert folder_version(tmp_path / "drafts" / f"v{TOP}") == TOP
    assert next_version(tmp_path) == 4
    with pytest.raises(ExportError, match="past the last one the wire can carry"):
        publish_version(
            tmp_path,
            None,
            target_config=None,
            target_name="t",
            tokenizer_fingerprint="f",
            metrics={},
            policy_version=0,
            at_least=TOP + 1,
        )
    assert sorted(p.name for p in (tmp_path / "drafts").iterdir()) == ["v0003", f"v{10**30 + 1}"]


def test_a_state_that_cannot_be_continued_is_refused_at_start(sidecar_world):
    """A state.json with published_version 10^30 wrote a folder v1000…0001 and then died; it is refused at
    start with one line and a way out, and nothing is written."""
    import json

    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar
    from draft_align.sidecar.state import StateRangeError

    recipe, sc, _ = sidecar_world
    sc.checkpoint()
    sc.close()
    state_file = sc.dir / "state.json"
    for field, value in (
        ("published_version", 10**30),
        ("policy_offset", 2**63),
        ("head_policy_version", -2),
    ):
        good = json.loads(state_file.read_text())
        state_file.write_text(json.dumps({**good, field: value}))
        again = Sidecar(recipe, starting_draft(recipe))
        with pytest.raises(
            StateRangeError, match=rf"{field} .* is outside .*cannot be continued; move .* aside"
        ):
            again.setup()
        assert not again.lock.held  # released: the way out can be taken at once
        state_file.write_text(json.dumps(good))
    assert (
        not (recipe.run_dir / "drafts").exists()
        or [p.name for p in (recipe.run_dir / "drafts").iterdir() if len(p.name) > 8] == []
    )


def test_a_head_at_the_top_of_the_range_is_refused_and_the_run_trains_and_publishes(sidecar_world, until):
    recipe, sc, feeder = sidecar_world
    sc.handle(_head(recipe, sc, TOP))  # refused and counted: it pins nothing
    for s in range(2):
        feeder.step(s, s)  # the RL job's own HeadSync v0, v1: taken
    assert until(lambda: sc.state.monitor_rows >= 2, 30, every=lambda: sc.drain(0.1, 100))
    assert (
        sc.state.version_overflows == 1 and sc.state.policy_offset == 0 and sc.state.head_policy_version == 1
    )
    for _ in range(3):
        assert sc.train_one()
    assert sc.maybe_publish(force=True)
    assert sc.state.published_version == 1 and sc.state.published_policy_version <= TOP
