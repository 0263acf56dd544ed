"""Hot draft refresh: serve a newer verified draft version in a running ``vllm.LLM`` without a restart.

:meth:`DraftRefresher.apply` takes a :class:`~draft_align.engines.rollout_types.DraftVersion` whose files the
caller verified once and which fits the serving draft (the RL side's
:class:`~draft_align.rl.drafts.DraftSource` checks both).  The load goes through vLLM's own RL weight-update
API on ``LLM`` — ``start_draft_weight_update`` → ``update_weights`` → ``finish_weight_update`` — to the
``draft_align`` weight-transfer backend (:mod:`~draft_align.engines.vllm.transfer`), which an engine started
by :func:`~draft_align.engines.vllm.start.start_engine` has: the update is the run's signed ``DraftPublished``
for the version, and inside each worker the backend reads the files once, re-hashes them, checks the vocab map
and the shared tensors, and loads only the draft-private tensors; on any failure the previous version keeps
serving (restored in place by the backend).  No callable crosses the engine boundary.  A :class:`ProbeGuard`
rolls back a version whose acceptance collapses (the previous version, which the backend holds in memory).

An engine without the backend (a vLLM older than the RL API, or one started elsewhere without
``weight_transfer_config``) is refreshed the old way: :func:`~draft_align.engines.vllm.worker_rpc.rpc_load_draft`
through ``collective_rpc`` (by name with draft_align's worker extension, as a callable in-process otherwise).

Pausing: each call runs in the engine core between two scheduler steps, so a refresh never overlaps a
forward pass.  Requests in flight finish with the new draft; only acceptance can change, never the output
distribution, because verification is lossless (docs/acceptance.md).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_align.engines.rollout_types import DraftVersion
from draft_align.engines.vllm.counters import SpecCounters
from draft_align.engines.vllm.draft_update import BACKEND, UpdateSigner, weight_version
from draft_align.engines.vllm.start import EngineError, collective_rpc, import_vllm
from draft_align.engines.vllm.worker_rpc import RefreshError, rpc_describe, rpc_load_draft
from draft_align.publish.folder import WEIGHTS_FILE
from draft_align.publish.versions import folder_version
from draft_align.wire.keys import resolve_key
from draft_align.wire.messages import DraftPublished

log = logging.getLogger(__name__)

# EAGLE-3 heads, and a model's own MTP layers (publish/native_mtp_format.py; the drafter shares the embedding
# and the lm_head with the target, so a refresh reloads the MTP layers only)
REFRESHABLE_METHODS = ("eagle3", "mtp")


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


class DraftRefresher:
    """Hot draft refresh for a running ``vllm.LLM`` (see the module docstring).

    ``guard``: an optional :class:`ProbeGuard`.  ``serving``: the verified version the engine was started
    with (None: its manifest is read and verified here).  ``run_dir``: the run whose ``drafts/vNNNN`` it loads
    (None: the run of the first version applied); ``key_file``: that run's wire key when it is not
    ``$DRAFT_ALIGN_WIRE_KEY`` or ``<run>/wire.key`` (created there when absent: the sidecar uses the same).  :meth:`apply` returns True when the version serves;
    False when it was refused or rolled back, the reason logged and kept in ``history``.  Call it from the
    thread that drives the LLM (``vllm.LLM`` is not thread-safe): between ``generate`` calls or between
    ``llm.llm_engine.step()`` calls.
    """

    def __init__(
        self,
        llm: Any,
        *,
        guard: ProbeGuard | None = None,
        serving: DraftVersion | None = None,
        run_dir: str | Path | None = None,
        key_file: str | None = None,
    ) -> None:
        self.llm = llm
        self.guard = guard
        self.key_file = key_file
        self.run_dir: Path | None = None
        self._signer: UpdateSigner | None = None
        spec = llm.llm_engine.vllm_config.speculative_config
        if spec is None or spec.method not in REFRESHABLE_METHODS:
            method = getattr(spec, "method", None)
            raise EngineError(
                f"the engine does not run an EAGLE-3 or MTP draft (speculative method {method}): nothing to "
                f"refresh"
            )
        self.k = int(spec.num_speculative_tokens)
        info = collective_rpc(llm, rpc_describe)[0]
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
        self._current_weights: Any = None  # the serving version's verified tensors, when kept (rollback)
        if info.get("loaded"):  # another refresher already swapped drafts in this engine
            self.current = LoadedDraft(**info["loaded"])
        else:
            self._current_weights = serving.weights if serving is not None else None
            start = serving if serving is not None else DraftVersion.read(spec.model)
            self.current = LoadedDraft(start.version, start.policy_version, str(start.path), start.sha256)
        startup = (info.get("backend") or {}).get("startup")  # the draft the engine started with, held
        self.startup_sha256 = (
            startup["sha256"] if startup else (None if info.get("loaded") else self.current.sha256)
        )
        self.api = uses_transfer_backend(llm)  # else the old path (rpc_load_draft)
        if self.api and run_dir is not None:
            self._bind(Path(run_dir))
        log.info(
            "draft refresher: engine serves v%04d (%s) via %s; shared with the target, never written: %s",
            self.current.version,
            self.current.path,
            "vLLM's weight-update API" if self.api else "collective_rpc",
            info.get("shared"),
        )

    # ----------------------------------------------------------------- engine side
    def _bind(self, run_dir: Path) -> None:
        """Bind the engine's backend to ``run_dir`` and sign with that run's key from now on."""
        key = resolve_key(self.key_file, run_dir, create=True)
        init = {"run_dir": str(run_dir.resolve()), "key_file": self.key_file}
        self.llm.init_weight_transfer_engine({"init_info": init})
        self.run_dir, self._signer = run_dir, UpdateSigner(key)

    def _load(self, target: LoadedDraft, tensors: Any = None) -> dict[str, Any]:
        if self.api:
            return self._load_by_api(target)
        weights = str(Path(target.path) / WEIGHTS_FILE)
        record = {
            "version": target.version,
            "policy_version": target.policy_version,
            "path": target.path,
            "sha256": target.sha256,
        }
        results = collective_rpc(self.llm, rpc_load_draft, weights, target.sha256, record, tensors)
        self.llm.reset_prefix_cache()  # cached prompt blocks hold the old draft's K/V
        return results[0]

    def _load_by_api(self, target: LoadedDraft) -> dict[str, Any]:
        """One update through vLLM's RL API; RefreshError (previous version serving) when the backend refuses."""
        path = Path(target.path)
        run = path.parent.parent if folder_version(path) is not None else None
        startup = target.sha256 == self.startup_sha256  # held by the backend whatever the run
        bound = self.run_dir.resolve() if self.run_dir is not None else None
        if self._signer is None or (not startup and run is not None and run.resolve() != bound):
            if run is None:
                raise RefreshError(f"{path} is not a run's drafts/vNNNN folder: no run to bind the engine to")
            try:
                self._bind(run)
            except Exception as e:  # no key, a run folder the backend refuses: the engine was not touched
                raise RefreshError(f"binding the engine to run {run}: {e}") from e
        assert self._signer is not None and self.run_dir is not None
        msg = DraftPublished(
            run_id=self.run_dir.resolve().name,
            draft_version=target.version,
            policy_version=target.policy_version,
            path=str(path),
            sha256=target.sha256,
        )
        start = time.perf_counter()
        self.llm.start_draft_weight_update()
        try:
            self.llm.update_weights({"update_info": self._signer.update_info(msg)})
        except (
            Exception
        ) as e:  # the worker ended the session; the backend kept (or restored) the previous draft
            reason = str(e)
            if "restart" in reason:
                raise EngineError(f"draft refresh: {reason}") from e
            raise RefreshError(reason) from e
        self.llm.finish_weight_update(weight_version(target.version, target.sha256))
        self.llm.reset_prefix_cache()  # cached prompt blocks hold the old draft's K/V
        return {"tensors": -1, "seconds": time.perf_counter() - start}

    def _rollback(self, why: str) -> None:
        """Re-apply the serving version after a failed or collapsed load; EngineError if even that fails."""
        self.rollbacks += 1
        try:
            self._load(self.current, self._current_weights)
        except EngineError:
            raise
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
        vllm = import_vllm()
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
    def apply(self, draft: DraftVersion, *, probe: bool = True) -> bool:
        """Serve the verified version ``draft``; False (previous version serving) when it cannot.

        ``probe=False`` skips the guard (for swapping back to a version that already passed it).
        """
        start = time.perf_counter()
        path, version, manifest = Path(draft.path), draft.version, draft.manifest
        new = LoadedDraft(version, draft.policy_version, str(path), draft.sha256)

        guarded = probe and self.guard is not None
        if guarded:  # the serving version on the same probe and the same target: the policy may have moved
            self._probe_ref = self.probe().mean_acceptance_length()
        try:
            info = self._load(new, draft.weights)
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
                    "rolling back to v%04d",
                    version,
                    probe_l,
                    ref,
                    self.guard.min_ratio,
                    self.current.version,
                )
                self._rollback(f"acceptance collapse {probe_l:.3f} vs {ref:.3f}")
                why = f"acceptance collapse: probe {probe_l:.3f} vs reference {ref:.3f}"
                return self._fail(version, path, why, start)
            self._probe_ref = probe_l
        self.current = new
        self._current_weights = draft.weights
        self.refreshes += 1
        self.last_apply_s = time.perf_counter() - start
        self.history.append(RefreshRecord(version, str(path), True, "applied", self.last_apply_s, probe_l))
        log.info(
            "draft refresh: serving v%04d (policy version %d) after %.2f s (%.2f s in the engine)",
            version,
            new.policy_version,
            self.last_apply_s,
            info["seconds"],
        )
        return True

    def engine_loaded(self) -> list[dict[str, Any] | None]:
        """What each worker's draft module records as last loaded (None: the start-up draft)."""
        return [info.get("loaded") for info in collective_rpc(self.llm, rpc_describe)]

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


def uses_transfer_backend(llm: Any) -> bool:
    """Whether ``llm`` has vLLM's RL weight-update API and was started with the ``draft_align`` backend."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    transfer = getattr(config, "weight_transfer_config", None)
    return getattr(transfer, "backend", None) == BACKEND and hasattr(llm, "start_draft_weight_update")
