"""tap.protocol: the Protocols an RL job programs against, and the taps and sinks that satisfy them."""

import inspect
import typing

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draft_align.hf.capture import TapError
from draft_align.tap.base import TapBase, TapOptions
from draft_align.tap.hf import HFPolicyTap
from draft_align.tap.protocol import PolicyTap, PolicyTapError, TapSink
from tests.helpers import ListSink

pytestmark = pytest.mark.usefixtures("one_thread")


def test_protocols():
    from draft_align.wire.channel import TapSender

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=20,
        )
    ).eval()
    sink = ListSink()
    assert isinstance(sink, TapSink) and issubclass(TapSender, TapSink)
    assert isinstance(HFPolicyTap(model, (1, 2), sink, run_id="r", tokens_per_step=10), PolicyTap)
    assert not isinstance(object(), TapSink)


def test_policy_tap_errors_are_tap_errors_and_value_errors():
    assert issubclass(PolicyTapError, TapError) and issubclass(PolicyTapError, ValueError)


def test_tap_options_are_tap_base_keywords():
    """TapOptions (what HFPolicyTap and MegatronPolicyTap forward) names exactly TapBase's keyword arguments."""
    params = inspect.signature(TapBase.__init__).parameters.values()
    keywords = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords == set(TapOptions.__annotations__)
    required = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is p.empty}
    # string annotations (from __future__ import annotations) leave __required_keys__ empty: resolve them
    hints = typing.get_type_hints(TapOptions, include_extras=True)
    assert required == {n for n, t in hints.items() if typing.get_origin(t) is typing.Required}
