"""The sidecar placed on the second node of a two-node mini-cluster (``ray.cluster_utils.Cluster``, both nodes
on 127.0.0.1) by a custom resource; the driver on the head node finds its endpoint through the registry, taps
reach it over tcp, and its publish comes back through the registry."""

from __future__ import annotations

import uuid

import pytest

from draft_align.config import RESOLVED_RECIPE, CotrainRecipe, load_recipe, save_recipe

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.usefixtures("tiny_env"), pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def two_nodes(tiny_world):
    from ray.cluster_utils import Cluster

    from tests.integrations.ray.conftest import worker_env

    node = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
    cluster = Cluster(
        initialize_head=True, head_node_args={**node, "num_cpus": 2, "include_dashboard": False}
    )
    second = cluster.add_node(**node, num_cpus=2, resources={"draft_node": 2})
    namespace = f"da-test-{uuid.uuid4().hex[:8]}"
    ray.init(
        address=cluster.address,
        namespace=namespace,
        log_to_driver=False,
        runtime_env={"env_vars": worker_env(tiny_world.home)},
    )
    yield namespace, second.node_id
    ray.shutdown()
    cluster.shutdown()


def test_sidecar_on_the_second_node_found_through_the_registry(
    two_nodes, tiny_run, tmp_path, feeder_cls, until
):
    from draft_align.integrations.ray.client import RaySidecar
    from draft_align.publish import load_draft
    from draft_align.publish.tap_spec import read_tap_spec
    from draft_align.rl.drafts import DraftSource
    from draft_align.sidecar.launch import starting_draft

    namespace, second_node = two_nodes
    over = tiny_run.cotrain_overrides(
        tmp_path,
        run="r5",
        **{"sidecar.host": "ray", "ray.namespace": namespace, "ray.resources": "{draft_node: 1}"},
    )
    recipe = load_recipe(None, over, CotrainRecipe)
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    resolved = save_recipe(recipe, recipe.run_dir / RESOLVED_RECIPE)
    sc = RaySidecar.start(recipe, tiny_run.run_dir, resolved)
    feeder = None
    try:
        endpoints = sc.ready(timeout_s=120)
        assert endpoints is not None
        info = ray.get(sc.actor.ready.remote(), timeout=30)
        assert info["node_id"] == second_node  # placed by its resource, not beside the driver
        assert ray.get_runtime_context().get_node_id() != second_node
        assert sc.endpoints() == endpoints  # what the registry tells any node
        start = starting_draft(recipe)
        frozen, _ = load_draft(start, verify=True)
        feeder = feeder_cls(recipe, frozen.draft_to_target, read_tap_spec(start).aux_layer_ids, endpoints)
        drafts = DraftSource(recipe.run_dir, start, notifications=sc.notifications())
        step = 0

        def feed():
            nonlocal step
            feeder.step(step, version=step + 1)
            step += 1
            drafts.poll()

        assert until(lambda: drafts.notified >= 1, 90, every=feed, poll_s=0.5), sc.status()
    finally:
        if feeder is not None:
            feeder.close()
        sc.stop(timeout_s=30)
