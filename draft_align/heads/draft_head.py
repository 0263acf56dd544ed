"""The interface every draft head implements (EAGLE-3, MTP), so loops, trainers, estimators and exporters
take a :class:`DraftHead` instead of a concrete class and never probe a head with ``getattr``; and what every
head's configuration raises and reads with (:class:`DraftConfigError`, :func:`config_from_dict`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from draft_align.conventions import HeadKind

C = TypeVar("C")


class DraftConfigError(ValueError):
    """A draft configuration that no engine would load, or that does not fit its target."""


def config_from_dict(cls: type[C], d: dict[str, Any]) -> C:
    """``cls(**d)`` for a config dataclass ``cls``, refusing keys that are not its fields."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(d) - known
    if unknown:
        raise DraftConfigError(f"unknown {cls.__name__} keys: {sorted(unknown)}")
    return cls(**d)


@runtime_checkable
class DraftHead(Protocol):
    """A draft head: pure math over the target's states; the token embedding is passed in, never owned.

    ``kind`` names the architecture (and so the export format); ``shares_target_head`` is True when the
    engine runs the head on the policy's own lm_head (MTP), so the head's ``lm_head`` is a frozen copy that
    the sidecar replaces from every HeadSync and the trainer never updates.
    """

    kind: HeadKind
    shares_target_head: bool
    # Eagle3Config | MTPConfig | NativeMTPConfig: aux_layer_ids, fc_in_features, vocab_size, draft_vocab_size, ...
    cfg: Any
    lm_head: nn.Linear
    training: (
        bool  # a head is an nn.Module: trainers and estimators use the members below as torch defines them
    )

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any: ...

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
