"""The published-draft formats, by head kind (what writing picks) and by manifest format (what reading picks).

A new format is a module that ends with its ``FORMAT`` (a :class:`formats.HeadFormat`) and one line here;
:func:`publish.write_draft`, :func:`publish.load_draft`, :func:`compat.check_compatible` and
:func:`tap_spec.read_tap_spec` then handle it (vLLM's side of it, the ``speculative_config`` method and the load
check's drafter class: one entry in ``engines/vllm/drafters.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from draft_align.heads.draft_head import DraftHead
from draft_align.publish import eagle3_format, mtp_format, native_mtp_format
from draft_align.publish.folder import ExportError
from draft_align.publish.formats import DraftFormat

#: manifest ``format`` → its format
FORMATS: dict[str, DraftFormat] = {
    f.name: f for f in (eagle3_format.FORMAT, mtp_format.FORMAT, native_mtp_format.FORMAT)
}
#: head ``kind`` → the format that writes it
BY_KIND: dict[str, DraftFormat] = {f.kind: f for f in FORMATS.values()}


def format_for(draft: DraftHead) -> DraftFormat:
    """The format that writes ``draft`` (by its ``kind``)."""
    fmt = BY_KIND.get(draft.kind)
    if fmt is None:
        raise ExportError(f"no engine format writes a {draft.kind!r} head: expected one of {sorted(BY_KIND)}")
    return fmt


def format_of(manifest: Mapping[str, Any]) -> DraftFormat:
    """The format a published draft's manifest names."""
    fmt = FORMATS.get(str(manifest.get("format")))
    if fmt is None:
        raise ExportError(
            f"manifest format {manifest.get('format')!r} is not a draft format: expected one of {sorted(FORMATS)}"
        )
    return fmt
