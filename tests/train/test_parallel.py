"""draft_align.train.parallel without a process group: rank info, devices, the exchange framing, world checks.
(The DDP/FSDP2 steps run in tests/sidecar/test_loop_ranked.py, with real ranks.)"""

from __future__ import annotations

import pytest
import torch

from draft_align.config import CotrainRecipe, RecipeError, load_recipe
from draft_align.train.parallel import (
    RankError,
    RankInfo,
    _pack,
    _unpack,
    config_digest,
    join_ranks,
    rank_device,
    rank_info_from_env,
)


def test_ranks_setting_without_torchrun_is_refused(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with (
        pytest.raises(RankError, match="torchrun --nproc-per-node 2"),
        join_ranks(ranks=2, device="cpu", timeout_s=30.0, config={"start_draft": "/d"}),
    ):
        pass
    with join_ranks(ranks=1, device="cpu", timeout_s=30.0, config={"start_draft": "/d"}) as ranks:
        assert ranks is None


def test_rank_endpoints_and_config_checks():
    from draft_align.wire import channel

    assert channel.tap_endpoints("ipc:///r/tap.sock", 3) == [
        "ipc:///r/tap.sock",
        "ipc:///r/tap.1.sock",
        "ipc:///r/tap.2.sock",
    ]
    assert channel.rank_endpoint("ipc:///r/tap", 2) == "ipc:///r/tap.2"
    assert channel.tap_endpoints("tcp://127.0.0.1:5555", 2) == [
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.1:5556",
    ]
    # a '*' port: every rank binds its own free port (and reports it, integrations/ray); a tap cannot derive them
    assert channel.rank_endpoint("tcp://127.0.0.1:*", 1) == "tcp://127.0.0.1:*"
    assert channel.tap_endpoints("tcp://127.0.0.1:*", 1) == ["tcp://127.0.0.1:*"]
    with pytest.raises(ValueError, match="fixed tcp port"):
        channel.tap_endpoints("tcp://127.0.0.1:*", 2)
    with pytest.raises(ValueError, match="beyond 65535"):
        channel.rank_endpoint("tcp://127.0.0.1:65535", 1)
    msgs = [[b"head", b"", b"\x00" * 5], [b"x"]]
    assert _unpack(_pack(msgs)) == msgs and _unpack(_pack([])) == []
    assert rank_info_from_env({}).world_size == 1
    info = rank_info_from_env({"RANK": "1", "WORLD_SIZE": "2"})
    assert (info.rank, info.local_rank, info.is_lead) == (1, 1, False)
    with pytest.raises(RuntimeError, match="not in 0..WORLD_SIZE-1"):
        rank_info_from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(RankError, match="must be integers"):
        rank_info_from_env({"RANK": "x", "WORLD_SIZE": "2"})
    for bad in ("sidecar.ranks=0", "sidecar.parallel=fsdp", "sidecar.collective_timeout_s=0"):
        with pytest.raises(RecipeError):
            load_recipe(None, [bad], CotrainRecipe)
    assert load_recipe(None, ["sidecar.parallel=fsdp2"], CotrainRecipe).sidecar.parallel == "fsdp2"


def test_rank_device_and_config_digest():
    info = RankInfo(rank=1, world_size=2, local_rank=1)
    assert rank_device("cuda", info) == torch.device("cuda", 1)
    assert rank_device("cuda:0", info) == torch.device("cuda", 0)  # an explicit index is kept
    assert rank_device("cpu", info) == torch.device("cpu")
    assert config_digest({"a": 1, "b": [2]}) == config_digest({"b": [2], "a": 1})
    assert config_digest({"a": 1}) != config_digest({"a": 2})
