"""Chat conversations: loading, held-out splits, and tokenisation with an assistant loss mask.

Rows may be in ShareGPT form (``{"conversations": [{"from": "human", "value": ...}, ...]}``) or
OpenAI form (``{"messages": [{"role": "user", "content": ...}, ...]}``), from a local
``.jsonl`` / ``.json`` / ``.parquet`` file, a ``datasets`` hub name (``name`` or ``name:split``),
or the embedded default ``"sharegpt"``.

Role normalisation: ``human``/``user`` → user; ``gpt``/``chatgpt``/``bing``/``bard``/``model``/
``assistant`` → assistant; ``system`` → system. A conversation with any other role (``tool``,
``function``, ...) is dropped whole: its assistant turns depend on tool formats a plain chat
template cannot render. A conversation is cut before its first empty (whitespace-only) message,
and dropped when the part before its first assistant turn has no user turn.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from draft_align import assets

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
DEFAULT_SPLIT = "train"

T = TypeVar("T")


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
        return _to_dicts(self.messages)

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


# ----------------------------------------------------------------------------------------------
# Loading


def load_conversations(source: str, limit: int | None = None) -> list[Conversation]:
    """Load up to ``limit`` valid conversations from ``source`` (see the module docstring)."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} must be non-negative")
    if limit == 0:
        return []
    resolved = assets.resolve_data(source)
    try:
        convs, report = _parse_rows(_iter_rows(resolved), limit, source=resolved)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read chat data {resolved!r}: {e}") from e
    dropped = sum(report.dropped.values())
    if dropped or report.cut:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(report.dropped.items()))
        logger.info(
            "loaded %d conversations from %s; dropped %d (%s); cut %d at an empty message",
            len(convs),
            resolved,
            dropped,
            reasons or "none",
            report.cut,
        )
    else:
        logger.info("loaded %d conversations from %s", len(convs), resolved)
    if not convs:
        logger.warning("no usable conversation in %s", resolved)
    return convs


@dataclass
class _ParseReport:
    dropped: Counter[str]  # reason -> rows dropped
    cut: int = 0  # kept conversations that were cut before an empty message


def _parse_rows(
    rows: Iterable[Any], limit: int | None, source: str
) -> tuple[list[Conversation], _ParseReport]:
    """Parse rows into conversations, tallying what was dropped and why."""
    report = _ParseReport(Counter())
    convs: list[Conversation] = []
    keys_seen: set[str] = set()
    n_rows = n_chat_rows = 0
    for row in rows:
        if limit is not None and len(convs) >= limit:
            break
        n_rows += 1
        raw = None
        if isinstance(row, dict):
            keys_seen.update(map(str, row))
            raw = row.get("conversations", row.get("messages"))
            n_chat_rows += "conversations" in row or "messages" in row
        conv, problem, was_cut = _parse_conversation(raw)
        if conv is None:
            report.dropped[problem] += 1
        else:
            report.cut += was_cut
            convs.append(conv)
    if n_rows == 0:
        raise DataError(f"{source}: no rows")
    if n_chat_rows == 0:
        raise DataError(
            f"{source}: no row has a 'conversations' list (ShareGPT: from/value) or a 'messages' list "
            f"(OpenAI: role/content); keys found: {sorted(keys_seen)}"
        )
    return convs, report


def _parse_conversation(raw: Any) -> tuple[Conversation | None, str, bool]:
    """``(conversation, "", cut)`` or ``(None, reason, cut)``."""
    if not isinstance(raw, list):
        return None, "malformed", False
    messages: list[Message] = []
    cut = False
    for item in raw:
        parsed = _parse_message(item)
        if isinstance(parsed, str):
            return None, parsed, False
        if not parsed.content.strip():
            cut = True
            break
        messages.append(parsed)
    if not messages:
        return None, "empty", cut
    conv = Conversation(tuple(messages))
    if not any(m.role == "user" for m in conv.prompt):
        return None, "no user turn before the first assistant turn", cut
    return conv, "", cut


def _parse_message(item: Any) -> Message | str:
    """A ``Message`` from a ShareGPT or OpenAI dict, or the reason it is unusable."""
    if not isinstance(item, dict):
        return "malformed"
    role = item.get("from", item.get("role"))
    content = item.get("value", item.get("content"))
    if isinstance(content, list):  # OpenAI content parts: keep text-only ones
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return "malformed"
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(role, str) or not isinstance(content, str):
        return "malformed"
    norm = ROLE_ALIASES.get(role.strip().lower())
    if norm is None:
        return "unknown role"
    return Message(norm, content)


def _iter_rows(source: str) -> Iterator[Any]:
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    looks_local = suffix in FILE_SUFFIXES or source.startswith(("/", "./", "../", "~"))
    if path.is_file() or (looks_local and not path.is_dir()):
        if not path.is_file():
            raise DataError(f"chat data file {path} does not exist")
        if suffix == ".jsonl":
            return _read_jsonl(path)
        if suffix == ".json":
            return _read_json(path)
        if suffix == ".parquet":
            return _read_parquet(path)
        raise DataError(f"{path}: unsupported file type {suffix!r}; use one of {FILE_SUFFIXES}")
    return _read_hub(source)


def _read_jsonl(path: Path) -> Iterator[Any]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from e


def _read_json(path: Path) -> Iterator[Any]:
    """A JSON array (or single object); falls back to JSON lines, which ``datasets`` writes as .json."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":
            return _read_jsonl(path)
        raise DataError(f"{path}: not valid JSON ({e})") from e
    return iter(data if isinstance(data, list) else [data])


def _read_parquet(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / ArrowIOError / OSError
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e
    for batch in table.to_batches():
        yield from batch.to_pylist()


def _read_hub(source: str) -> Iterator[Any]:
    import datasets

    name, _, split = source.partition(":")
    split = split or DEFAULT_SPLIT
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # hub, network, and builder errors have no common base
        raise DataError(
            f"could not load dataset {name!r} (split {split!r}) with datasets.load_dataset: {e}. "
            f"Local files need a {'/'.join(FILE_SUFFIXES)} suffix; 'sharegpt' is the embedded default."
        ) from e
    return iter(ds)


def split_heldout(convs: Sequence[T], n_heldout: int, seed: int) -> tuple[list[T], list[T]]:
    """``(train, heldout)``: the first ``n_heldout`` of a seeded permutation are held out.

    Both parts keep the input order; a larger ``n_heldout`` with the same seed holds out a superset.
    """
    if not 0 <= n_heldout <= len(convs):
        raise ValueError(f"n_heldout={n_heldout} must be in [0, {len(convs)}]")
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_heldout])
    train = [c for i, c in enumerate(convs) if i not in held]
    heldout = [c for i, c in enumerate(convs) if i in held]
    return train, heldout


# ----------------------------------------------------------------------------------------------
# Tokenisation


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
    text = _render(tokenizer, _to_dicts(prompt), add_generation_prompt=True)
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


def _to_dicts(messages: Iterable[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


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
    dicts = _to_dicts(messages)
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
