"""What the two policy taps (:mod:`draft_align.tap.hf`, :mod:`draft_align.tap.megatron`) share around their own
hooks and layouts: the constructor's checks, the capture session and the step's sample, ``capturing()``, the
prologue of each ``submit()`` (the captured pass it follows, the masks on the host), each message's
:class:`~draft_align.wire.messages.BatchHeader` and batch id, and ``stats()``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Self

import torch

from draft_align.tap.budget import generator_for
from draft_align.tap.protocol import TapSink
from draft_align.tap.shipping import (
    CaptureSession,
    Hooks,
    KeptSequence,
    StepSample,
    check_tap_args,
    host_masks,
)
from draft_align.wire.messages import BatchHeader


class TapBase:
    """The shared half of a :class:`~draft_align.tap.protocol.PolicyTap`.  A subclass calls ``__init__`` first
    (the arguments every tap checks), sets ``aux_layer_ids``, ``hidden_size`` and ``vocab_size``, and calls
    :meth:`_start` with its hooks and the rank that seeds its sample."""

    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    vocab_size: int

    def __init__(
        self, sink: TapSink, run_id: str, tokens_per_step: int, max_tokens_per_message: int, send_final: bool
    ) -> None:
        check_tap_args(run_id, sink, tokens_per_step, max_tokens_per_message)
        self.sink = sink
        self.run_id = run_id
        self.send_final = bool(send_final)
        self.tokens_per_step = int(tokens_per_step)
        self.max_tokens_per_message = int(max_tokens_per_message)
        self._batch_id = 0

    def _start(self, hooks: Hooks[Any], seed: int, rank: int) -> None:
        """Capture through ``hooks``; the step's sample seeded by (``seed``, ``rank``)."""
        self._capture: CaptureSession[Any] = CaptureSession(hooks)
        self._sample = StepSample(
            self.tokens_per_step, generator_for(seed, rank), self.max_tokens_per_message
        )

    @contextlib.contextmanager
    def capturing(self) -> Iterator[Self]:
        """Attach the hooks for the forward passes run inside; they are removed on exit."""
        with self._capture.capturing():
            yield self

    def _take(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
    ) -> tuple[Any, tuple[int, int], torch.Tensor, torch.Tensor]:
        """Each ``submit()``'s prologue: the captured forward pass it follows, then the micro-batch's [B, T]
        checked and its attention and loss masks as bool on the host."""
        cap = self._capture.take()
        shape, valid, response = host_masks(input_ids, attention_mask, loss_mask)
        return cap, shape, valid, response

    def _header(self, head: KeptSequence, source_rank: int, final_norm: str | None) -> BatchHeader:
        """The header of the next message, whose sequences share ``head``'s policy version, step and temperature;
        takes the next batch id."""
        batch_id = self._batch_id
        self._batch_id += 1  # also for a message that is refused or invalid: gaps in batch_id show losses
        return BatchHeader(
            run_id=self.run_id,
            policy_version=head.policy_version,
            source_rank=source_rank,
            batch_id=batch_id,
            step=head.step,
            aux_layer_ids=self.aux_layer_ids,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            final_norm=final_norm,
            temperature=head.temperature,
        )

    def stats(self) -> dict[str, int]:
        """Counters since construction (too_long from the budget sketch)."""
        return self._sample.stats()
