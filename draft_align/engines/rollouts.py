"""vLLM as the RL job's rollout engine: policy weight sync, frozen/adapted drafts, counters, log-probs.

One :class:`VLLMRollouts` lives in the RL process beside the trained policy (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
the engine core runs in this process, so weights and functions reach the worker without serialisation).

- **Policy sync** (:meth:`VLLMRollouts.sync_policy`): before a step's rollouts the engine's target must be the
  current policy.  The LoRA policy is merged per tensor (W + scale·B·A, :func:`merged_layer_weights`) for every
  decoder layer that holds an adapter, and the worker reloads exactly those layers in place
  (:func:`rpc_load_policy_layers`: vLLM's layerwise reload, which repacks the CPU kernels' weights).  The
  embedding and lm_head are never written: the EAGLE-3 draft shares the embedding, and a LoRA on either is
  refused.  Version 0 (adapter B = 0) is the base model the engine started from: no sync.
- **Drafts**: the engine serves either the frozen warm-start draft or the adapted one (the newest version that
  passed the :class:`~draft_align.engines.vllm_engine.ProbeGuard`); :meth:`offer` applies a new version once
  (sha256, compatibility, probe, rollback on collapse), :meth:`use` swaps between the two known-good versions
  without a probe.  Rollouts are grouped by draft so a step swaps at most once.
- **Measured acceptance**: the engine's spec-decode counters, differenced around each draft's ``generate``.
- **Log-probs**: each sampled token's log-prob under the engine (``logprobs=0``, ``processed_logprobs``: after
  temperature), so the RL job can compare them with its own recomputed ones (:func:`logprob_gap`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from draft_align.engines.vllm_engine import (
    DraftRefresher,
    EngineError,
    ProbeGuard,
    SpecCounters,
    _rpc,
    _vllm,
    start_engine,
)
from draft_align.publish.folder import read_manifest
from draft_align.publish.versions import resolve_draft_dir

if TYPE_CHECKING:
    from draft_align.rl.policy import Policy

log = logging.getLogger(__name__)

# vLLM on this CPU: the in-process engine (start ≈ 9 s instead of 25 s, collective_rpc needs no pickling), a
# small KV cache, and no OpenMP pinning (the RL job's own torch threads share the cores)
CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
VERIFY_TO_SAMPLE_METHOD = {"greedy_draft": "greedy", "probabilistic": "probabilistic"}
LAYERS_PREFIX = "model.layers."


def set_cpu_env(kv_cache_gb: float | None = None) -> dict[str, str]:
    """Set the vLLM-CPU environment defaults that are not already set; returns what was set."""
    wanted = dict(CPU_ENV)
    if kv_cache_gb is not None:
        wanted["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(math.ceil(kv_cache_gb))))
    done = {}
    for name, value in wanted.items():
        if name not in os.environ:
            os.environ[name] = value
            done[name] = value
    return done


# --------------------------------------------------------------------------------------- policy weights
def _layer_of(name: str) -> str | None:
    """``model.layers.7.self_attn.q_proj.weight`` → ``model.layers.7``; None outside the decoder layers."""
    if not name.startswith(LAYERS_PREFIX):
        return None
    index = name[len(LAYERS_PREFIX):].split(".", 1)[0]
    return LAYERS_PREFIX + index if index.isdigit() else None


@torch.no_grad()
def merged_layer_weights(policy: Policy, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF checkpoint names → merged tensors of every decoder layer that holds a LoRA module of ``policy``.

    A LoRA-wrapped linear contributes ``base + Σ_active get_delta_weight(adapter)`` under its plain name (no
    ``.base_layer``); the layer's other tensors are sent as they are, because vLLM reloads a layer whole.  The
    live model is not modified.  ``dtype``: the engine's dtype (default: each tensor's own).
    """
    from peft.tuners.lora import LoraLayer

    model = policy.hf_model
    lora_modules = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    layers = set()
    for name in lora_modules:
        layer = _layer_of(name + ".")
        if layer is None:
            raise EngineError(
                f"LoRA module {name} lies outside the decoder layers: the engine sync reloads decoder layers only "
                f"(the embedding is shared with the draft); drop it from rl.lora_targets"
            )
        layers.add(layer)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if "lora_" in name or _layer_of(name) not in layers:
            continue
        if ".base_layer." in name:
            owner_name = name.split(".base_layer.", 1)[0]
            owner = lora_modules[owner_name]
            value = param.detach().clone()
            if name.endswith(".weight"):
                for adapter in owner.active_adapters:
                    if adapter in owner.lora_A:
                        value += owner.get_delta_weight(adapter).to(value.dtype)
            name = name.replace(".base_layer.", ".")
        else:
            value = param.detach()
        out[name] = value.to(dtype) if dtype is not None else value
    for name, buf in model.named_buffers():
        if _layer_of(name) in layers and not name.endswith("inv_freq"):
            out.setdefault(name, buf.detach())
    return out


