"""What the two policy taps (:mod:`draft_align.tap.hf`, :mod:`draft_align.tap.megatron`) share around their own
hooks and layouts: the keyword options every tap takes (:class:`TapOptions`) and the constructor's checks, the
capture session and the step's sample, ``capturing()``, the prologue of each ``submit()`` (the captured pass it
follows, the masks on the host), each message's :class:`~draft_align.wire.messages.BatchHeader` and batch id,
``end_step()``, the offer of a HeadSync, and ``stats()``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar, Required, Self, TypedDict

import torch

from draft_align.tap.budget import generator_for
from draft_align.tap.protocol import TapSink
from draft_align.tap.shipping import (
    CaptureSession,
    Hooks,
    KeptSequence,
    StepSample,
    check_tap_args,
    check_topk,
    head_sync_message,
    host_masks,
    offer_head_sync,
    ship,
)
from draft_align.wire.messages import BatchHeader


class TapOptions(TypedDict, total=False):
    """The keyword arguments every policy tap takes besides its own (their defaults: :class:`TapBase`).

    ``run_id`` names the run in every message; per RL step at most ``tokens_per_step`` tokens are kept, shipped
    in messages of at most ``max_tokens_per_message`` tokens; ``send_final``: ship the post-norm final hidden
    state; ``topk``: top-k log-probs per token (0: none); ``seed``: with the tap's rank, seeds its sample."""

    run_id: Required[str]
    tokens_per_step: Required[int]
    max_tokens_per_message: int
    send_final: bool
    topk: int
    seed: int


class TapBase:
    """The shared half of a :class:`~draft_align.tap.protocol.PolicyTap`.  A subclass passes its
    :class:`TapOptions` to ``__init__`` first (the arguments every tap checks), sets ``aux_layer_ids``,
    ``hidden_size`` and ``vocab_size``, calls :meth:`_start` with its hooks and the rank that seeds its sample,
    and builds each message in :meth:`_message`."""

    _WHO: ClassVar[str]  # the tap as its log lines name it
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    vocab_size: int

    def __init__(
        self,
        sink: TapSink,
        *,
        run_id: str,
        tokens_per_step: int,
        max_tokens_per_message: int = 16384,
        send_final: bool = True,
        topk: int = 1,
        seed: int = 0,
    ) -> None:
        check_tap_args(run_id, sink, tokens_per_step, max_tokens_per_message)
        self.sink = sink
        self.run_id = run_id
        self.send_final = bool(send_final)
        self.tokens_per_step = int(tokens_per_step)
        self.max_tokens_per_message = int(max_tokens_per_message)
        self._topk, self._seed = topk, seed
        self._batch_id = 0

    def _start(self, hooks: Hooks[Any], rank: int) -> None:
        """Check ``topk`` against ``vocab_size``, and capture through ``hooks``; the step's sample seeded by
        (``seed``, ``rank``)."""
        self.topk = check_topk(self._topk, self.vocab_size)
        self._capture: CaptureSession[Any] = CaptureSession(hooks)
        self._sample = StepSample(
            self.tokens_per_step, generator_for(self._seed, rank), self.max_tokens_per_message
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

    def end_step(self) -> int:
        """Pack the step's kept sequences into messages (≤ max_tokens_per_message tokens each), offer them to
        the sink and start a new step.  Returns the tokens of messages the sink accepted."""
        chunks = self._sample.end_step(self.max_tokens_per_message)
        return ship(chunks, self._message, self.sink, self._sample.counters, self._WHO)

    def _message(self, seqs: list[KeptSequence]) -> Any:
        """The message of ``seqs`` (same policy version, step and temperature), validated as the wire encoder
        would; raises WireError (e.g. NaN logits gave NaN log-probs)."""
        raise NotImplementedError

    def _offer_head_sync(
        self,
        policy_version: int,
        norm_eps: float,
        norm_weight: torch.Tensor,
        draft_to_target: torch.Tensor,
        rows: torch.Tensor,
    ) -> bool:
        """Offer the HeadSync of ``policy_version`` (see :func:`~draft_align.tap.shipping.head_sync_message`)
        and count it; True when the sink took it."""
        message = head_sync_message(
            self.run_id,
            policy_version,
            self.hidden_size,
            self.vocab_size,
            norm_eps,
            norm_weight,
            draft_to_target,
            rows,
        )
        return offer_head_sync(self.sink, message, self._sample.counters, self._WHO)

    def stats(self) -> dict[str, int]:
        """Counters since construction (too_long from the budget sketch)."""
        return self._sample.stats()
