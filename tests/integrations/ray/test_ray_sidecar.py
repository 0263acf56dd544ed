"""draft_align.integrations.ray on a real local Ray cluster (tests/integrations/ray/conftest.py): a Ray-hosted
sidecar trains on taps sent over tcp loopback and publishes drafts the RL side picks up through the registry;
SIGKILL of its process restarts it (resumed, nothing torn, the Tap never blocks); a dead registry and a missing
Ray or cluster fail soft or in one line."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from draft_align.config import RESOLVED_RECIPE, CotrainRecipe, load_recipe, save_recipe
from draft_align.wire.keys import resolve_key

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.usefixtures("tiny_env"), pytest.mark.ray]


def _recipe(tiny_run, tmp_path: Path, namespace: str, run: str, **extra) -> tuple[CotrainRecipe, Path]:
    over = tiny_run.cotrain_overrides(
        tmp_path, run=run, **{"sidecar.host": "ray", "ray.namespace": namespace, "ray.num_cpus": 1, **extra}
    )
    recipe = load_recipe(None, over, CotrainRecipe)
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    resolve_key(recipe.wire.key_file, recipe.run_dir, create=True)  # as the launchers do before Ray starts
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


class TimedOffers:
    """Wraps a TapSender's ``offer`` to record how long each call took (the Tap must never block)."""

    def __init__(self, sender) -> None:
        self.sender = sender
        self.seconds: list[float] = []
        inner = sender.offer

        def offer(msg):
            t0 = time.perf_counter()
            try:
                return inner(msg)
            finally:
                self.seconds.append(time.perf_counter() - t0)

        sender.offer = offer


@pytest.mark.slow
def test_sigkill_mid_training_restarts_resumes_and_never_blocks_the_tap(
    ray_cluster, tiny_run, tmp_path, feeder_cls, until
):
    """SIGKILL of the actor's process while it trains and publishes (killed as soon as a publish is being
    written, when one is seen within the window): Ray restarts it, it resumes from the run folder on the same
    port, publishes again, every version verifies; the policy side's offers never wait."""
    from draft_align.integrations.ray.client import RaySidecar
    from draft_align.publish.versions import DRAFTS_DIR
    from draft_align.rl.drafts import DraftSource

    recipe, resolved = _recipe(tiny_run, tmp_path, ray_cluster, "r3", **{"ray.max_restarts": 2})
    sc = RaySidecar.start(recipe, tiny_run.run_dir, resolved)
    feeder = None
    try:
        endpoints = sc.ready(timeout_s=90)
        assert endpoints is not None
        start, feeder = _policy_side(recipe, endpoints, feeder_cls)
        offers = TimedOffers(feeder.sender)
        drafts = DraftSource(recipe.run_dir, start, notifications=sc.notifications())
        step = 0

        def feed():
            nonlocal step
            feeder.step(step, version=step + 1)
            step += 1
            drafts.poll()

        assert until(lambda: (sc.status() or {}).get("published_version", 0) >= 1, 60, every=feed, poll_s=0.3)
        before = sc.status()
        drafts_dir = recipe.run_dir / DRAFTS_DIR
        killed = threading.Event()
        mid_publish: list[bool] = []

        def kill_when_publishing() -> None:  # a tight watch: a tiny draft's export takes milliseconds
            end = time.monotonic() + 15
            while time.monotonic() < end and not any(drafts_dir.glob(".tmp-*")):
                time.sleep(0.001)
            mid_publish.append(time.monotonic() < end)
            os.kill(before["pid"], signal.SIGKILL)
            killed.set()

        watcher = threading.Thread(target=kill_when_publishing, daemon=True)
        watcher.start()
        assert until(killed.is_set, 30, every=feed, poll_s=0.0)
        killed_at_version = before["published_version"]

        def restarted() -> bool:
            s = sc.status()
            return s is not None and s["pid"] != before["pid"] and s["reconstructed"]

        assert until(restarted, 60, every=feed, poll_s=0.5)
        after = sc.status()
        assert after["resumed"] and after["restarts"] >= 1
        assert sc.ready(timeout_s=30) == endpoints  # the same port again: the Tap reconnected by itself
        assert until(
            lambda: (sc.status() or {}).get("published_version", 0) > killed_at_version,
            60,
            every=feed,
            poll_s=0.3,
        ), sc.status()
        assert until(lambda: drafts.current_version > killed_at_version, 20, every=feed, poll_s=0.3)

        def accounted() -> bool:  # every message offered was sent or counted as dropped
            stats = feeder.sender.stats()
            dropped = sum(v for k, v in stats.items() if k.startswith("dropped_"))
            return stats["queue_depth"] == 0 and stats["offered"] == stats["sent"] + dropped

        assert until(accounted, 10), feeder.sender.stats()
        stats = feeder.sender.stats()
        dropped = sum(v for k, v in stats.items() if k.startswith("dropped_"))
        assert max(offers.seconds) < 0.25, max(offers.seconds)  # never blocked across the outage
        print(
            f"mid_publish={mid_publish} dropped={dropped} offers={len(offers.seconds)} max_offer_s={max(offers.seconds):.4f}"
        )
    finally:
        if feeder is not None:
            feeder.close()
        sc.stop(timeout_s=30)
    versions = _versions_verify(recipe.run_dir)  # no torn publish: every version folder verifies
    assert max(versions) > killed_at_version and len(set(versions)) == len(versions)


