"""verl configurations refused at start, on verl 0.9's own generated trainer config."""

from __future__ import annotations

from pathlib import Path

import pytest
import verl
from omegaconf import OmegaConf

from draft_align.integrations.verl.checks import VerlConfigError, check_verl_config, sleep_level

VERL_DEFAULTS = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
EAGLE3 = {"method": "eagle3", "model": "/runs/r/latest", "num_speculative_tokens": 3}


def config(*overrides: str):
    """verl's default PPO trainer config with the keys a draft_align run sets, then ``overrides``."""
    base = OmegaConf.load(VERL_DEFAULTS)
    OmegaConf.set_struct(base, False)  # as Hydra's "+key=value" allows
    ours = [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.draft_align.sleep_level=1",
    ]
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(ours + list(overrides)))
    merged.actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config = dict(EAGLE3)
    return merged


def test_a_draft_align_config_passes():
    check_verl_config(config())
    assert sleep_level(config()) == 1


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["actor_rollout_ref.rollout.name=sglang"],
            "rollout.name=sglang: draft_align refreshes drafts in vLLM",
        ),
        (["actor_rollout_ref.rollout.name=hf"], "rollout.name=hf: that rollout backend runs no EAGLE-3"),
        (["actor_rollout_ref.draft_align.sleep_level=2"], "level-2 sleep"),
        (["actor_rollout_ref.actor.strategy=fsdp"], "strategy=fsdp: the verl Tap follows FSDP2"),
        (["actor_rollout_ref.actor.strategy=megatron"], "strategy=megatron"),
        (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], "ulysses_sequence_parallel_size=2"),
        (
            [
                "actor_rollout_ref.model.lora_rank=8",
                "actor_rollout_ref.model.target_modules=[q_proj,lm_head]",
            ],
            "target_modules includes lm_head",
        ),
    ],
)
def test_what_cannot_work_is_refused_in_one_line(overrides, match):
    with pytest.raises(VerlConfigError, match=match) as err:
        check_verl_config(config(*overrides))
    assert "\n" not in str(err.value)


def test_speculative_config_must_be_eagle3():
    cfg = config()
    cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config = None
    with pytest.raises(VerlConfigError, match="method=None: draft_align serves EAGLE-3 drafts"):
        check_verl_config(cfg)
    cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config = (
        '{"method": "mtp"}'  # vLLM's CLI form
    )
    with pytest.raises(VerlConfigError, match="method=mtp"):
        check_verl_config(cfg)


def test_sleep_levels_follow_verls_rule():
    """verl's default (hybrid, free_cache_engine) sleeps at level 2; no sleep, a LoRA adapter or draft_align's
    server (level 1) keep the draft."""
    assert sleep_level(config("actor_rollout_ref.draft_align.sleep_level=2")) == 2
    assert (
        sleep_level(
            config(
                "actor_rollout_ref.draft_align.sleep_level=2",
                "actor_rollout_ref.rollout.free_cache_engine=false",
            )
        )
        == 0
    )
    assert (
        sleep_level(
            config("actor_rollout_ref.draft_align.sleep_level=2", "actor_rollout_ref.model.lora_rank=8")
        )
        == 1
    )
    merged_lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=true"]
    assert sleep_level(config("actor_rollout_ref.draft_align.sleep_level=2", *merged_lora)) == 2


def test_the_device_scripts_verl_config_composes_and_passes(tmp_path):
    """benchmarks/device/verl_grpo_eagle3.py's overrides are valid for verl's own Hydra config (every key exists
    or is added with +) and pass the checks: what a verl user adds, composed as verl composes it."""
    import argparse
    import importlib.util

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "device" / "verl_grpo_eagle3.py"
    spec = importlib.util.spec_from_file_location("verl_grpo_eagle3", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = argparse.Namespace(model="/m", draft="/d", k=3, steps=2)
    cfg = module.verl_config(
        args, tmp_path, tmp_path / "t", tmp_path / "v", tmp_path / "r.yaml", tmp_path / "r.py"
    )
    check_verl_config(cfg)
    assert sleep_level(cfg) == 1 and cfg.trainer.v1.trainer_mode == "draft_align_sync"
    assert cfg.actor_rollout_ref.draft_align.recipe == str(tmp_path / "r.yaml")
