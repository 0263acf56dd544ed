"""The interface every draft head implements (EAGLE-3, MTP), so loops, trainers, estimators and exporters
take a :class:`DraftHead` instead of a concrete class and never probe a head with ``getattr``; what every
head's configuration raises and reads with (:class:`DraftConfigError`, :func:`config_from_dict`); and what the
heads share as written code: :class:`DraftModule` (the logits unroll), :class:`SharedHeadDraft` and
:class:`SharedHeadConfig` (a head on the target's own lm_head: the MTP heads)."""

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


class Unroll(Protocol):
    """The training-time-test unroll's signature (:attr:`DraftHead.unroll` and :attr:`DraftHead.unroll_hidden`
    both take it): aux [B, T, F] the target's captured states; embed the target's token embedding; input_ids,
    valid [B, T]; starts, starts_valid [B, M] chain starts; ``steps`` draft steps → one tensor [B, M, ·] per step."""

    def __call__(
        self,
        aux: torch.Tensor,
        embed: nn.Module,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        starts: torch.Tensor,
        starts_valid: torch.Tensor,
        steps: int,
    ) -> list[torch.Tensor]: ...


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
    # a head is an nn.Module: trainers and estimators use the members below as torch defines them
    training: bool

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

    @property
    def unroll(self) -> Unroll:
        """Training-time-test unroll: draft logits [B, M, draft_vocab] per step."""
        ...

    @property
    def unroll_hidden(self) -> Unroll:
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


class DraftModule(nn.Module):
    """What every head's module shares: :meth:`unroll` is ``lm_head`` over the head's ``unroll_hidden``."""

    lm_head: nn.Linear

    def unroll_hidden(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        """The head's own TTT unroll (:class:`Unroll`): the pre-``lm_head`` hidden states [B, M, H] per step."""
        raise NotImplementedError

    def unroll(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        """Like ``unroll_hidden``, returning draft logits [B, M, draft_vocab] per step."""
        return [self.lm_head(x) for x in self.unroll_hidden(*args, **kwargs)]


class _FinalHiddenShape(Protocol):
    @property
    def target_num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


class SharedHeadConfig:
    """The EAGLE-3 config interface (what trainers, estimators and decoders read) of a head that reads only the
    target's final post-norm hidden state (HF ``hidden_states[L]``) and predicts through the target's own
    lm_head over its whole vocabulary: the MTP heads' configs, from their ``target_num_layers``, ``hidden_size``
    and ``vocab_size``."""

    @property
    def aux_layer_ids(self: _FinalHiddenShape) -> tuple[int, ...]:
        """(L,): HF ``hidden_states[L]`` is the final post-norm state, MTP's only input."""
        return (self.target_num_layers,)

    @property
    def fc_in_features(self: _FinalHiddenShape) -> int:
        """Width of the captured input per token: the one final hidden state."""
        return self.hidden_size

    @property
    def target_hidden_size(self: _FinalHiddenShape) -> int:
        return self.hidden_size

    @property
    def draft_vocab_size(self: _FinalHiddenShape) -> int:
        return self.vocab_size  # the shared lm_head covers the whole target vocabulary


class SharedHeadDraft(DraftModule):
    """A head that runs on the target's own lm_head (``shares_target_head``: MTP): its ``lm_head`` is a frozen
    copy of the target's over the whole vocabulary, set by :meth:`set_head` and never trained, and its vocabulary
    maps are the identity."""

    shares_target_head = True

    def _init_shared_head(self, hidden_size: int, vocab_size: int) -> None:
        """The frozen ``lm_head`` [V, H] and the identity vocabulary maps (``d2t``/``t2d``: not persistent, not
        engine tensors; for code written for EAGLE-3)."""
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(vocab_size, dtype=torch.long), persistent=False)
        self.register_buffer("t2d", torch.ones(vocab_size, dtype=torch.bool), persistent=False)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[V] identity: the head predicts over the target's vocabulary."""
        return torch.arange(self.lm_head.out_features, device=self.lm_head.weight.device)

    def set_head(self, weight: torch.Tensor) -> None:
        """Copy the target's lm_head ``weight`` [V, H] into the frozen shared head (e.g. from HeadSync)."""
        w = self.lm_head.weight
        if tuple(weight.shape) != tuple(w.shape):
            raise DraftConfigError(
                f"lm_head {tuple(weight.shape)} does not fit this MTP head {tuple(w.shape)}"
            )
        with torch.no_grad():
            w.copy_(weight.detach().to(w.device, w.dtype))