def test_dead_registry_falls_back_to_latest_counted(ray_cluster, tiny_run, tmp_path):
    """The registry killed for good: RayNotifications never blocks, counts the failure, and the DraftSource
    reads ``latest`` instead — a version published after the registry died is still picked up."""
    from draft_align.integrations.ray.registry import RayNotifications, registry_actor
    from draft_align.integrations.ray.runtime import identity_of
    from draft_align.publish.versions import DRAFTS_DIR, read_latest, write_latest
    from draft_align.rl.drafts import DraftSource
    from draft_align.sidecar.launch import starting_draft

    recipe, _ = _recipe(tiny_run, tmp_path, ray_cluster, "r_dead")
    identity = identity_of(recipe)
    registry = registry_actor(recipe.run_dir, recipe.run, ray_cluster, identity=identity, detached=False)
    start = starting_draft(recipe)
    notes = RayNotifications(identity, ray_cluster, timeout_s=1.0, retry_s=0.0)
    drafts = DraftSource(recipe.run_dir, start, notifications=notes)
    assert ray.get(registry.info.remote(), timeout=30)["newest_version"] == 0
    ray.kill(registry, no_restart=True)
    published = recipe.run_dir / DRAFTS_DIR / start.name  # a version the sidecar could have published
    shutil.copytree(start, published)
    write_latest(recipe.run_dir, published)
    t0 = time.perf_counter()
    for _ in range(20):
        drafts.poll()
    assert time.perf_counter() - t0 < 5.0  # 20 polls: none waited on the dead registry
    assert drafts.current_version >= 1 and drafts.adapted_version.path == read_latest(recipe.run_dir)
    assert notes.notified == 0 and notes.failures >= 1 and notes.fallbacks >= 1


