"""Tests for draft_align.data: loading chat rows, held-out splits, tokenisation masks."""

from __future__ import annotations

import json
import logging
import string
from pathlib import Path

import pytest
import torch

from draft_align.data import (
    Conversation,
    DataError,
    EncodedSample,
    Message,
    encode_conversation,
    encode_prompt,
    encode_response,
    load_conversations,
    loading,
    split_heldout,
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# SmolLM2's own template: inserts a default system prompt when the chat has none.
CHATML_DEFAULT_SYSTEM = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nBe nice.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Re-renders earlier assistant turns differently once a later turn exists: not prefix-stable.
UNSTABLE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\\n...<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = 1, 2


def make_tokenizer(template: str | None = CHATML, newline_merge: bool = False):
    """Character-level tokenizer: one token per character, so expected ids are easy to write down.

    With ``newline_merge`` the pair "\\n\\n" is one token, to show pieces are tokenised separately.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars + (["\n\n"] if newline_merge else []))}
    merges = [("\n", "\n")] if newline_merge else []
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<|endoftext|>"))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    if template is not None:
        tok.chat_template = template
    return tok


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def conv(*pairs: tuple[str, str]) -> Conversation:
    return Conversation(tuple(Message(r, c) for r, c in pairs))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ShareGPT rows: 3 kept (one of them cut at an empty message), 6 dropped for distinct reasons.
SHAREGPT_ROWS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    {
        "id": "b",
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "q"},
            {"from": "chatgpt", "value": "r"},
            {"from": "human", "value": "q2"},
        ],
    },
    {
        "id": "c",
        "conversations": [
            {"from": "human", "value": "x"},
            {"from": "gpt", "value": "y"},
            {"from": "human", "value": "  "},
            {"from": "gpt", "value": "z"},
        ],
    },
    {"id": "d", "conversations": [{"from": "gpt", "value": "first"}, {"from": "human", "value": "q"}]},
    {"id": "e", "conversations": []},
    {"id": "f", "conversations": [{"from": "human", "value": "q"}, {"from": "tool", "value": "out"}]},
    {"id": "g", "conversations": "not a list"},
    {"id": "h", "conversations": [{"from": "human"}]},
    {"id": "i", "conversations": [{"from": "system", "value": "s"}, {"from": "gpt", "value": "a"}]},
]
EXPECTED = [
    conv(("user", "hi"), ("assistant", "yo")),
    conv(("system", "sys"), ("user", "q"), ("assistant", "r"), ("user", "q2")),
    conv(("user", "x"), ("assistant", "y")),
]
EXPECTED_DROPS = {
    "no user turn before the first assistant turn": 2,
    "empty": 1,
    "unknown role": 1,
    "malformed": 2,
}


def to_openai(row: dict) -> dict:
    msgs = row["conversations"]
    if isinstance(msgs, list):
        msgs = [
            {"role": m.get("from"), "content": m.get("value")} if isinstance(m, dict) else m for m in msgs
        ]
        msgs = [{k: v for k, v in m.items() if v is not None} for m in msgs]
    return {"messages": msgs}


# ----------------------------------------------------------------------------------------------
# Messages and conversations


def test_message_validates_role_and_content():
    assert Message("user", "x").role == "user"
    with pytest.raises(DataError, match="human"):
        Message("human", "x")
    with pytest.raises(DataError, match="str"):
        Message("user", 3)  # type: ignore[arg-type]


def test_prompt_stops_before_first_assistant_turn():
    c = conv(("system", "s"), ("user", "u"), ("assistant", "a"), ("user", "u2"), ("assistant", "a2"))
    assert c.prompt == (Message("system", "s"), Message("user", "u"))
    only_user = conv(("user", "u"))
    assert only_user.prompt == only_user.messages


def test_conversation_bytes_round_trip():
    c = Conversation.make_dummy(turns=2, system=True)
    assert Conversation.from_bytes(c.to_bytes()) == c
    assert [m.role for m in c.messages] == ["system", "user", "assistant", "user", "assistant"]


# ----------------------------------------------------------------------------------------------
# Loading


def test_parse_rows_counts_each_drop_reason():
    convs, report = loading._parse_rows(SHAREGPT_ROWS, None, source="mem")
    assert convs == EXPECTED
    assert dict(report.dropped) == EXPECTED_DROPS
    assert report.cut == 1


def test_load_sharegpt_jsonl_logs_once(tmp_path, caplog):
    path = write_jsonl(tmp_path / "sg.jsonl", SHAREGPT_ROWS)
    with caplog.at_level(logging.INFO, logger="draft_align.data.loading"):
        assert load_conversations(str(path)) == EXPECTED
    records = [r.getMessage() for r in caplog.records if r.name == "draft_align.data.loading"]
    assert len(records) == 1
    assert "loaded 3 conversations" in records[0]
    assert "dropped 6" in records[0]
    assert "cut 1 at an empty message" in records[0]


def test_openai_form_json_array_gives_same_conversations(tmp_path):
    path = tmp_path / "oa.json"
    path.write_text(json.dumps([to_openai(r) for r in SHAREGPT_ROWS]), encoding="utf-8")
    assert load_conversations(str(path)) == EXPECTED


def test_json_lines_with_json_suffix(tmp_path):
    path = write_jsonl(tmp_path / "lines.json", [to_openai(r) for r in SHAREGPT_ROWS[:2]])
    assert load_conversations(str(path)) == EXPECTED[:2]


def test_openai_text_parts_are_joined(tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"},
        ]
    }
    image = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
            {"role": "assistant", "content": "c"},
        ]
    }
    path = write_jsonl(tmp_path / "parts.jsonl", [row, image])
    assert load_conversations(str(path)) == [conv(("user", "ab"), ("assistant", "c"))]


@pytest.mark.parametrize("form", ["sharegpt", "openai"])
def test_parquet_both_forms(tmp_path, form):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = [r for r in SHAREGPT_ROWS if r["id"] in "abc"]  # parquet needs one schema per column
    rows = good if form == "sharegpt" else [to_openai(r) for r in good]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_conversations(str(path)) == EXPECTED


def test_limit_counts_kept_conversations(tmp_path):
    path = write_jsonl(tmp_path / "sg.jsonl", SHAREGPT_ROWS)
    assert load_conversations(str(path), limit=2) == EXPECTED[:2]
    assert load_conversations(str(path), limit=0) == []


def test_hub_name_and_split_go_to_datasets(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return [to_openai(SHAREGPT_ROWS[0])]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_conversations("org/chat:train_sft") == EXPECTED[:1]
    assert load_conversations("org/chat") == EXPECTED[:1]
    assert calls == [("org/chat", "train_sft"), ("org/chat", "train")]


def test_hub_failure_is_a_data_error(monkeypatch):
    import datasets

    def boom(name, split):
        raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", boom)
    with pytest.raises(DataError, match="'org/missing'.*split 'test'"):
        load_conversations("org/missing:test")


def test_missing_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=f"{missing} does not exist"):
        load_conversations(str(missing))
    with pytest.raises(DataError, match="does not exist"):
        load_conversations("./no/such/dir/file")


def test_wrong_keys_names_the_keys_found(tmp_path):
    path = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "i", "output": "o"}, {"text": "t"}])
    with pytest.raises(DataError, match=r"keys found: \['instruction', 'output', 'text'\]"):
        load_conversations(str(path))


def test_unreadable_files(tmp_path):
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"messages": []}\n{oops\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_conversations(str(bad_line))
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("[{", encoding="utf-8")
    with pytest.raises(DataError, match="not valid JSON"):
        load_conversations(str(bad_json))
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_conversations(str(bad_parquet))
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DataError, match="cannot read"):
        load_conversations(str(binary))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match="no rows"):
        load_conversations(str(empty))


# ----------------------------------------------------------------------------------------------
# Held-out split


def test_split_heldout_is_seeded_and_order_preserving():
    items = list(range(20))
    train, held = split_heldout(items, 5, seed=3)
    assert split_heldout(items, 5, seed=3) == (train, held)
    assert len(held) == 5 and sorted(train + held) == items
    assert train == sorted(train) and held == sorted(held)
    assert split_heldout(items, 5, seed=4)[1] != held
    assert set(held) <= set(split_heldout(items, 8, seed=3)[1])
    assert split_heldout(items, 0, seed=3) == (items, [])
    with pytest.raises(ValueError):
        split_heldout(items, 21, seed=0)


# ----------------------------------------------------------------------------------------------
# Tokenisation


def test_encode_single_turn_masks_content_and_end_of_turn():
    tok = make_tokenizer()
    sample = encode_conversation(tok, conv(("user", "hi"), ("assistant", "yo")), max_len=100)
    prompt = [BOS] + ids_of(tok, "user\nhi") + [EOS] + ids_of(tok, "\n") + [BOS] + ids_of(tok, "assistant\n")
    response = ids_of(tok, "yo") + [EOS]
    assert sample.input_ids.tolist() == prompt + response
    assert sample.loss_mask.tolist() == [False] * len(prompt) + [True] * len(response)
    assert sample.num_response_tokens == 3


def test_encode_multi_turn_masks_every_assistant_turn_only():
    tok = make_tokenizer()
    c = conv(
        ("system", "s"), ("user", "a"), ("assistant", "bc"), ("user", "d"), ("assistant", "e"), ("user", "f")
    )
    sample = encode_conversation(tok, c, max_len=100)
    text = tok.decode(sample.input_ids.tolist())
    # The trailing user turn is not kept: it has no response after it.
    assert text == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"
        "bc<|im_end|>\n<|im_start|>user\nd<|im_end|>\n<|im_start|>assistant\ne<|im_end|>"
    )
    masked = [t for t, m in zip(sample.input_ids.tolist(), sample.loss_mask.tolist(), strict=True) if m]
    assert masked == ids_of(tok, "bc") + [EOS] + ids_of(tok, "e") + [EOS]
    # The newline after the first response's <|im_end|> belongs to the template, not the response.
    ends = ((sample.input_ids == EOS) & sample.loss_mask).nonzero().flatten().tolist()
    first_end = ends[0]
    assert sample.input_ids[first_end + 1].item() == ids_of(tok, "\n")[0]
    assert not sample.loss_mask[first_end + 1].item()


def test_default_system_prompt_template_is_handled():
    tok = make_tokenizer(CHATML_DEFAULT_SYSTEM)
    sample = encode_conversation(tok, conv(("user", "q"), ("assistant", "r")), max_len=100)
    assert tok.decode(sample.input_ids[~sample.loss_mask].tolist()).startswith("<|im_start|>system\nBe nice.")
    assert sample.input_ids[sample.loss_mask].tolist() == ids_of(tok, "r") + [EOS]


def test_pieces_are_tokenised_separately():
    tok = make_tokenizer(newline_merge=True)
    nl2 = tok.convert_tokens_to_ids("\n\n")
    sample = encode_conversation(tok, conv(("user", "q"), ("assistant", "\n\nr")), max_len=100)
    # Whole-text tokenisation would merge the header's "\n" with the content; pieces keep them apart.
    assert sample.input_ids[sample.loss_mask].tolist() == [nl2] + ids_of(tok, "r") + [EOS]
    assert tok.decode(sample.input_ids.tolist()).endswith("assistant\n\n\nr<|im_end|>")


def test_encode_prompt_is_the_start_of_encode_conversation():
    tok = make_tokenizer(CHATML_DEFAULT_SYSTEM)
    c = conv(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))
    prompt = encode_prompt(tok, c)
    sample = encode_conversation(tok, c, max_len=100)
    assert torch.equal(sample.input_ids[: prompt.numel()], prompt)
    assert not sample.loss_mask[: prompt.numel()].any() and sample.loss_mask[prompt.numel()].item()
    assert tok.decode(prompt.tolist()).endswith("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.dtype == torch.long and prompt.dim() == 1


def test_truncation_and_empty_results():
    tok = make_tokenizer()
    c = conv(("user", "hi"), ("assistant", "yo"))
    prompt_len = encode_prompt(tok, c).numel()
    cut = encode_conversation(tok, c, max_len=prompt_len + 1)
    assert len(cut) == prompt_len + 1 and cut.loss_mask.tolist() == [False] * prompt_len + [True]
    assert encode_conversation(tok, c, max_len=prompt_len) is None
    assert encode_conversation(tok, conv(("user", "hi")), max_len=100) is None


def test_unstable_template_raises():
    tok = make_tokenizer(UNSTABLE)
    two_turns = conv(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))
    with pytest.raises(DataError, match="not prefix-stable at message 3"):
        encode_conversation(tok, two_turns, max_len=100)


def test_missing_template_raises():
    tok = make_tokenizer(template=None)
    with pytest.raises(DataError, match="chat template"):
        encode_conversation(tok, conv(("user", "a"), ("assistant", "b")), max_len=100)


def test_encode_response_cuts_after_first_eos():
    tok = make_tokenizer()
    sample = encode_response(tok, [5, 6, 7], torch.tensor([8, 9, EOS, EOS, EOS]))
    assert sample.input_ids.tolist() == [5, 6, 7, 8, 9, EOS]
    assert sample.loss_mask.tolist() == [False, False, False, True, True, True]
    cut = encode_response(tok, torch.tensor([5]), [8, 9])
    assert cut.input_ids.tolist() == [5, 8, 9] and cut.loss_mask.tolist() == [False, True, True]
    other_eos = encode_response(tok, [5], [8, 9, 10, EOS], eos_token_ids={9})
    assert other_eos.input_ids.tolist() == [5, 8, 9]


def test_encode_response_strips_padding_when_pad_is_not_eos():
    tok = make_tokenizer()
    tok.pad_token = "<|endoftext|>"
    sample = encode_response(tok, [5], [8, 9, 0, 0])
    assert sample.input_ids.tolist() == [5, 8, 9] and sample.loss_mask.tolist() == [False, True, True]


def test_encoded_sample_validation_and_dummy():
    dummy = EncodedSample.make_dummy(length=6, prompt_len=2, seed=1)
    assert dummy.loss_mask.tolist() == [False, False, True, True, True, True]
    assert torch.equal(dummy.input_ids, EncodedSample.make_dummy(length=6, prompt_len=2, seed=1).input_ids)
    with pytest.raises(DataError):
        EncodedSample(torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.bool))
    with pytest.raises(DataError):
        EncodedSample(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------
# Real data and tokenizer


@pytest.mark.slow
def test_real_sharegpt_with_smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draft_align import assets

    lines = assets.fetch_sharegpt().read_text(encoding="ascii").splitlines()
    raw = [json.loads(line) for line in lines]
    assert len(raw) == 17671
    convs, report = loading._parse_rows(raw, None, source="sharegpt")
    assert load_conversations("sharegpt") == convs
    assert len(convs) == 17671 - sum(report.dropped.values())
    assert dict(report.dropped) == REAL_SHAREGPT_DROPS
    assert len(convs) == REAL_SHAREGPT_KEPT

    tok = AutoTokenizer.from_pretrained(str(assets.fetch_smollm2()))
    max_len = 2048
    for c in convs[:100]:
        sample = encode_conversation(tok, c, max_len=max_len)
        prompt = encode_prompt(tok, c)
        if sample is None:  # the prompt alone fills max_len
            assert prompt.numel() >= max_len
            continue
        assert torch.equal(sample.input_ids[: prompt.numel()], prompt)
        # Each masked run decodes to one assistant message's content followed by <|im_end|>.
        ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
        starts = [t for t in range(len(ids)) if mask[t] and (t == 0 or not mask[t - 1])]
        ends = [t + 1 for t in range(len(ids)) if mask[t] and (t + 1 == len(ids) or not mask[t + 1])]
        decoded = [tok.decode(ids[a:b]) for a, b in zip(starts, ends, strict=True)]
        answers = [m.content + "<|im_end|>" for m in c.messages if m.role == "assistant"]
        if len(sample) == max_len:  # truncated: the last run is a prefix of its answer
            assert answers[len(decoded) - 1].startswith(decoded.pop())
        else:
            assert len(decoded) == len(answers)
        assert decoded == answers[: len(decoded)]


# ShareGPT V3 is split into chunks; a later chunk often starts with a "gpt" turn, which is dropped.
REAL_SHAREGPT_DROPS = {"no user turn before the first assistant turn": 6370, "empty": 133}
REAL_SHAREGPT_KEPT = 11168
