"""draft_align.sidecar on the tiny target, under hostile input and bad luck: slash-named metrics
through the real sockets and Prometheus page, a full disk at publish and checkpoint (and a restart on it), an
export refused at publish time, a poisoned head, non-finite steps in a row, corrupt or forged files at a
restart, and retention."""

from __future__ import annotations

import errno
import json
import logging
import re

import pytest
import torch

from draft_align.config import CotrainRecipe, load_recipe
from draft_align.wire.messages import StepReport


def _warm(sc, feeder, until, steps: int = 2) -> None:
    """Feed ``steps`` RL steps and take 4 train steps (the buffer then holds trainable records)."""
    for s in range(steps):
        feeder.step(s, s)
    assert until(lambda: sc.state.monitor_rows >= steps, 30, every=lambda: sc.drain(0.1, 100))
    for _ in range(4):
        assert sc.train_one()


def _disk_full(*a, **k):
    """What safetensors raises on a full disk (its own error type, not OSError: seen in benchmarks/soak.py)."""
    from safetensors import SafetensorError

    raise SafetensorError(
        f"Error while serializing: I/O error: No space left on device (os error {errno.ENOSPC})"
    )


def test_slash_named_metrics_through_a_real_sidecar(sidecar_world, until):
    from draft_align.monitor.live import metrics_url, scrape

    recipe, sc, feeder = sidecar_world
    feeder.step(0, 0)
    feeder.sender.offer(
        StepReport(
            run_id=recipe.run,
            step=1,
            policy_version=0,
            metrics={"reward/mean": 0.5, "kl-to-initial": 0.25, "accept len": 2.0},
        )
    )
    assert until(lambda: sc.state.monitor_rows >= 2, 20, every=lambda: sc.drain(0.1, 100))
    rows = [json.loads(x) for x in (sc.dir / "monitor.jsonl").read_text().splitlines()]
    assert rows[1]["reward/mean"] == 0.5 and rows[1]["kl-to-initial"] == 0.25 and rows[1]["accept len"] == 2.0
    page = scrape(metrics_url(recipe.run_dir))
    assert page["draft_align_reward_mean"] == 0.5 and page["draft_align_kl_to_initial"] == 0.25
    assert page["draft_align_accept_len"] == 2.0 and page["draft_align_prom_dropped_names_total"] == 0.0
    lines = (sc.dir / "metrics.jsonl").read_text()
    assert '"rl/reward/mean": 0.5' in lines  # the JSONL/wandb keys stay as the RL job sent them


def test_disk_full_at_publish_and_checkpoint_then_recovery(sidecar_world, until, monkeypatch, caplog):
    import safetensors.torch

    from draft_align.publish.versions import read_latest

    recipe, sc, feeder = sidecar_world
    _warm(sc, feeder, until)
    with monkeypatch.context() as m, caplog.at_level(logging.ERROR):
        m.setattr(safetensors.torch, "save_file", _disk_full)
        assert not sc.maybe_publish(force=True)
        assert re.search(
            r"publish failed: \[Errno 28\] No space left on device: '[^']*model\.safetensors'; "
            r"still serving draft v0000",
            caplog.text,
        ), caplog.text
        assert sc.state.publish_failures == 1 and read_latest(recipe.run_dir) is None
        assert not sc.publish_due(force=True) and not sc.checkpoint_due()  # backing off
        sc.backoff.retry_at = 0.0  # the backoff passed
        sc.checkpoint()  # no exception
        assert sc.state.publish_failures == 2 and sc.backoff.failures == 2
    leftovers = [p.name for d in (recipe.run_dir, sc.dir) if d.is_dir() for p in d.rglob(".tmp*")]
    assert leftovers == []
    sc.backoff.retry_at = 0.0
    assert sc.maybe_publish(force=True)  # space again: published, checkpointed, backoff reset
    assert read_latest(recipe.run_dir) == recipe.run_dir / "drafts" / "v0001" and sc.backoff.failures == 0


def test_restart_on_a_still_full_disk_keeps_serving(sidecar_world, until, monkeypatch, caplog):
    import safetensors.torch

    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar

    recipe, sc, feeder = sidecar_world
    _warm(sc, feeder, until)
    assert sc.maybe_publish(force=True)
    sc.close()
    monkeypatch.setattr(safetensors.torch, "save_file", _disk_full)
    again = Sidecar(recipe, starting_draft(recipe)).setup()
    try:
        with caplog.at_level(logging.ERROR):
            state = again.run(max_seconds=0.5)  # its final checkpoint meets the full disk
        assert state.published_version == 1 and state.publish_failures >= 1 and state.restarts == 1
        assert "checkpoint failed" in caplog.text
    finally:
        again.close()


def test_an_export_error_at_publish_is_a_gate_rejection(sidecar_world, until, monkeypatch, caplog):
    from draft_align.sidecar import gate

    recipe, sc, feeder = sidecar_world
    _warm(sc, feeder, until)
    monkeypatch.setattr(gate, "paired_gate", lambda c, b, t: (True, 0.0, 0.0))
    with torch.no_grad():  # finite in fp32, +inf once cast to the bf16 the engine format holds
        next(p for n, p in sc.trainer.draft.named_parameters() if n.endswith("fc.weight"))[0, 0] = 3.4e38
    rejections = sc.state.gate_rejections
    with caplog.at_level(logging.ERROR):
        assert not sc.maybe_publish(force=True)
    assert sc.state.gate_rejections == rejections + 1
    assert "candidate not published" in caplog.text and "bfloat16" in caplog.text
    assert not (recipe.run_dir / "drafts").exists() or not any((recipe.run_dir / "drafts").iterdir())


