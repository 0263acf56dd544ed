"""vLLM as the RL job's rollout engine: policy weight sync, frozen/adapted drafts, counters, log-probs.

One :class:`VLLMRollouts` lives in the RL process beside the trained policy (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
set by the launcher: the engine core runs in this process, so weights and functions reach the worker without
serialisation).  It implements :class:`draft_align.rl.rollouts.RolloutEngine`.

- **Policy sync** (:meth:`VLLMRollouts.sync_policy`): before a step's rollouts the engine's target must be the
  current policy.  The LoRA policy is merged per tensor (:func:`~draft_align.hf.lora_layers.merged_layer_weights`)
  for every decoder layer that holds an adapter, and the worker reloads exactly those layers in place
  (:func:`~draft_align.engines.vllm.worker_rpc.rpc_load_policy_layers`); a fully fine-tuned policy (no LoRA)
  reloads every decoder layer (:func:`~draft_align.hf.lora_layers.policy_layer_weights`).  Version 0 (adapter
  B = 0, or the untouched weights) is the base model the engine started from: no sync.
- **Drafts**: the engine serves either the frozen warm-start draft or the adapted one (the newest version that
  passed the :class:`~draft_align.engines.vllm.refresher.ProbeGuard`); :meth:`offer` applies a new verified
  version once (probe, rollback on collapse), :meth:`use` swaps between the two known-good versions without a
  probe.  Rollouts are grouped by draft so a step swaps at most once.
- **Measured acceptance**: the engine's spec-decode counters, differenced around each draft's ``generate``;
  with them the seconds and engine steps of each ``generate`` (``generate_s_<kind>``, ``engine_steps_<kind>``)
  and the seconds spent swapping between the drafts (``draft_swap_s``), the inputs of ``draft-align advise``.
- **Log-probs**: each sampled token's log-prob under the engine (``logprobs=0``, ``processed_logprobs``: after
  temperature), compared with the RL job's recomputed ones (:func:`~draft_align.monitor.logprob_gap.logprob_gap`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from draft_align.acceptance import AcceptanceTally
from draft_align.conventions import AUTO_VERIFY_MODE, DRAFT_KINDS, DraftKind, float_dtype
from draft_align.engines.rollout_types import (
    Decoding,
    DraftVersion,
    Rollout,
    RolloutPlan,
)
from draft_align.engines.vllm.counters import SpecCounters
from draft_align.engines.vllm.refresher import DraftRefresher, ProbeGuard
from draft_align.engines.vllm.start import SEED_BITS, EngineError, collective_rpc, import_vllm, start_engine
from draft_align.engines.vllm.verify_choice import CANDIDATES, VerifyChoice, choose_verify_mode
from draft_align.engines.vllm.worker_rpc import rpc_load_policy_layers, rpc_set_draft_sample_method
from draft_align.hf.lora_layers import policy_layer_weights
from draft_align.monitor.logprob_gap import logprob_gap

log = logging.getLogger(__name__)

#: Who keeps the engine's target on the current policy: ``layers`` — :meth:`VLLMRollouts.sync_policy` reloads
#: the changed decoder layers —, ``external`` — the engine's owner does (TRL's colocate engine).
PolicySync = Literal["layers", "external"]
POLICY_SYNCS: tuple[str, ...] = ("layers", "external")
VERIFY_TO_SAMPLE_METHOD = {"greedy_draft": "greedy", "probabilistic": "probabilistic"}


@dataclass
class EngineOutput:
    """One request's result: new tokens (stop token included when it stopped on one) and their log-probs."""

    tokens: torch.Tensor  # [R] long
    logprobs: torch.Tensor  # [R] float32, NaN where the engine returned none
    finished: bool  # stopped on a stop token (not on max_tokens)


