"""draft_align inside real verl workers: verl's own ``RayWorkerGroup`` on CPU resources of a real local Ray
cluster (127.0.0.1) hosts ``DraftAlignActorRolloutRefWorker`` (verl's ``ActorRolloutRefWorker``, role "actor",
built by verl from verl's own generated trainer config on the tiny target: FSDP2 engine, gloo; through the CPU
subclass of verl_cpu_worker.py, which only joins the gloo group verl cannot join on a CPU); each worker
finds the Ray-hosted sidecar the driver started in the run's registry, taps verl's old-log-prob pass
(``compute_log_prob`` through the worker group's dispatch) and sends to it; the sidecar trains and publishes,
and the driver's step boundary picks up a draft version >= 1.  Then the sidecar killed in the middle of
that run: verl goes on, drops counted, the last verified draft serving (and, restarted by Ray, newer ones)."""

from __future__ import annotations

import pytest
import verl
from omegaconf import OmegaConf
from verl.utils import tensordict_utils as tu

from draft_align.config import RESOLVED_RECIPE
from draft_align.integrations.verl.driver import VerlDraftAlign
from tests.integrations.ray.conftest import local_cluster, worker_env
from tests.integrations.verl.test_driver import rollout_batch

pytestmark = [pytest.mark.usefixtures("tiny_env"), pytest.mark.ray]

VERL_DEFAULTS = f"{verl.__path__[0]}/trainer/config/_generated_ppo_trainer.yaml"


def actor_config(model: str, recipe: str):
    """``actor_rollout_ref`` of verl's generated PPO trainer config for a one-rank FSDP2 actor on this CPU
    (float32, no torch.compile, micro-batches of 2), with draft_align's recipe key."""
    base = OmegaConf.load(VERL_DEFAULTS)
    OmegaConf.set_struct(base, False)
    merged = OmegaConf.merge(
        base,
        OmegaConf.from_dotlist(
            [
                f"actor_rollout_ref.model.path={model}",
                "actor_rollout_ref.model.use_remove_padding=true",
                "actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                "actor_rollout_ref.actor.strategy=fsdp2",
                "actor_rollout_ref.actor.use_torch_compile=false",
                "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
                "actor_rollout_ref.actor.fsdp_config.dtype=float32",
                "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                f"actor_rollout_ref.draft_align.recipe={recipe}",
            ]
        ),
    )
    OmegaConf.resolve(merged)
    return merged.actor_rollout_ref