@pytest.mark.slow
def test_two_rank_gang_over_gloo_restarts_after_a_worker_dies_and_ends_identical(
    ray_cluster, tiny_run, tmp_path, feeder_cls, until
):
    """``sidecar.ranks=2`` under Ray Train (gloo, one CPU bundle per rank): both ranks register their own
    endpoint and train; SIGKILL of rank 1's worker makes Ray Train restart the gang, which resumes from rank 0's
    checkpoint and publishes again; after the final report both ranks end with bit-identical weights."""
    from draft_align.integrations.ray.client import RaySidecar
    from draft_align.rl.drafts import DraftSource
    from draft_align.wire.messages import StepReport

    recipe, resolved = _recipe(
        tiny_run,
        tmp_path,
        ray_cluster,
        "r4",
        **{"sidecar.ranks": 2, "ray.max_failures": 1, "sidecar.collective_timeout_s": 20.0},
    )
    sc = RaySidecar.start(recipe, tiny_run.run_dir, resolved)
    feeder = None
    try:
        endpoints = sc.ready(timeout_s=150)
        assert endpoints is not None and len(endpoints) == 2 and endpoints[0] != endpoints[1]
        start, feeder = _policy_side(recipe, endpoints, feeder_cls)
        drafts = DraftSource(recipe.run_dir, start, notifications=sc.notifications())
        step = 0

        def feed():
            nonlocal step
            feeder.step(step, version=step + 1)
            step += 1
            drafts.poll()

        assert until(lambda: drafts.current_version >= 1, 90, every=feed, poll_s=0.3), sc.status()
        ranks = sc.status()["ranks"]
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        published_before = drafts.current_version

        def restarted() -> bool:
            r = (sc.status() or {}).get("ranks", {})
            return all(r.get(i, {}).get("starts", 0) >= 2 and r[i].get("running") for i in (0, 1))

        assert until(restarted, 150, poll_s=1.0), sc.status()
        ranks = sc.status()["ranks"]
        assert ranks[0]["resumed"] and ranks[1]["resumed"]  # from rank 0's checkpoint in the run folder
        assert sc.endpoints() is not None
        assert until(lambda: drafts.current_version > published_before, 90, every=feed, poll_s=0.3)
        feeder.sender.offer(
            StepReport(run_id=recipe.run, step=step, policy_version=step, metrics={"final": 1.0})
        )
        assert until(lambda: not (sc.status() or {"running": True})["running"], 90, poll_s=1.0), sc.status()
        final = sc.status()
        assert final["error"] is None and final["done"]
        digests = {r: final["ranks"][r]["weights_digest"] for r in (0, 1)}
        assert digests[0] is not None and digests[0] == digests[1], digests
        assert final["ranks"][0]["train_steps"] == final["ranks"][1]["train_steps"] >= 1
    finally:
        if feeder is not None:
            feeder.close()
        sc.stop(timeout_s=30)
    _versions_verify(recipe.run_dir)


