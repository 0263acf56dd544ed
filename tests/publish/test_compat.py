"""publish/compat.py: the tokenizer fingerprint, and a manifest checked against other targets."""

import pytest

from draft_align.publish import load_draft
from draft_align.publish.compat import check_compatible, tokenizer_fingerprint
from draft_align.publish.folder import ExportError


class FakeTokenizer:
    def __init__(self, vocab, special=("<s>", "</s>")):
        self.vocab = dict(vocab)
        self.all_special_tokens = list(special)
        self.special_tokens_map = {"bos_token": special[0], "eos_token": special[1]}

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_fingerprint():
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    fp = tokenizer_fingerprint(FakeTokenizer(vocab))
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fp == tokenizer_fingerprint(FakeTokenizer(dict(reversed(list(vocab.items())))))  # order-free
    assert fp != tokenizer_fingerprint(FakeTokenizer({**vocab, "b": 4}))
    assert fp != tokenizer_fingerprint(FakeTokenizer(vocab, special=("</s>", "<s>")))


def test_check_compatible(e3, tmp_path):
    tok = FakeTokenizer({"<s>": 0, "</s>": 1, "a": 2})
    fp = tokenizer_fingerprint(tok)
    _, m = load_draft(e3.export(e3.make_draft(), tmp_path / "v", tokenizer_fingerprint=fp))
    check_compatible(m, e3.target_cfg(), fp)
    check_compatible(m, e3.target_cfg(), None)
    with pytest.raises(ExportError, match="tokenizer fingerprint mismatch"):
        check_compatible(
            m, e3.target_cfg(), tokenizer_fingerprint(FakeTokenizer({"<s>": 0, "</s>": 1, "b": 2}))
        )
    with pytest.raises(ExportError, match="hidden size mismatch"):
        check_compatible(m, e3.target_cfg(hidden_size=48), fp)
    with pytest.raises(ExportError, match="vocab size mismatch"):
        check_compatible(m, e3.target_cfg(vocab_size=51), fp)
    with pytest.raises(ExportError, match="max_position_embeddings"):
        check_compatible(m, e3.target_cfg(max_position_embeddings=4096), fp)
    with pytest.raises(ExportError, match="out of range"):
        check_compatible(m, e3.target_cfg(num_hidden_layers=5), fp)
    # Default ids were left out of config.json: a 10-layer target's default (2, 5, 7) is not (2, 4, 5).
    with pytest.raises(ExportError, match="default aux layers"):
        check_compatible(m, e3.target_cfg(num_hidden_layers=10), fp)
    # Explicit ids travel with the config, so a deeper target is fine.
    _, m2 = load_draft(e3.export(e3.make_draft(e3.CUSTOM_IDS), tmp_path / "w", tokenizer_fingerprint=fp))
    check_compatible(m2, e3.target_cfg(num_hidden_layers=10), fp)
