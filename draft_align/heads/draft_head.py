"""The interface every draft head implements (EAGLE-3, MTP), so loops, trainers, estimators and exporters
take a :class:`DraftHead` instead of a concrete class and never probe a head with ``getattr``."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from draft_align.conventions import HeadKind


@runtime_checkable
class DraftHead(Protocol):
    """A draft head: pure math over the target's states; the token embedding is passed in, never owned.

    ``kind`` names the architecture (and so the export format); ``shares_target_head`` is True when the
    engine runs the head on the policy's own lm_head (MTP), so the head's ``lm_head`` is a frozen copy that
    the sidecar replaces from every HeadSync and the trainer never updates.
    """

    kind: HeadKind
    shares_target_head: bool
    cfg: Any  # Eagle3Config | MTPConfig: aux_layer_ids, hidden_size, draft_vocab_size, ...
    lm_head: nn.Linear

    @property
    def draft_to_target(self) -> torch.Tensor:  # [draft_vocab] target id of each draft id
        ...

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors an engine loads (names in this project's internal layout)."""
        ...

    def unroll(
        self,
        aux: torch.Tensor,
        embed: nn.Module,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        starts: torch.Tensor,
        starts_valid: torch.Tensor,
        steps: int,
    ) -> list[torch.Tensor]:
        """Training-time-test unroll: draft logits [B, M, draft_vocab] per step."""
        ...

    def unroll_hidden(
        self,
        aux: torch.Tensor,
        embed: nn.Module,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        starts: torch.Tensor,
        starts_valid: torch.Tensor,
        steps: int,
    ) -> list[torch.Tensor]:
        """The same unroll, returning the pre-``lm_head`` hidden states [B, M, H] per step."""
        ...

    def new_cache(self) -> Any:
        """An empty per-sequence cache for :meth:`step`."""
        ...

    def step(
        self, cache: Any, hidden: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor, from_target: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode M new rows of one sequence: (draft logits [M, draft_vocab], hidden [M, H])."""
        ...
