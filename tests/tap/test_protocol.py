"""tap.protocol: the Protocols an RL job programs against, and the taps and sinks that satisfy them."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draft_align.hf.capture import TapError
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
