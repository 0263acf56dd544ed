"""draft_align beside verl on a real local Ray cluster (127.0.0.1): the driver starts the sidecar on its own Ray
resources (the Ray integration's actor), an actor rank's Tap on verl's FSDP engine sends the old-log-prob pass
of verl batches to it, the sidecar trains and publishes, and the driver's step boundary picks the draft up and
returns draft_align's metrics for verl's tracking."""

from __future__ import annotations

import random

import pytest
import torch
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from draft_align.integrations.verl.checks import VerlConfigError
from draft_align.integrations.verl.driver import VerlDraftAlign
from draft_align.integrations.verl.tap import worker_tap
from tests.integrations.ray.conftest import local_cluster

pytestmark = [pytest.mark.usefixtures("tiny_env"), pytest.mark.ray]


def rollout_batch(vocab: int, step: int, n: int = 4):
    """An old-log-prob TensorDict as ``_compute_old_log_prob`` sends it: left-padded prompts, right-padded
    responses of random tokens (1..vocab-1; 0 pads)."""
    rng = random.Random(step)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randrange(3, 8))] for _ in range(n)]
    responses = [[rng.randrange(1, vocab) for _ in range(rng.randrange(8, 24))] for _ in range(n)]
    p_w, r_w = max(map(len, prompts)), max(map(len, responses))
    p = torch.tensor([[0] * (p_w - len(x)) + x for x in prompts])
    r = torch.tensor([x + [0] * (r_w - len(x)) for x in responses])
    am = torch.cat([p != 0, r != 0], dim=1).long()
    data = DataProto.from_dict(
        tensors={
            "prompts": p,
            "responses": r,
            "input_ids": torch.cat([p, r], dim=1),
            "attention_mask": am,
            "position_ids": torch.clamp(am.cumsum(dim=1) - 1, min=0),
            "response_mask": (r != 0).long(),
        },
        meta_info={"temperature": 1.0},
    )
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td,
        calculate_entropy=True,
        compute_loss=False,
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        use_fused_kernels=False,
    )
    return td


def test_sidecar_on_ray_trains_on_verl_taps_and_the_driver_picks_up_its_drafts(
    gloo_world, tiny_run, tmp_path, until
):
    from transformers import AutoModelForCausalLM

    from tests.integrations.verl.test_tap import engine_for

    with local_cluster(tiny_run.world.home) as namespace:
        over = tiny_run.cotrain_overrides(
            tmp_path, run="verl1", **{"sidecar.host": "ray", "ray.namespace": namespace, "ray.num_cpus": 1}
        )
        with pytest.raises(VerlConfigError, match="rollout.name=None"):  # verl's config is checked first
            VerlDraftAlign({}, None, over)
        da = VerlDraftAlign({}, None, over, check=False)
        endpoints = da.start()
        try:
            assert endpoints is not None and endpoints[0].startswith("tcp://127.0.0.1:")
            model = AutoModelForCausalLM.from_pretrained(tiny_run.world.model, dtype=torch.float32).eval()
            engine = engine_for(model, use_remove_padding=True)
            vtap = worker_tap(engine, da.recipe, endpoints, rank=0)
            vocab = int(model.config.vocab_size)
            seen: list[dict[str, float]] = []
            step = 0

            def rl_step():
                nonlocal step
                step += 1
                vtap.set_version(step - 1)  # update_weights(global_steps=step-1) at the end of the last step
                td = rollout_batch(vocab, step)
                with vtap.log_prob_call(td) as tapped:
                    engine.forward_backward_batch(td, loss_function=None, forward_only=True)
                assert tapped
                seen.append(da.step_end(step, {"reward_mean": 0.5}))

            assert until(
                lambda: seen and seen[-1]["draft_align/draft_version"] >= 1, 120, every=rl_step, poll_s=0.5
            )
            last = seen[-1]
            assert last["draft_align/sidecar_alive"] == 1.0
            assert last["draft_align/sidecar_published_version"] >= 1
            assert last["draft_align/draft_failures"] == 0.0
            assert all(k.startswith("draft_align/") for k in last)
            stats = vtap.tap.stats()
            assert stats["tokens_offered"] > 0 and stats["head_syncs"] >= 1
            assert vtap.tap.sink.stats()["sent"] >= 1
            vtap.tap.sink.close(timeout_s=5.0)
        finally:
            final = da.stop(exit_timeout_s=60)
        assert final is not None and final["error"] is None
