"""draft_align.integrations.ray on a real local Ray cluster (tests/integrations/ray/conftest.py): a Ray-hosted
sidecar trains on taps sent over tcp loopback and publishes drafts the RL side picks up through the registry;
SIGKILL of its process restarts it (resumed, nothing torn, the Tap never blocks); a dead registry and a missing
Ray or cluster fail soft or in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from draft_align.config import RESOLVED_RECIPE, CotrainRecipe, load_recipe, save_recipe

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.usefixtures("tiny_env")


def _recipe(tiny_run, tmp_path: Path, namespace: str, run: str, **extra) -> tuple[CotrainRecipe, Path]:
    over = tiny_run.cotrain_overrides(
        tmp_path, run=run, **{"sidecar.host": "ray", "ray.namespace": namespace, "ray.num_cpus": 1, **extra}
    )
    recipe = load_recipe(None, over, CotrainRecipe)
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    return recipe, save_recipe(recipe, recipe.run_dir / RESOLVED_RECIPE)


def _policy_side(recipe: CotrainRecipe, endpoints: list[str], feeder_cls):
    from draft_align.publish import load_draft
    from draft_align.publish.tap_spec import read_tap_spec
    from draft_align.sidecar.launch import starting_draft

    start = starting_draft(recipe)
    frozen, _ = load_draft(start, verify=True)
    return start, feeder_cls(recipe, frozen.draft_to_target, read_tap_spec(start).aux_layer_ids, endpoints)


def _versions_verify(run_dir: Path) -> list[int]:
    """Every published version folder verifies (sha256 of every file); returns their numbers."""
    from draft_align.engines.rollout_types import DraftVersion
    from draft_align.publish.versions import published_versions

    return [DraftVersion.read(p).version for p in published_versions(run_dir)]


def test_actor_trains_publishes_and_rl_side_picks_up_through_registry(
    ray_cluster, tiny_run, tmp_path, feeder_cls, until
):
    from draft_align.engines.rollout_types import DraftVersion
    from draft_align.integrations.ray.client import RaySidecar
    from draft_align.rl.drafts import DraftSource

    recipe, resolved = _recipe(tiny_run, tmp_path, ray_cluster, "r1")
    start = None
    sc = RaySidecar.start(recipe, tiny_run.run_dir, resolved)
    feeder = None
    try:
        endpoints = sc.ready(timeout_s=90)
        assert endpoints is not None and endpoints[0].startswith("tcp://127.0.0.1:")
        assert not endpoints[0].endswith(":*")
        start, feeder = _policy_side(recipe, endpoints, feeder_cls)
        notes = sc.notifications()
        drafts = DraftSource(recipe.run_dir, start, notifications=notes)
        step = 0

        def feed():
            nonlocal step
            feeder.step(step, version=step + 1)
            step += 1
            drafts.poll()

        assert until(lambda: drafts.notified >= 1, 60, every=feed, poll_s=0.5), sc.status()
        got = drafts.adapted_version
        assert got is not None and got.version >= 1
        assert DraftVersion.read(got.path).sha256 == got.sha256  # the files verify against the notification
        assert notes.notified >= 1 and notes.failures == 0
        status = sc.status()
        assert status["running"] and status["train_steps"] >= 1 and status["published_version"] >= 1
        assert status["ingested_messages"] >= 1
        assert feeder.sender.stats()["sent"] >= 1
    finally:
        if feeder is not None:
            feeder.close()
        final = sc.stop(timeout_s=30)
    assert final is not None and not final["running"] and final["error"] is None
    assert _versions_verify(recipe.run_dir)