def rpc_load_policy_layers(worker: Any, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, Any]:
    """(runs in each worker) Reload the target's decoder layers named by ``weights`` in place.

    Inside ``set_current_vllm_config``: ``initialize_layerwise_reload`` on each layer, ``model.load_weights``
    with the HF-named tensors (vLLM fuses q/k/v and gate/up itself), ``finalize_layerwise_reload`` (repacks
    for the CPU kernels).  Unfused tensors (the layer norms) are read back and compared.  Nothing outside
    these layers is touched.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    start = time.perf_counter()
    model = worker.model_runner.get_model()
    layer_names = sorted({_layer_of(n) for n in weights} - {None})
    if not layer_names or any(_layer_of(n) is None for n in weights):
        raise EngineError("policy sync: every tensor must belong to a decoder layer (model.layers.N.…)")
    try:
        layers = [model.get_submodule(n) for n in layer_names]
    except AttributeError as e:
        raise EngineError(f"policy sync: the engine's model has no {e}") from e
    model_config = worker.vllm_config.model_config
    with set_current_vllm_config(worker.vllm_config):
        for layer in layers:
            initialize_layerwise_reload(layer)
        try:
            loaded = model.load_weights(iter(weights.items()))
        finally:
            for layer in layers:
                finalize_layerwise_reload(layer, model_config)
    params = dict(model.named_parameters())
    checked = 0
    for name, t in weights.items():
        p = params.get(name)
        if p is None or p.numel() != t.numel():
            continue  # fused (qkv, gate_up) or repacked for the CPU kernel: not comparable by name
        if not torch.equal(p.detach().cpu().reshape(t.shape), t.to(p.dtype)):
            raise EngineError(f"policy sync: {name} holds other values than were sent after the reload")
        checked += 1
    worker.model_runner.draft_align_policy_version = int(version)
    return {"layers": len(layers), "tensors": len(weights), "loaded": len(loaded or ()), "checked": checked,
            "seconds": time.perf_counter() - start}  # fmt: skip


# --------------------------------------------------------------------------------------- log-prob gap
def logprob_gap(engine: torch.Tensor, recomputed: torch.Tensor) -> dict[str, float]:
    """Engine − recomputed log-probs of the same sampled tokens: mean, mean |·|, max |·| (NaN when empty)."""
    if engine.shape != recomputed.shape:
        raise ValueError(f"log-prob gap: shapes differ {tuple(engine.shape)} vs {tuple(recomputed.shape)}")
    if engine.numel() == 0:
        return {"engine_logprob_gap_mean": math.nan, "engine_logprob_gap_abs_mean": math.nan,
                "engine_logprob_gap_abs_max": math.nan}  # fmt: skip
    d = engine.double() - recomputed.double()
    return {
        "engine_logprob_gap_mean": float(d.mean()),
        "engine_logprob_gap_abs_mean": float(d.abs().mean()),
        "engine_logprob_gap_abs_max": float(d.abs().max()),
    }


# --------------------------------------------------------------------------------------- the engine
@dataclass
class EngineOutput:
    """One request's result: new tokens (stop token included when it stopped on one) and their log-probs."""

    tokens: torch.Tensor  # [R] long
    logprobs: torch.Tensor  # [R] float32, NaN where the engine returned none
    finished: bool  # stopped on a stop token (not on max_tokens)