class VLLMRollouts:
    """vLLM serving the current policy with the frozen or the adapted draft (see the module docstring).

    ``target``: the base model the policy's LoRA sits on (alias, folder or hub id); ``frozen``: the verified
    warm-start draft.  ``verify_mode``: ``greedy_draft`` (vLLM's default draft sampling), ``probabilistic``, or
    ``auto``: at T > 0 the one with the higher acceptance measured on ``guard``'s probe prompts (vLLM's counters,
    :func:`~draft_align.engines.vllm.verify_choice.choose_verify_mode`) before the first T > 0 rollouts, and again
    after every ``verify_recheck_every`` newly served adapted drafts (0: never again; one measurement costs
    two probe passes); vLLM has no "argmax everywhere" mode at T > 0.  ``llm``: an engine already running with ``frozen`` as its
    EAGLE-3 draft (else one is started); ``policy_sync``: see :data:`PolicySync`.  ``run_dir`` / ``key_file``: the run whose drafts the refresher
    loads and its wire key (docs/servers.md, "The in-process path").  ``guard_on_load``: the
    refresher probes every newly offered draft with ``guard`` before it serves (synchronous, seconds per
    draft); False leaves the silent-zero check to the RL job's counters
    (:meth:`~draft_align.rl.drafts.DraftSource.judge`) and uses ``guard``'s prompts for ``auto`` only.
    """

    def __init__(
        self,
        target: str,
        frozen: DraftVersion,
        *,
        k: int,
        verify_mode: str = "greedy_draft",
        dtype: str = "bfloat16",
        max_model_len: int = 1024,
        seed: int = 0,
        guard: ProbeGuard | None = None,
        llm: Any = None,
        policy_sync: PolicySync = "layers",
        verify_recheck_every: int = 0,
        guard_on_load: bool = True,
        run_dir: str | Path | None = None,
        key_file: str | None = None,
        **llm_kwargs: Any,
    ) -> None:
        self.auto_verify = verify_mode == AUTO_VERIFY_MODE
        if self.auto_verify:
            if guard is None:
                raise EngineError(
                    "verify mode auto measures both draft sampling methods on the probe prompts: "
                    "it needs a probe guard (rl.guard.probe_prompts > 0)"
                )
            verify_mode = CANDIDATES[0]  # vLLM's default until the first measurement
        if verify_mode not in VERIFY_TO_SAMPLE_METHOD:
            raise EngineError(
                f"verify mode {verify_mode!r} has no vLLM equivalent: use greedy_draft (vLLM's default), "
                f"probabilistic or auto"
            )
        self.frozen = frozen
        self.k = int(k)
        self.verify_mode = verify_mode  # the one serving now
        self.verify_choice: VerifyChoice | None = None  # the latest measurement (verify mode auto)
        if verify_recheck_every < 0:
            raise EngineError(
                f"verify_recheck_every must be ≥ 0 (0: measure once), got {verify_recheck_every}"
            )
        self.verify_recheck_every = int(verify_recheck_every)
        self.adapted_since_choice = 0  # adapted drafts newly served since the latest measurement
        if policy_sync not in POLICY_SYNCS:
            raise EngineError(f"policy_sync {policy_sync!r}: expected one of {POLICY_SYNCS}")
        self.policy_sync: PolicySync = policy_sync
        t0 = time.perf_counter()
        if llm is None:
            llm_kwargs.setdefault(
                "logprobs_mode", "processed_logprobs"
            )  # after temperature, like the RL's log π
            llm = start_engine(
                target,
                frozen.path,
                k=self.k,
                draft_sample_method=VERIFY_TO_SAMPLE_METHOD[verify_mode],  # type: ignore[arg-type]
                max_model_len=max_model_len,
                seed=seed,
                dtype=dtype,
                **llm_kwargs,
            )
        elif llm_kwargs:
            raise EngineError(
                f"an engine that is already running takes no LLM arguments, got {sorted(llm_kwargs)}"
            )
        self.llm = llm
        self.start_s = time.perf_counter() - t0
        self.dtype = float_dtype(dtype)
        self.probes = guard  # the prompts verify mode auto measures on
        self.refresher = DraftRefresher(
            self.llm,
            guard=guard if guard_on_load else None,
            serving=frozen,
            run_dir=run_dir,
            key_file=key_file,
        )
        self._adapted: DraftVersion | None = None
        self.serving: DraftKind = "frozen"
        self.policy_version = 0  # the policy version the engine's target holds
        self.syncs = 0
        self.offers_refused = 0
        self.last_timings: dict[
            str, float
        ] = {}  # the latest rollouts' generate/swap seconds and engine steps

    @property
    def adapted(self) -> DraftVersion | None:
        """The newest adapted version that passed the guard (None: the frozen draft stands in)."""
        return self._adapted

    # ----------------------------------------------------------------- policy
    def sync_policy(self, model: nn.Module, version: int) -> bool:
        """Make the engine's target policy ``version`` (``model``: the LoRA-injected HF model); True when
        weights were sent."""
        if version == self.policy_version:
            return False
        if self.policy_sync == "external":  # its owner (TRL's colocate engine) synced it before the rollouts
            self.policy_version = int(version)
            return False
        t0 = time.perf_counter()
        weights = policy_layer_weights(model, self.dtype)
        info = collective_rpc(self.llm, rpc_load_policy_layers, weights, int(version))[0]
        self.llm.reset_prefix_cache()  # cached prompt blocks hold the previous policy's K/V
        self.policy_version = int(version)
        self.syncs += 1
        log.info(
            "engine: policy v%d synced (%d layers, %d tensors) in %.2f s",
            version,
            info["layers"],
            info["tensors"],
            time.perf_counter() - t0,
        )
        return True

    # ----------------------------------------------------------------- drafts
    def offer(self, draft: DraftVersion) -> bool:
        """Serve the verified version ``draft`` as the adapted draft if it passes the guard; False otherwise
        (the engine then serves what it served before)."""
        current = self._adapted if self._adapted is not None else self.frozen
        if draft.path.resolve() == current.path.resolve():
            return False
        ok = self.refresher.apply(draft, probe=True)
        if ok:
            self._adapted = draft
            self.serving = "adapted"
            self.adapted_since_choice += 1
        else:
            self.offers_refused += 1
        return ok

    def use(self, kind: str) -> None:
        """Serve the frozen or the adapted (already accepted) draft; swaps only when needed."""
        if kind not in DRAFT_KINDS:
            raise ValueError(f"draft kind {kind!r}")
        want = self._adapted if kind == "adapted" and self._adapted is not None else self.frozen
        if want.path.resolve() == Path(self.refresher.current.path).resolve():
            self.serving = kind  # type: ignore[assignment]
            return
        if not self.refresher.apply(want, probe=False):
            raise EngineError(
                f"engine: could not swap back to the {kind} draft {want.path}: {self.refresher.history[-1]}"
            )
        self.serving = kind  # type: ignore[assignment]

    # ----------------------------------------------------------------- verify mode (auto)
    def set_verify_mode(self, mode: str) -> None:
        """Verify with ``mode`` (greedy_draft | probabilistic) from the next ``generate`` on, no restart."""
        if mode not in VERIFY_TO_SAMPLE_METHOD:
            raise EngineError(f"verify mode {mode!r}: expected one of {tuple(VERIFY_TO_SAMPLE_METHOD)}")
        collective_rpc(self.llm, rpc_set_draft_sample_method, VERIFY_TO_SAMPLE_METHOD[mode])
        self.verify_mode = mode

    def _probe_tally(self, mode: str, temperature: float) -> AcceptanceTally:
        """The serving draft's counters over the guard's probe prompts in ``mode`` at ``temperature`` (fixed
        seeds, every prompt ``max_tokens`` long)."""
        guard = self.probes
        assert guard is not None  # checked at construction
        vllm = import_vllm()
        self.set_verify_mode(mode)
        params = [
            vllm.SamplingParams(
                temperature=float(temperature),
                max_tokens=guard.max_tokens,
                seed=7919 + i,
                ignore_eos=True,
                detokenize=False,
            )
            for i in range(len(guard.prompts))
        ]
        before = SpecCounters.snapshot(self.llm)
        self.llm.generate(list(guard.prompts), params, use_tqdm=False)
        return (SpecCounters.snapshot(self.llm) - before).as_tally(self.k)

    def choose_verify_mode(self, temperature: float) -> VerifyChoice:
        """Measure both modes with the draft that pays (the adapted one when there is one) and serve the winner."""
        self.use("adapted" if self._adapted is not None else "frozen")
        current = self.verify_mode
        choice = choose_verify_mode(
            lambda m: self._probe_tally(m, temperature),
            current=current,
            draft=str(self.refresher.current.path),
            temperature=temperature,
        )
        self.set_verify_mode(choice.mode)
        self.verify_choice = choice
        self.adapted_since_choice = 0
        return choice

    def _verify_choice_stale(self, temperature: float) -> bool:
        c = self.verify_choice
        if c is None or c.temperature != float(temperature):
            return True
        return 0 < self.verify_recheck_every <= self.adapted_since_choice

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
        vllm = import_vllm()
        stops = sorted({int(i) for i in stop_ids})
        params = [
            vllm.SamplingParams(
                temperature=float(temperature),
                max_tokens=int(max_tokens),
                seed=int(s),
                stop_token_ids=stops,
                logprobs=0,
                detokenize=False,
            )
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
            results.append(
                EngineOutput(
                    torch.tensor(ids, dtype=torch.long), torch.tensor(lps, dtype=torch.float32), finished
                )
            )
        return results, counters

    # ----------------------------------------------------------------- the RolloutEngine interface
    def prepare(
        self, policy_model: nn.Module, policy_version: int, adapted: DraftVersion | None
    ) -> dict[str, float]:
        """Sync the policy, offer the newest verified adapted draft (a no-op unless new; refused → the previous
        one keeps serving); the seconds each took."""
        t0 = time.perf_counter()
        self.sync_policy(policy_model, policy_version)
        sync_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if adapted is not None:
            self.offer(adapted)
        elif self._adapted is not None:  # the job rolled its adapted draft back to the frozen one
            self._adapted = None
        return {"engine_vllm": 1.0, "policy_sync_s": sync_s, "draft_offer_s": time.perf_counter() - t0}

    def rollouts(
        self, plan: RolloutPlan, prompts: Sequence[torch.Tensor], decoding: Decoding
    ) -> tuple[list[Rollout], dict[DraftKind, AcceptanceTally]]:
        """All rollouts of ``plan``: one batched generate per draft, the serving draft's first; each draft's
        acceptance is the counter difference around its generate."""
        t0 = time.perf_counter()
        if self.auto_verify and decoding.temperature > 0 and self._verify_choice_stale(decoding.temperature):
            self.choose_verify_mode(decoding.temperature)
        verify_choice_s = time.perf_counter() - t0
        seeded = list(zip(plan.rollouts, plan.seeds(SEED_BITS), strict=True))
        order = sorted(DRAFT_KINDS, key=lambda kind: kind != self.serving)
        results: dict[int, EngineOutput] = {}
        tallies = {kind: AcceptanceTally.empty(self.k) for kind in DRAFT_KINDS}
        timings = {"draft_swap_s": 0.0, "verify_choice_s": verify_choice_s}
        for kind in order:
            mine = [(p, seed) for p, seed in seeded if p.draft == kind]
            if not mine:
                continue
            t0 = time.perf_counter()
            self.use(kind)
            t1 = time.perf_counter()
            outs, counts = self.generate(
                [prompts[p.prompt_index] for p, _ in mine],
                [seed for _, seed in mine],
                temperature=decoding.temperature,
                max_tokens=decoding.max_tokens,
                stop_ids=sorted(decoding.eos_ids),
            )
            timings["draft_swap_s"] += t1 - t0
            timings[f"generate_s_{kind}"] = time.perf_counter() - t1
            timings[f"engine_steps_{kind}"] = float(counts.engine_steps)
            tallies[kind] = counts.as_tally(self.k)
            results.update({p.index: o for (p, _), o in zip(mine, outs, strict=True)})
        out = [
            Rollout(
                p.prompt_index,
                prompts[p.prompt_index].cpu(),
                results[p.index].tokens,
                results[p.index].finished,
                p.draft,
                None,
                engine_logprobs=results[p.index].logprobs,
            )
            for p in plan.rollouts
        ]
        self.last_timings = timings
        return out, tallies

    def prefetch(self, plan: RolloutPlan, prompts: Sequence[torch.Tensor], decoding: Decoding) -> None:
        """Synchronous: the rollouts are decoded at the step, with the policy synced right before."""
        return None

    def step_metrics(self, rollouts: Sequence[Rollout], old_logprobs: torch.Tensor) -> dict[str, float]:
        """The engine's log-probs vs the job's recomputed ones (``engine_logprob_gap_*``), the rollouts' timings
        (:attr:`last_timings`), then the gauges."""
        engine_lp = torch.cat([r.engine_logprobs for r in rollouts if r.engine_logprobs is not None])
        return {**logprob_gap(engine_lp, old_logprobs.cpu()), **self.last_timings, **self.metrics()}

    def metrics(self) -> dict[str, float]:
        """Gauges for the step's metrics (the refresher's plus the policy sync's); the adapted version and the
        sync time are the step's own ``draft_version`` and ``policy_sync_s``."""
        return {
            **self.refresher.metrics(),
            **(self.verify_choice.metrics() if self.verify_choice is not None else {}),
            "verify_probabilistic": float(self.verify_mode == "probabilistic"),  # which mode served (1 / 0)
            "engine_policy_version": float(self.policy_version),
            "engine_policy_syncs": float(self.syncs),
            "engine_offers_refused": float(self.offers_refused),
        }

    def shutdown(self) -> None:
        """Stop the engine core (frees its KV cache)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
