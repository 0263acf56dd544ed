"""The chat types: a :class:`Conversation` of :class:`Message` turns, and an :class:`EncodedSample` (token ids
with an assistant loss mask); :class:`DataError`, the one error chat data is refused with."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import torch

ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """Chat data that cannot be read, parsed, or tokenised as asked."""


@dataclass(frozen=True)
class Message:
    """One chat turn; ``role`` is one of ``ROLES``."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise DataError(f"message role {self.role!r} is not one of {ROLES}")
        if not isinstance(self.content, str):
            raise DataError(f"message content must be str, got {type(self.content).__name__}")


@dataclass(frozen=True)
class Conversation:
    """An ordered chat; see the module docstring for the invariants ``load_conversations`` keeps."""

    messages: tuple[Message, ...]

    @property
    def prompt(self) -> tuple[Message, ...]:
        """Messages before the first assistant turn (all of them if there is none)."""
        for i, m in enumerate(self.messages):
            if m.role == "assistant":
                return self.messages[:i]
        return self.messages

    def to_dicts(self) -> list[dict[str, str]]:
        """OpenAI-form messages, as ``apply_chat_template`` takes them."""
        return message_dicts(self.messages)

    def to_bytes(self) -> bytes:
        return json.dumps({"messages": self.to_dicts()}, ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> Conversation:
        row = json.loads(data.decode("utf-8"))
        return cls(tuple(Message(m["role"], m["content"]) for m in row["messages"]))

    @classmethod
    def make_dummy(cls, turns: int = 2, system: bool = False) -> Conversation:
        """``turns`` user/assistant pairs with short distinct contents."""
        msgs = [Message("system", "Be brief.")] if system else []
        for t in range(turns):
            msgs += [Message("user", f"question {t}?"), Message("assistant", f"answer {t}.")]
        return cls(tuple(msgs))


@dataclass
class EncodedSample:
    """A tokenised chat; ``loss_mask[t]`` marks token ``t`` as a response token to be predicted."""

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool: assistant content + its end-of-turn token

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 1 or self.input_ids.shape != self.loss_mask.shape:
            raise DataError(
                f"input_ids {tuple(self.input_ids.shape)} and loss_mask "
                f"{tuple(self.loss_mask.shape)} must be equal 1-D shapes"
            )
        if self.input_ids.dtype != torch.long or self.loss_mask.dtype != torch.bool:
            raise DataError(
                f"want int64 ids and bool mask, got {self.input_ids.dtype}, {self.loss_mask.dtype}"
            )

    def __len__(self) -> int:
        return self.input_ids.numel()

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @classmethod
    def make_dummy(
        cls, length: int = 8, prompt_len: int = 3, vocab_size: int = 32, seed: int = 0
    ) -> EncodedSample:
        """Random ids; the last ``length - prompt_len`` tokens are the response."""
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (length,), generator=gen, dtype=torch.long)
        mask = torch.arange(length) >= prompt_len
        return cls(ids, mask)


def message_dicts(messages: Iterable[Message]) -> list[dict[str, str]]:
    """OpenAI-form messages (``{"role", "content"}``), as ``apply_chat_template`` takes them."""
    return [{"role": m.role, "content": m.content} for m in messages]
