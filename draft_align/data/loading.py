"""Loading chat conversations and splitting off a held-out set.

Rows may be in ShareGPT form (``{"conversations": [{"from": "human", "value": ...}, ...]}``) or
OpenAI form (``{"messages": [{"role": "user", "content": ...}, ...]}``), from a local
``.jsonl`` / ``.json`` / ``.parquet`` file, a ``datasets`` hub name (``name`` or ``name:split``),
or the embedded default ``"sharegpt"``; or a verifiable-reward task generated in-process (``task:NAME[:SEED]``,
:mod:`draft_align.data.tasks`).

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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from draft_align import assets
from draft_align.data import tasks
from draft_align.data.conversations import Conversation, DataError, Message

logger = logging.getLogger(__name__)

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


def load_conversations(source: str, limit: int | None = None) -> list[Conversation]:
    """Load up to ``limit`` valid conversations from ``source`` (see the module docstring)."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} must be non-negative")
    if limit == 0:
        return []
    if tasks.is_task_source(source):  # generated in-process: task:NAME[:SEED]
        convs = [p.conversation() for p in tasks.task_problems(source)]
        return convs[:limit] if limit is not None else convs
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
