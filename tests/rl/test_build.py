"""rl/build.py: the tap's message size fitted to the receiver's limit, and the send-queue warning."""

from __future__ import annotations

import logging

from draft_align.config import CotrainRecipe, load_recipe
from draft_align.config.sections import TapConfig, WireConfig
from draft_align.rl.build import message_tokens
from draft_align.wire.codec import encode
from draft_align.wire.messages import TapBatch
from draft_align.wire.packing import tapped_token_bytes, tokens_that_fit


def _recipe(*overrides: str) -> CotrainRecipe:
    return load_recipe("recipes/smollm2_cotrain.yaml", list(overrides), CotrainRecipe)


def _sections(*overrides: str) -> tuple[TapConfig, WireConfig]:
    r = _recipe(*overrides)
    return r.tap, r.wire


def test_token_bytes_are_docs_sizing_figures():
    assert tapped_token_bytes(4096, 3, final=True, topk=1) == 32_797  # docs/sizing.md §1, Qwen3-8B, K=1
    assert tapped_token_bytes(576, 3, final=True, topk=20) == 4_865  # SmolLM2-135M, K=20


def test_the_densest_batch_that_fits_is_under_the_limit():
    limit = 1 << 20
    per = tapped_token_bytes(64, 3, final=True, topk=1)
    n = tokens_that_fit(limit, per)
    b = TapBatch.make_dummy(n // 2, min_len=2, max_len=2, hidden_size=64, topk=1, stats_from=True)
    assert b.num_tokens == n - n % 2
    assert sum(len(f) for f in encode(b, b"k" * 32, sender="s" * 64, seq=2**62)) <= limit


def test_messages_shrink_to_the_limit_at_8b_width_and_not_at_smollm2_width():
    r = _recipe()
    assert (
        message_tokens(r.tap, r.wire, 576, 3) == r.tap.max_tokens_per_message
    )  # 16,384 × 4.6 KB fits 256 MiB
    n = message_tokens(r.tap, r.wire, 4096, 3)
    assert n < r.tap.max_tokens_per_message
    assert n * tapped_token_bytes(4096, 3, final=True, topk=1) <= r.wire.max_message_mb << 20


def test_a_step_larger_than_the_send_queue_is_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.build"):
        message_tokens(*_sections("tap.tokens_per_step=37500"), 4096, 3)
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "wire.queue_mb 512" in rec.getMessage() and "raise wire.queue_mb to 1291" in rec.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.build"):
        message_tokens(*_sections("tap.tokens_per_step=37500", "wire.queue_mb=1536"), 4096, 3)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_step_of_more_messages_than_the_queue_holds_is_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="draft_align.rl.build"):
        n = message_tokens(*_sections("tap.tokens_per_step=40000", "tap.max_tokens_per_message=4096"), 576, 3)
    assert n == 4096
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "10 messages" in rec.getMessage() and "raise wire.queue_messages to 10" in rec.getMessage()


def test_the_senders_patience_comes_from_the_recipe():
    from draft_align.rl.build import tap_sender

    tx = tap_sender(_recipe("wire.send_timeout_s=12.5").wire, "tcp://127.0.0.1:9", b"k" * 32)
    try:
        assert tx._send_timeout_s == 12.5
    finally:
        tx.close(timeout_s=0.5)


def test_the_final_report_reaches_the_sidecar_and_marks_the_run_done(tmp_path):
    """close_link: the one final StepReport every RL side sends as it closes (GRPO job, TRL, verl), taken by a real
    receiver on the run folder's own tap socket; the DraftPublished subscriber on the run folder's notify socket
    is closed after it."""
    from draft_align.rl.build import close_link, draft_notifications, tap_sender
    from draft_align.wire import channel
    from draft_align.wire.messages import StepReport

    key = b"k" * 32
    wire = WireConfig()
    receiver = channel.Receiver(channel.tap_endpoint(tmp_path), key)
    notify = draft_notifications(wire, tmp_path, key)
    try:
        assert (
            notify.endpoint
            == channel.notify_endpoint(tmp_path)
            == channel.default_endpoint(tmp_path, "notify")
        )
        close_link(tap_sender(wire, channel.tap_endpoint(tmp_path), key), None, notify, final=("run", 7, 6))
        assert notify._inbox._sock.closed  # closed after the draft source, as the order says
        got = receiver.recv(timeout_ms=5000)
        assert isinstance(got, StepReport) and got.is_final and (got.step, got.policy_version) == (7, 6)
        assert not StepReport.make_dummy().is_final
    finally:
        notify.close()
        receiver.close()