def test_poisoned_head_is_rejected_and_nonfinite_steps_drop_the_head(sidecar_world, until, caplog):
    from draft_align.train.records import Record, TappedRecord
    from draft_align.train.replay import ReplayBuffer

    recipe, sc, feeder = sidecar_world
    feeder.step(0, 0)
    assert until(lambda: sc.state.monitor_rows >= 1, 20, every=lambda: sc.drain(0.1, 100))
    # a HeadSync with rows of 3e38 over the real socket: rejected, with its reason
    with torch.no_grad():
        saved = feeder.model.lm_head.weight.clone()
        feeder.model.lm_head.weight.fill_(3e38)
    with caplog.at_level(logging.WARNING):
        feeder.tap.head_sync(5, feeder.d2t)
        assert until(lambda: sc.state.nonfinite_heads >= 1, 10, every=lambda: sc.drain(0.1, 100))
    assert "rows magnitude" in caplog.text and sc.state.head_policy_version == 0
    with torch.no_grad():
        feeder.model.lm_head.weight.copy_(saved)
    # finite but huge states: every step non-finite; after max_consecutive_nonfinite in a row, an alarm
    sc.recipe.sidecar.train.max_consecutive_nonfinite = 3
    sc.ingest.buffer = ReplayBuffer(4000, 2.0, 0, 0)
    h = sc.hidden
    rec = Record(
        input_ids=torch.randint(3, sc.vocab, (20,)),
        loss_mask=torch.arange(20) >= 5,
        aux=torch.full((20, 3 * h), 3e38).bfloat16(),
        final=torch.randn(20, h).bfloat16(),
    )
    assert sc.ingest.buffer_record(TappedRecord(record=rec, policy_version=0, step=0))
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            assert sc.train_one()
    assert sc.state.nonfinite_steps == 3 and sc.state.nonfinite_alarms == 1 and not sc.has_head
    assert "ALARM: 3 non-finite steps in a row" in caplog.text
    assert sc.stats().to_dict()["nonfinite_alarms"] == 1
    assert sc.next_batch() is None  # waits for the next head
    feeder.tap.head_sync(1, feeder.d2t)
    assert until(lambda: sc.has_head, 10, every=lambda: sc.drain(0.1, 100))
    assert sc.state.head_policy_version == 1


@pytest.fixture
def published_twice(sidecar_world, until):
    """A sidecar that published v1 and v2 and checkpointed, then closed."""
    recipe, sc, feeder = sidecar_world
    _warm(sc, feeder, until)
    assert sc.maybe_publish(force=True)
    for _ in range(2):
        assert sc.train_one()
    assert sc.maybe_publish(force=True)
    sc.close()
    return recipe


def _restart(recipe: CotrainRecipe):
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar

    return Sidecar(recipe, starting_draft(recipe)).setup()


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)


def test_corrupt_newest_version_and_checkpoint_fall_back(published_twice, caplog):
    from draft_align.publish import load_draft

    recipe = published_twice
    run = recipe.run_dir
    v1, v2 = run / "drafts" / "v0001", run / "drafts" / "v0002"
    (v2 / "model.safetensors").write_bytes((v2 / "model.safetensors").read_bytes()[:100])
    (run / "sidecar" / "trainer" / "state.safetensors").write_bytes(b"garbage")
    state = json.loads((run / "sidecar" / "state.json").read_text())
    (run / "sidecar" / "state.json").write_text(json.dumps({**state, "from_a_newer_sidecar": 1}))
    with caplog.at_level(logging.WARNING):
        sc = _restart(recipe)
    try:
        assert "falling back to" in caplog.text and str(v1) in caplog.text
        assert "from_a_newer_sidecar" in caplog.text
        assert _same(sc.gate.published, load_draft(v1)[0])
        assert not sc.resumed and list((run / "sidecar").glob(".corrupt-trainer-*"))
        assert sc.state.published_version == 2 and sc.state.restarts == 1
    finally:
        sc.close()


def test_forged_manifest_and_unreadable_state_at_restart(published_twice, caplog):
    from draft_align.publish import load_draft

    recipe = published_twice
    run = recipe.run_dir
    v2 = run / "drafts" / "v0002"
    man = json.loads((v2 / "manifest.json").read_text())
    (v2 / "manifest.json").write_text(json.dumps({**man, "draft_version": 999}))
    (run / "sidecar" / "state.json").write_text("{half a json")
    with caplog.at_level(logging.WARNING):
        sc = _restart(recipe)
    try:
        assert "draft_version 999, the folder is version 2" in caplog.text
        assert _same(sc.gate.published, load_draft(run / "drafts" / "v0001")[0])
        assert sc.state.published_version == 1  # the folder's number, never the manifest's 999
        assert list((run / "sidecar").glob(".corrupt-state.json-*")) and not sc.resumed
    finally:
        sc.close()


def test_retention_keeps_the_newest_versions_and_latest(tiny_run, tiny_env, tmp_path, until, feeder_cls):
    from draft_align.publish.versions import published_versions, read_latest
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar

    recipe = load_recipe(
        None, [*tiny_run.cotrain_overrides(tmp_path), "sidecar.publish.keep_versions=2"], CotrainRecipe
    )
    sc = Sidecar(recipe, starting_draft(recipe)).setup()
    feeder = feeder_cls(recipe, sc.frozen.draft_to_target, sc.aux_ids)
    try:
        _warm(sc, feeder, until)
        for _ in range(4):
            assert sc.train_one()
            assert sc.maybe_publish(force=True)
        assert [p.name for p in published_versions(recipe.run_dir)] == ["v0004", "v0003"]
        assert read_latest(recipe.run_dir) == recipe.run_dir / "drafts" / "v0004"
    finally:
        feeder.close()
        sc.close()