def _cli(*args: str, timeout: float = 240) -> tuple[int, str]:
    """``python -m draft_align ARGS`` as a separate driver process; (exit code, stdout)."""
    from tests.integrations.ray.conftest import REPO, worker_env

    env = {**os.environ, "PYTHONPATH": worker_env()["PYTHONPATH"]}
    proc = subprocess.run(
        [sys.executable, "-m", "draft_align", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.returncode, proc.stdout


@pytest.mark.slow
def test_cli_starts_a_detached_sidecar_that_a_new_driver_re_attaches_to(ray_cluster, tiny_run, tmp_path):
    """``draft-align ray start`` (its own driver process, which then exits) leaves a detached sidecar; this
    process, standing for a restarted RL driver, re-attaches to it by run name; ``status`` and ``stop`` (two more
    driver processes) inspect and remove it."""
    from draft_align.integrations.ray.client import RaySidecar

    recipe, resolved = _recipe(tiny_run, tmp_path, ray_cluster, "r6")
    address = f"ray.address={ray.get_runtime_context().gcs_address}"
    _, out = _cli("ray", "start", str(resolved), address, "ray.ready_timeout_s=240", timeout=360)
    started = json.loads(out[out.index("{") :])
    assert started["namespace"] == ray_cluster and started["endpoints"][0].startswith("tcp://127.0.0.1:")
    sc = RaySidecar.attach(recipe)  # the starting driver is gone: the sidecar outlived it
    assert sc is not None and sc.ready(timeout_s=30) == started["endpoints"]
    assert sc.status()["running"]
    _, out = _cli("ray", "status", str(resolved), address)
    status = json.loads(out[out.index("{") :])
    assert status["status"]["running"] and status["endpoints"] == started["endpoints"]
    _, out = _cli("ray", "stop", str(resolved), address, "--timeout", "30")
    stopped = json.loads(out[out.index("{") :])
    assert stopped["final_status"]["running"] is False and stopped["final_status"]["error"] is None
    deadline = time.monotonic() + 30
    while RaySidecar.attach(recipe) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert RaySidecar.attach(recipe) is None


@pytest.mark.slow
def test_cotrain_places_its_sidecar_on_ray(ray_cluster, tiny_run, tmp_path):
    """``sidecar.host=ray``: draft-align cotrain's GRPO job taps a sidecar actor over tcp, picks up drafts
    through the registry, and the job-lifetime sidecar ends cleanly (exit code 0) and is removed."""
    from draft_align.cotrain import run_cotrain
    from draft_align.integrations.ray.client import RaySidecar

    over = tiny_run.cotrain_overrides(
        tmp_path, run="r7", **{"rl.steps": 3, "sidecar.host": "ray", "ray.namespace": ray_cluster}
    )
    recipe = load_recipe(None, over, CotrainRecipe)
    summary = run_cotrain(recipe, out=io.StringIO(), sidecar_exit_timeout_s=120)
    assert summary["sidecar_rc"] == 0
    steps = [json.loads(x) for x in (recipe.run_dir / "rl" / "steps.jsonl").read_text().splitlines() if x]
    assert [int(r["step"]) for r in steps] == [0, 1, 2]
    assert all(r["tap_tokens_accepted"] > 0 for r in steps)  # the actor was up before the first step
    assert (recipe.run_dir / "latest").exists()
    mon = [
        json.loads(x) for x in (recipe.run_dir / "sidecar" / "monitor.jsonl").read_text().splitlines() if x
    ]
    assert [r["step"] for r in mon] == [0, 1, 2]
    deadline = time.monotonic() + 30
    while RaySidecar.attach(recipe) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert RaySidecar.attach(recipe) is None


def test_a_forged_registry_entry_is_refused_and_another_folders_run_is_not_found(
    ray_cluster, tiny_run, tmp_path
):
    """On Ray the run's name was its only identity: ``draft-align ray stop`` from another output folder with the
    same ``run`` stopped another job's sidecar, and a job on the cluster could redirect the endpoints the
    workers tap into.  Actor names now carry an HMAC of the run folder under the run's key, and an endpoint is
    used only with its rank's signature."""
    from draft_align.integrations.ray.client import RaySidecar
    from draft_align.integrations.ray.registry import registry_actor
    from draft_align.integrations.ray.runtime import identity_of, sign_endpoint
    from draft_align.wire.keys import resolve_key

    recipe, _ = _recipe(tiny_run, tmp_path / "a", ray_cluster, "same")
    other, _ = _recipe(tiny_run, tmp_path / "b", ray_cluster, "same")
    assert recipe.run == other.run and identity_of(recipe) != identity_of(other)
    registry = registry_actor(
        recipe.run_dir, recipe.run, ray_cluster, identity=identity_of(recipe), detached=False
    )
    try:
        assert RaySidecar.attach(other) is None  # the other folder's `ray stop` finds nothing of this run
        handle = RaySidecar(recipe, None, registry)
        key = resolve_key(recipe.wire.key_file, recipe.run_dir, create=False)
        ray.get(registry.register.remote(0, "tcp://10.9.9.9:5555", {}, "f" * 64), timeout=30)  # forged
        assert handle.endpoints() is None and handle.refused_endpoints == 1
        good = "tcp://127.0.0.1:6000"
        ray.get(
            registry.register.remote(0, good, {}, sign_endpoint(key, identity_of(recipe), 0, good)),
            timeout=30,
        )
        assert handle.endpoints() == [good]
    finally:
        ray.kill(registry, no_restart=True)
