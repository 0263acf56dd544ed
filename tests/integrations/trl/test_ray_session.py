"""DraftAlign(sidecar="ray") beside a real TRL GRPOTrainer on the tiny target: the sidecar runs as an actor on a
local Ray cluster (tests/integrations/ray/conftest.py), the Tap sends to the endpoint it reported, drafts come
back through the registry, and the job-lifetime sidecar is removed at the end."""

from __future__ import annotations

import os
import time

import pytest

from draft_align.config import CotrainRecipe, load_recipe

os.environ.update(  # before Ray is imported (tests/integrations/ray/conftest.py says why)
    {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}
)
ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def ray_namespace(tiny_world):
    from tests.integrations.ray.conftest import local_cluster

    with local_cluster(tiny_world.home) as namespace:
        yield namespace


def test_trl_run_with_the_sidecar_on_ray(ray_namespace, tiny_run, tiny_env, tmp_path, make_trainer):
    from draft_align.integrations.ray.client import RaySidecar
    from draft_align.integrations.trl import DraftAlign

    over = tiny_run.cotrain_overrides(
        tmp_path, run="trlray", **{"ray.namespace": ray_namespace, "logging.trl_metrics": "full"}
    )
    recipe = load_recipe(None, over, CotrainRecipe)
    da = DraftAlign(recipe, sidecar="ray", exit_timeout_s=60)
    trainer = make_trainer(rollout_func=da.rollout_func, max_steps=3)
    cb = da.callback(trainer)
    trainer.add_callback(cb)
    trainer.train()
    assert cb.sidecar_rc == 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    assert all(h["draft_align/tap_tokens_accepted"] > 0 for h in logs)
    assert sum(h["draft_align/wire_sent"] for h in logs[-1:]) > 0
    assert (da.run_dir / "latest").exists() and (da.run_dir / "sidecar" / "monitor.jsonl").exists()
    assert da.notify.failures == 0 and da.notify.timeouts == 0
    deadline = time.monotonic() + 30  # lifetime job: removed with the run (the name is freed shortly after)
    while RaySidecar.attach(recipe) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert RaySidecar.attach(recipe) is None