class VLLMRollouts:
    """vLLM serving the current policy with the frozen or the adapted draft (see the module docstring).

    ``target``: the base model the policy's LoRA sits on (alias, folder or hub id); ``frozen_dir``: the
    warm-start draft (a version folder or a run folder).  ``verify_mode``: ``greedy_draft`` (vLLM's default
    draft sampling) or ``probabilistic``; vLLM has no "argmax everywhere" mode at T > 0.
    """

    def __init__(
        self,
        target: str,
        frozen_dir: str | Path,
        *,
        k: int,
        verify_mode: str = "greedy_draft",
        dtype: str = "bfloat16",
        max_model_len: int = 1024,
        seed: int = 0,
        guard: ProbeGuard | None = None,
        kv_cache_gb: float | None = None,
        **llm_kwargs: Any,
    ) -> None:
        if verify_mode not in VERIFY_TO_SAMPLE_METHOD:
            raise EngineError(
                f"verify mode {verify_mode!r} has no vLLM equivalent: use greedy_draft (vLLM's default) or "
                f"probabilistic"
            )
        set_cpu_env(kv_cache_gb)
        self.frozen_dir = resolve_draft_dir(Path(frozen_dir))
        self.k = int(k)
        self.verify_mode = verify_mode
        t0 = time.perf_counter()
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")  # after temperature, like the RL's log π
        self.llm = start_engine(
            target, self.frozen_dir, k=self.k, draft_sample_method=VERIFY_TO_SAMPLE_METHOD[verify_mode],  # type: ignore[arg-type]
            max_model_len=max_model_len, seed=seed, dtype=dtype, **llm_kwargs,
        )  # fmt: skip
        self.start_s = time.perf_counter() - t0
        self.dtype = getattr(torch, dtype)
        self.refresher = DraftRefresher(self.llm, None, guard=guard)
        frozen = read_manifest(self.frozen_dir, verify=False)
        self.frozen_version = int(frozen["draft_version"])
        self.adapted_dir: Path = self.frozen_dir  # the newest adapted version that passed (frozen until then)
        self.adapted_version = 0
        self.adapted_policy_version = 0
        self.serving = "frozen"
        self.policy_version = 0  # the policy version the engine's target holds
        self.syncs = 0
        self.offers_refused = 0

    # ----------------------------------------------------------------- policy
    def sync_policy(self, policy: Policy) -> bool:
        """Make the engine's target the policy's current version; True when weights were sent."""
        if policy.version == self.policy_version:
            return False
        t0 = time.perf_counter()
        weights = merged_layer_weights(policy, self.dtype)
        info = _rpc(self.llm, rpc_load_policy_layers, weights, int(policy.version))[0]
        self.llm.reset_prefix_cache()  # cached prompt blocks hold the previous policy's K/V
        self.policy_version = int(policy.version)
        self.syncs += 1
        log.info("engine: policy v%d synced (%d layers, %d tensors) in %.2f s", policy.version, info["layers"],
                 info["tensors"], time.perf_counter() - t0)  # fmt: skip
        return True

    # ----------------------------------------------------------------- drafts
    def offer(self, version_dir: str | Path) -> bool:
        """Serve the published version at ``version_dir`` as the adapted draft if it passes; False otherwise
        (the engine then serves what it served before)."""
        path = Path(version_dir)
        if path.resolve() == self.adapted_dir.resolve():
            return False
        ok = self.refresher.apply(path, probe=True)
        if ok:
            man = read_manifest(path, verify=False)
            self.adapted_dir = path
            self.adapted_version = int(man["draft_version"])
            self.adapted_policy_version = int(man["policy_version"])
            self.serving = "adapted"
        else:
            self.offers_refused += 1
        return ok

    def use(self, kind: str) -> None:
        """Serve the frozen or the adapted (already accepted) draft; swaps only when needed."""
        if kind not in ("frozen", "adapted"):
            raise ValueError(f"draft kind {kind!r}")
        want = self.frozen_dir if kind == "frozen" else self.adapted_dir
        if Path(self.refresher.current.path).resolve() == want.resolve():
            self.serving = kind
            return
        if not self.refresher.apply(want, probe=False):
            raise EngineError(f"engine: could not swap back to the {kind} draft {want}: {self.refresher.history[-1]}")
        self.serving = kind

    # ----------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Sequence[torch.Tensor],
        seeds: Sequence[int],
        *,
        temperature: float,
        max_tokens: int,
        stop_ids: Sequence[int],
    ) -> tuple[list[EngineOutput], SpecCounters]:
        """Sample one response per prompt with the serving draft; (outputs, counters of exactly this call)."""
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return [], SpecCounters()
        vllm = _vllm()
        stops = sorted({int(i) for i in stop_ids})
        params = [
            vllm.SamplingParams(
                temperature=float(temperature), max_tokens=int(max_tokens), seed=int(s), stop_token_ids=stops,
                logprobs=0, detokenize=False,
            )  # fmt: skip
            for s in seeds
        ]
        requests = [{"prompt_token_ids": [int(t) for t in p.tolist()]} for p in prompts]
        before = SpecCounters.snapshot(self.llm)
        outs = self.llm.generate(requests, params, use_tqdm=False)
        counters = SpecCounters.snapshot(self.llm) - before
        results = []
        stop_set = set(stops)
        for o in outs:
            c = o.outputs[0]
            ids = [int(t) for t in c.token_ids]
            lps = [math.nan] * len(ids)
            for i, (tid, entry) in enumerate(zip(ids, c.logprobs or [], strict=False)):
                lp = entry.get(tid) if entry else None
                lps[i] = float(lp.logprob) if lp is not None else math.nan
            finished = bool(ids) and ids[-1] in stop_set
            results.append(EngineOutput(torch.tensor(ids, dtype=torch.long),
                                        torch.tensor(lps, dtype=torch.float32), finished))  # fmt: skip
        return results, counters

    def metrics(self) -> dict[str, float]:
        """Gauges for the step's metrics (the refresher's plus the policy sync's); the adapted version and the
        sync time are the step's own ``draft_version`` and ``policy_sync_s``."""
        return {
            **self.refresher.metrics(),
            "engine_policy_version": float(self.policy_version),
            "engine_policy_syncs": float(self.syncs),
            "engine_offers_refused": float(self.offers_refused),
        }

    def shutdown(self) -> None:
        """Stop the engine core (frees its KV cache)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
