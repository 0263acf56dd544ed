"""publish/registry.py: one format per head kind and per manifest format; a head or a manifest no format
writes is refused in one line."""

from __future__ import annotations

from typing import get_args

import pytest

from draft_align.conventions import HeadKind
from draft_align.publish import write_draft
from draft_align.publish.compat import check_compatible
from draft_align.publish.folder import DRAFT_FORMATS, ExportError, ExportRequest
from draft_align.publish.registry import BY_KIND, FORMATS, format_for, format_of


def test_one_format_per_head_kind_and_per_manifest_format():
    assert sorted(FORMATS) == sorted(DRAFT_FORMATS)
    assert sorted(BY_KIND) == sorted(get_args(HeadKind))
    for name, fmt in FORMATS.items():
        assert fmt.name == name and BY_KIND[fmt.kind] is fmt


def test_lookup_by_head_and_by_manifest(e3):
    draft = e3.make_draft()
    assert format_for(draft) is FORMATS["draft_align.eagle3"]
    assert format_of({"format": "draft_align.mtp"}) is FORMATS["draft_align.mtp"]


def test_a_manifest_naming_no_format_is_refused(e3):
    with pytest.raises(ExportError, match="manifest format None is not a draft format"):
        check_compatible({"target": {}}, e3.target_cfg(), None)
    with pytest.raises(ExportError, match="'draft_align.lora_delta' is not a draft format"):
        format_of({"format": "draft_align.lora_delta"})


def test_a_head_of_another_class_is_refused(e3, tmp_path):
    draft = e3.make_draft()
    req = ExportRequest(
        target_config=e3.target_cfg(),
        target_name="t",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="f" * 16,
    )
    with pytest.raises(ExportError, match="draft_align.mtp format writes MTPDraft heads, got a Eagle3Draft"):
        FORMATS["draft_align.mtp"].write(draft, tmp_path / "v", req)
    draft.kind = "llama_block_mtp"  # a head claiming a kind its class is not
    with pytest.raises(ExportError, match="writes MTPDraft heads"):
        write_draft(draft, tmp_path / "v", req)
    assert not (tmp_path / "v").exists()