def actor_worker_group(model, da: VerlDraftAlign):
    """verl's ``RayWorkerGroup`` of one ``CPUDraftAlignActorRolloutRefWorker`` (role "actor") on one CPU of the
    running cluster, its model initialised by verl (``init_model``: the Tap finds ``da``'s sidecar)."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl_cpu_platform import worker_env as cpu_worker_env
    from verl_cpu_worker import CPUDraftAlignActorRolloutRefWorker

    from draft_align.integrations.ray.runtime import import_ray

    config = actor_config(str(model), str(da.recipe.run_dir / RESOLVED_RECIPE))
    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(
            cls=import_ray().remote(CPUDraftAlignActorRolloutRefWorker), config=config, role="actor"
        ),
        device_name="cpu",
        worker_env=cpu_worker_env(worker_env()["PYTHONPATH"]),
    )
    assert wg.world_size == 1
    wg.init_model()
    return wg


def test_verl_workers_tap_old_log_prob_passes_for_a_ray_sidecar_that_publishes(tiny_run, tmp_path, until):
    with local_cluster(tiny_run.world.home) as namespace:
        over = tiny_run.cotrain_overrides(
            tmp_path, run="verlwg", **{"sidecar.host": "ray", "ray.namespace": namespace, "ray.num_cpus": 1}
        )
        da = VerlDraftAlign({}, None, over, check=False)
        endpoints = da.start()  # before the workers: they find its endpoints in the run's registry
        try:
            assert endpoints is not None
            wg = actor_worker_group(tiny_run.world.model, da)
            vocab = _vocab(tiny_run.world.model)
            seen: list[dict[str, float]] = []
            step = 0

            def rl_step():
                nonlocal step
                step += 1
                out = wg.compute_log_prob(rollout_batch(vocab, step))  # verl's dispatch to every actor rank
                assert out is not None and "log_probs" in out.keys()
                seen.append(da.step_end(step, {"reward_mean": 0.5}))

            published = until(
                lambda: seen and seen[-1]["draft_align/draft_version"] >= 1, 120, every=rl_step, poll_s=0.5
            )
            ref = rollout_batch(vocab, 0)
            tu.assign_non_tensor(ref, calculate_entropy=False)  # the reference pass as verl sends it
            assert "log_probs" in wg.compute_log_prob(ref).keys()
            (stats,) = wg.draft_align_stats()  # one dict per rank, from inside the verl worker
            assert published, (seen[-1:], stats, da.sidecar.status())
            last = seen[-1]
            assert last["draft_align/sidecar_alive"] == 1.0
            assert last["draft_align/sidecar_published_version"] >= 1
            assert last["draft_align/draft_failures"] == 0.0
            assert (
                stats["tapped_calls"] == step and stats["skipped_calls"] == 1
            )  # the reference pass: untapped
            assert stats["micro_batches"] >= 2 * step  # 4 rollouts, micro-batches of 2 (verl's config)
            assert stats["tap_tokens_offered"] > 0 and stats["tap_head_syncs"] >= 1
            # every message the worker's Tap offered is valid on the wire (the FSDP2 HeadSync once was not)
            assert stats["wire_sent"] >= 2 and stats["wire_dropped_invalid"] == 0
        finally:
            final = da.stop(exit_timeout_s=60)
        assert final is not None and final["error"] is None


def _process_gone(pid: int) -> bool:
    import psutil  # Ray's dependency

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _vocab(model_dir) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir).vocab_size)


@pytest.mark.parametrize("restart", [False, True], ids=["killed", "restarted"])
def test_verl_run_goes_on_when_its_ray_sidecar_is_killed(tiny_run, tmp_path, until, caplog, restart):
    """``ray.kill`` of the sidecar actor in the middle of a verl run (after a first draft was picked up).
    killed (``ray.max_restarts=0``, ``no_restart``): verl's steps go on with no error, the worker's Tap keeps
    tapping and its sender counts the drops, the driver's step boundary says ``sidecar_alive`` 0 (one ERROR
    line) and serves the last verified draft, never an older one; ``stop()`` returns.  restarted (Ray restarts
    it once): the run picks up a draft newer than any published before the kill."""
    from draft_align.engines.rollout_types import DraftVersion
    from draft_align.integrations.ray.runtime import import_ray
    from draft_align.publish.versions import read_latest

    ray = import_ray()
    with local_cluster(tiny_run.world.home) as namespace:
        over = tiny_run.cotrain_overrides(
            tmp_path,
            run="verlk9" + ("r" if restart else ""),
            **{
                "sidecar.host": "ray",
                "ray.namespace": namespace,
                "ray.num_cpus": 1,
                "ray.max_restarts": int(restart),
            },
        )
        da = VerlDraftAlign({}, None, over, check=False)
        assert da.start() is not None
        run_dir = da.recipe.run_dir
        try:
            wg = actor_worker_group(tiny_run.world.model, da)
            vocab = _vocab(tiny_run.world.model)
            seen: list[dict[str, float]] = []
            step = 0

            def rl_step():
                nonlocal step
                step += 1
                # verl's dispatch to every actor rank (a worker's error raises here)
                out = wg.compute_log_prob(rollout_batch(vocab, step))
                assert out is not None and "log_probs" in out.keys()
                # the step boundary: the policy version update_weights(global_steps) gives the Tap (its next
                # pass sends that version's HeadSync, as each step of a verl run does)
                wg.draft_align_set_version(step)
                seen.append(da.step_end(step, {"reward_mean": 0.5}))

            def version() -> float:
                return seen[-1]["draft_align/draft_version"] if seen else 0.0

            assert until(lambda: version() >= 1, 120, every=rl_step, poll_s=0.5), seen[-1:]
            assert seen[-1]["draft_align/sidecar_alive"] == 1.0
            (tap_before,) = wg.draft_align_stats()
            before = seen[-1]
            first_pid = da.sidecar.status()["pid"]
            with caplog.at_level("WARNING", logger="draft_align.integrations.verl.driver"):
                ray.kill(da.sidecar.actor, no_restart=not restart)
                killed_at = step
                if not restart:
                    assert until(lambda: da.sidecar.status() is None, 30)  # Ray says the actor died
                    assert until(lambda: _process_gone(first_pid), 30)  # and its process has (it may lag)
                    newest = read_latest(run_dir)  # nothing is published after this
                    assert newest is not None
                    last_published = DraftVersion.read(newest).version
                    for _ in range(3):
                        rl_step()
                    # verl steps on until the newest verified draft serves (its hash may still be being checked)
                    assert until(lambda: version() == last_published, 60, every=rl_step, poll_s=0.2), (
                        seen[-1],
                        last_published,
                    )
                else:

                    def restarted() -> bool:
                        s = da.sidecar.status()
                        return s is not None and s["pid"] != first_pid and s["reconstructed"]

                    assert until(restarted, 120, every=rl_step, poll_s=0.2)
                    newest = read_latest(run_dir)  # all the killed process published
                    published_before = DraftVersion.read(newest).version if newest is not None else 0
                    assert until(lambda: version() > published_before, 120, every=rl_step, poll_s=0.2), (
                        seen[-1],
                        da.sidecar.status(),
                        wg.draft_align_stats(),
                        published_before,
                    )
            after = seen[killed_at:]
            versions = [m["draft_align/draft_version"] for m in seen]
            assert versions == sorted(versions)  # the draft served never goes back
            assert min(versions[killed_at:]) >= before["draft_align/draft_version"]
            assert all(m["draft_align/draft_failures"] == 0.0 for m in seen)

            def accounted() -> dict[str, float] | None:
                """The worker rank's counters once its sender has sent or dropped all it was offered."""
                (s,) = wg.draft_align_stats()
                dropped = sum(v for k, v in s.items() if k.startswith("wire_dropped_"))
                done = s["wire_queue_depth"] == 0 and s["wire_offered"] == s["wire_sent"] + dropped
                return s if done else None

            assert until(accounted, 10)
            tap_after = accounted()
            assert tap_after is not None
            assert tap_after["tapped_calls"] == step  # every verl step's old-log-prob pass was tapped
            assert tap_after["tap_messages_offered"] + tap_after["tap_messages_dropped"] > (
                tap_before["tap_messages_offered"] + tap_before["tap_messages_dropped"]
            )  # the Tap kept shipping
            gone = [
                r.getMessage()
                for r in caplog.records
                if r.name == "draft_align.integrations.verl.driver" and r.levelname == "ERROR"
            ]
            if not restart:
                assert all(m["draft_align/sidecar_alive"] == 0.0 for m in after)
                # nothing newer: the sidecar is dead, its last verified draft serves
                assert max(versions) == last_published
                assert tap_after["wire_dropped_peer"] > tap_before["wire_dropped_peer"], tap_after
                assert seen[-1]["draft_align/wire_dropped_peer"] > before["draft_align/wire_dropped_peer"]
                assert len(gone) == 1 and "is gone" in gone[0] and "keeps serving" in gone[0], gone
            else:
                assert seen[-1]["draft_align/sidecar_alive"] == 1.0
                assert len(gone) <= 1  # a boundary that waited on the restarting actor saw it gone, once
        finally:
            final = da.stop(exit_timeout_s=60)
        if not restart:
            assert final is None  # a dead sidecar has no final status; stop() returned all the same
