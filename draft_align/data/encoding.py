"""Tokenising chats with their chat template, with an assistant loss mask (what a draft learns to predict)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

from draft_align.data.conversations import Conversation, DataError, EncodedSample, Message, message_dicts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, conv: Conversation, max_len: int
) -> EncodedSample | None:
    """Tokenise ``conv`` with its chat template; mask in every assistant turn's tokens.

    The rendered text is split at the template's turn boundaries: ``render(m[:i], generation
    prompt)`` must be a prefix of ``render(m[:i+1])`` for every assistant turn ``i`` (else
    ``DataError``). Each piece is tokenised on its own, as at inference, where the prompt is encoded
    alone and the response is generated token by token. Within a response piece the mask ends at
    its last special token (the end-of-turn token, e.g. ``<|im_end|>``), so template whitespace
    after it is not a target. Tokens after the last response are dropped; the result is cut to
    ``max_len``; ``None`` when no response token survives.
    """
    if max_len <= 0:
        raise ValueError(f"max_len={max_len} must be positive")
    if not any(m.role == "assistant" for m in conv.messages):
        return None
    special = _special_ids(tokenizer)
    ids: list[int] = []
    mask: list[bool] = []
    for text, is_response in _chat_segments(tokenizer, conv.messages):
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += _response_mask(piece, special) if is_response else [False] * len(piece)
    last = max((t for t, m in enumerate(mask) if m), default=-1)
    ids, mask = ids[: min(last + 1, max_len)], mask[: min(last + 1, max_len)]
    if not any(mask):
        return None
    return EncodedSample(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, conv: Conversation) -> torch.Tensor:
    """Token ids [T] of ``conv.prompt`` plus the generation prompt; equals the start of ``encode_conversation``."""
    prompt = conv.prompt
    if not any(m.role == "user" for m in prompt):
        raise DataError("conversation has no user turn before its first assistant turn")
    text = _render(tokenizer, message_dicts(prompt), add_generation_prompt=True)
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)


def encode_response(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: torch.Tensor | Sequence[int],  # [P]
    response_ids: torch.Tensor | Sequence[int],  # [R]
    eos_token_ids: Collection[int] | None = None,
) -> EncodedSample:
    """``prompt ⧺ response`` with the response masked in.

    The response is cut after its first eos token (default ``{tokenizer.eos_token_id}``), which
    drops batch padding after it; with no eos, trailing pad tokens are stripped when pad ≠ eos.
    """
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    response = torch.as_tensor(response_ids, dtype=torch.long).reshape(-1)
    eos = set(eos_token_ids) if eos_token_ids is not None else {tokenizer.eos_token_id} - {None}
    hits = torch.isin(response, torch.tensor(sorted(eos), dtype=torch.long)).nonzero()
    if hits.numel():
        response = response[: int(hits[0]) + 1]
    elif tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in eos:
        keep = (response != tokenizer.pad_token_id).nonzero()
        response = response[: int(keep[-1]) + 1] if keep.numel() else response[:0]
    ids = torch.cat([prompt, response])
    mask = torch.cat(
        [torch.zeros(prompt.numel(), dtype=torch.bool), torch.ones(response.numel(), dtype=torch.bool)]
    )
    return EncodedSample(ids, mask)


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool
) -> str:
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except (TemplateError, ValueError) as e:  # ValueError: tokenizer has no chat template
        raise DataError(f"chat template failed to render {len(messages)} messages: {e}") from e
    if not isinstance(text, str):
        raise DataError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
    return text


def _chat_segments(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[tuple[str, bool]]:
    """Rendered text up to the last assistant turn, as ``(piece, is_response)`` pieces."""
    dicts = message_dicts(messages)
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        if i == 0:
            raise DataError("conversation starts with an assistant turn; it has no prompt")
        before = _render(tokenizer, dicts[:i], add_generation_prompt=True)
        after = _render(tokenizer, dicts[: i + 1], add_generation_prompt=False)
        for shorter, longer, what in ((done, before, "the previous turns"), (before, after, "the turn")):
            if not longer.startswith(shorter):
                raise DataError(
                    f"chat template is not prefix-stable at message {i}: rendering {what} and the "
                    f"generation prompt is not a prefix of rendering through message {i}, so an "
                    f"assistant mask cannot be derived (templates that rewrite earlier turns are unsupported)"
                )
        pieces += [(before[len(done) :], False), (after[len(before) :], True)]
        done = after
    return [(text, resp) for text, resp in pieces if text]


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return frozenset(ids)


def _response_mask(piece: Sequence[int], special: Collection[int]) -> list[bool]:
    """True up to and including the piece's last special token (all True if it has none)."""
    last = max((t for t, tok in enumerate(piece) if tok in special), default=len(piece) - 1)
    return [t <= last for t in range(len(piece))]
