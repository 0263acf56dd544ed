"""engines/vllm/drafters.py: one vLLM entry per published format, looked up by the manifest's ``format``; the
``speculative_config`` start_engine and server_command write from it (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from draft_align.engines.vllm.drafters import CLASSES, DRAFTERS, drafter_for, speculative_config
from draft_align.publish.registry import FORMATS


def test_every_published_format_has_one_vllm_entry():
    assert sorted(DRAFTERS) == sorted(FORMATS)


@pytest.mark.parametrize(
    ("fmt", "method"),
    [("draft_align.eagle3", "eagle3"), ("draft_align.mtp", "eagle3"), ("draft_align.native_mtp", "mtp")],
)
def test_speculative_config_by_format(fmt, method):
    spec = speculative_config(Path("/runs/r/drafts/v0002"), {"format": fmt}, 3)
    assert spec == {"method": method, "model": "/runs/r/drafts/v0002", "num_speculative_tokens": 3}
    assert list(spec) == ["method", "model", "num_speculative_tokens"]  # the order server_command's JSON has


def test_load_check_layouts():
    assert DRAFTERS["draft_align.eagle3"].layout({}, {"model_type": "llama"}) == "eagle3"
    assert DRAFTERS["draft_align.mtp"].layout({}, {"model_type": "qwen3_next_mtp"}) == "qwen3_next"
    native = DRAFTERS["draft_align.native_mtp"]
    assert native.layout({"family": "glm4_moe"}, {}) == "native_mtp/glm4_moe"
    assert {native.layout({"family": f}, {}) for f in ("mimo", "glm4_moe", "deepseek_v3")} <= set(CLASSES)
    with pytest.raises(
        ValueError, match="no vLLM drafter known for native MTP family 'ernie': mimo, glm4_moe"
    ):
        native.layout({"family": "ernie"}, {})


def test_a_format_without_an_entry_is_refused():
    with pytest.raises(
        ValueError, match="no vLLM drafter known for manifest format 'draft_align.lora_delta'"
    ):
        drafter_for({"format": "draft_align.lora_delta"})


def test_the_rollouts_and_eval_ask_the_table_which_formats_an_engine_serves(tmp_path):
    """A Llama-block MTP folder is load-checked but never served (docs/formats.md): the rollout engine's start and
    ``draft-align eval --engine auto`` fall back to the reference decoder for it, and ``vllm`` is refused."""
    import argparse

    from draft_align.cli.draft_commands import _eval_engine

    assert [f for f, d in sorted(DRAFTERS.items()) if not d.serves] == ["draft_align.mtp"]
    mtp = {"format": "draft_align.mtp"}
    assert _eval_engine(argparse.Namespace(engine="auto"), mtp) == "reference"
    with pytest.raises(ValueError, match="--engine vllm: the vLLM adapter serves EAGLE-3 drafts"):
        _eval_engine(argparse.Namespace(engine="vllm"), mtp)
