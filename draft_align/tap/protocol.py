"""What an RL job sees of a policy-side Tap, whatever its framework (HF transformers, megatron-core).

The RL job wraps the forward passes it already runs (log-prob or training pass) in ``capturing()`` and
hands each micro-batch's logits (or None, after a fused LM head) to ``submit()``; ``end_step()`` packs what was kept into ``TapBatch``
messages and offers them to a non-blocking :class:`TapSink`; ``head_sync()`` ships the final norm and
lm_head rows once per policy version.  No extra forward pass, no blocking send, drops are counted.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable

import torch

from draft_align.hf.capture import TapError


class PolicyTapError(TapError):
    """Bad input to a policy tap (shapes, masks, vocab, call order)."""


@runtime_checkable
class TapSink(Protocol):
    """Where finished messages go (the ZeroMQ ``TapSender``; a list in tests)."""

    def offer(self, message: Any) -> bool:
        """Queue ``message`` without blocking; False when it was refused (queue full, peer gone)."""
        ...


@runtime_checkable
class PolicyTap(Protocol):
    """What an RL job calls, whatever its framework (HF transformers here, Megatron elsewhere)."""

    def head_sync(self, policy_version: int, draft_to_target: torch.Tensor) -> bool:
        """Offer a HeadSync (final norm, lm_head rows of the draft vocab); True when the sink took it."""
        ...

    def capturing(self) -> contextlib.AbstractContextManager[Any]:
        """Hooks attached only inside; the RL job runs its own forward passes within."""
        ...

    def submit(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        logits: torch.Tensor | None,
        policy_version: int,
        step: int,
        temperature: float,
    ) -> None:
        """Offer the micro-batch whose forward just ran to this step's sample (``logits`` None: a fused head
        gave none; a tap that can, computes the kept rows' statistics from the captured final state)."""
        ...

    def end_step(self) -> int:
        """Pack and offer the step's sample; returns tokens the sink accepted."""
        ...

    def stats(self) -> dict[str, int]:
        """Running counters since construction."""
        ...
