"""A vLLM server as the RL job's rollout engine (``rl.engine.kind: server``): rollouts over HTTP, asynchronous.

:class:`ServerRollouts` implements :class:`draft_align.rl.rollouts.RolloutEngine` against one vLLM server (its
OpenAI ``/v1/completions`` route, token ids in and out, each rollout's own seed), the way server-based RL
frameworks generate:

- **Drafts are not the job's business.** The server serves whatever ``draft-align push`` pushed last
  (docs/servers.md); the step's acceptance is the server's own spec-decode counters (``/metrics``) over the
  step's rollouts, and :attr:`adapted` is the version the server says it serves (``/weight_info``).  One
  server serves one draft at a time, so every rollout is an adapted one (``rl.engine.frozen_fraction: 0``).
- **The policy** reaches the server through the same ``draft_align`` weight-transfer backend: the changed
  decoder layers (LoRA merged) are written once to ``<run>/engine_policy/vNNNN`` and announced by a signed
  ``DraftPublished`` in a target session (``start_weight_update`` → ``update_weights`` →
  ``finish_weight_update``); the server re-hashes and reloads them in place.
- **Asynchronous** (``asynchronous=True``): :meth:`prefetch` starts the next step's rollouts on the policy
  the server holds while the job trains this step; :meth:`rollouts` then returns them, generated one policy
  version behind (``rollout_policy_version`` in the step metrics), as the asynchronous RL frameworks do.  The
  policy is synced only between two generations, never under one.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draft_align.acceptance import AcceptanceTally
from draft_align.conventions import DRAFT_KINDS, DraftKind
from draft_align.engines.rollout_types import Decoding, DraftVersion, Rollout, RolloutPlan
from draft_align.engines.vllm.draft_update import POLICY_DIR, POLICY_KIND, UpdateSigner
from draft_align.engines.vllm.engine_error import EngineError
from draft_align.engines.vllm.server_client import ServerError, VLLMServer
from draft_align.hf.lora_layers import policy_layer_weights
from draft_align.monitor.logprob_gap import logprob_gap
from draft_align.publish.folder import MANIFEST_FILE, WEIGHTS_FILE, digest
from draft_align.publish.versions import version_dir
from draft_align.storage import save_tensors
from draft_align.wire.messages import DraftPublished

log = logging.getLogger(__name__)

SEED_BITS = 31  # the completions API takes a 32-bit signed seed
KEEP_POLICIES = 2  # policy-sync folders kept in <run>/engine_policy


class ServerRollouts:
    """Rollouts by one vLLM server (module docstring).  ``server``: its client; ``model``: the name it serves
    (its ``--model``); ``run_dir`` / ``key``: the run whose drafts it serves and the run's wire key (the policy
    syncs are signed with it); ``dtype``: the tensors a policy sync writes; ``workers``: concurrent requests."""

    def __init__(
        self,
        server: VLLMServer,
        model: str,
        run_dir: Path,
        key: bytes,
        *,
        k: int,
        dtype: torch.dtype = torch.float32,
        asynchronous: bool = True,
        workers: int = 64,
        process: Any = None,
    ) -> None:
        self.server, self.model, self.run_dir = server, model, Path(run_dir)
        self.k, self.dtype, self.asynchronous = int(k), dtype, bool(asynchronous)
        self.process = process  # a ServerProcess this engine started (stopped by shutdown)
        self.signer = UpdateSigner(key)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=int(workers), thread_name_prefix="rollout"
        )
        self.generator = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.policy_model: nn.Module | None = None
        self.policy_version = 0  # the version the job last handed over
        self.server_policy = 0  # the version the server holds (0: the base model it started with)
        self.syncs = 0
        self.sync_s = 0.0
        self._pending: tuple[RolloutPlan, concurrent.futures.Future[Any]] | None = None
        self._adapted: DraftVersion | None = None
        self._adapted_key: tuple[int, str] | None = None
        self.last_timings: dict[str, float] = {}
        server.bind(str(self.run_dir.resolve()))

    # ----------------------------------------------------------------- drafts: the server's
    @property
    def adapted(self) -> DraftVersion | None:
        """The run's version the server served for the last rollouts (None: its start-up draft)."""
        return self._adapted

    def _read_serving(self) -> None:
        said = self.server.serving()
        if said is None or said == self._adapted_key:
            self._adapted_key = said
            if said is None:
                self._adapted = None
            return
        self._adapted_key = said
        try:
            draft = DraftVersion.read(version_dir(self.run_dir, said[0]))
            self._adapted = draft if draft.sha256 == said[1] else None
        except (OSError, ValueError) as e:  # pruned since: the version number is still known
            log.info("server rollouts: v%04d's folder unreadable (%s)", said[0], e)
            self._adapted = None

    # ----------------------------------------------------------------- policy
    def _sync_policy(self) -> float:
        """Serve the job's newest policy on the server (a signed policy sync); the seconds it took."""
        if self.policy_model is None or self.policy_version == self.server_policy or self.policy_version == 0:
            return 0.0
        t0 = time.perf_counter()
        version = self.policy_version
        folder = self.run_dir / POLICY_DIR / f"v{version:04d}"
        tmp = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_tensors(policy_layer_weights(self.policy_model, self.dtype), tmp / WEIGHTS_FILE)
        sha, size = digest(tmp / WEIGHTS_FILE)
        manifest = {
            "kind": POLICY_KIND,
            "policy_version": version,
            "files": {WEIGHTS_FILE: {"sha256": sha, "bytes": size}},
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        msg = DraftPublished(
            run_id=self.run_dir.resolve().name,
            draft_version=version,
            policy_version=version,
            path=str(folder),
            sha256=sha,
        )
        try:
            self.server.push_policy(self.signer.update_info(msg))
        except ServerError as e:
            raise EngineError(f"server rollouts: policy v{version} not served: {e}") from e
        self.server_policy = version
        self.syncs += 1
        for old in sorted((self.run_dir / POLICY_DIR).glob("v[0-9]*"))[:-KEEP_POLICIES]:
            shutil.rmtree(old, ignore_errors=True)
        seconds = time.perf_counter() - t0
        self.sync_s += seconds
        log.info("server rollouts: policy v%d served (%.2f s)", version, seconds)
        return seconds

    # ----------------------------------------------------------------- the RolloutEngine interface
    def prepare(
        self, policy_model: nn.Module, policy_version: int, adapted: DraftVersion | None
    ) -> dict[str, float]:
        """Take the job's policy; synchronous mode syncs it now, asynchronous mode before the next prefetch."""
        self.policy_model, self.policy_version = policy_model, int(policy_version)
        if self.asynchronous and self._pending is not None:
            return {"engine_server": 1.0, "policy_sync_s": 0.0}
        return {"engine_server": 1.0, "policy_sync_s": self._sync_policy()}

    def prefetch(self, plan: RolloutPlan, prompts: Sequence[torch.Tensor], decoding: Decoding) -> None:
        """Start ``plan``'s rollouts now (asynchronous mode; the job trains meanwhile); a no-op otherwise."""
        if not self.asynchronous or self._pending is not None:
            return
        self._sync_policy()  # between two generations: the last one finished, the next not started
        future = self.generator.submit(self._generate, plan, list(prompts), decoding, self.server_policy)
        self._pending = (plan, future)

    def rollouts(
        self, plan: RolloutPlan, prompts: Sequence[torch.Tensor], decoding: Decoding
    ) -> tuple[list[Rollout], dict[DraftKind, AcceptanceTally]]:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == plan:
            rollouts, tallies, timings = pending[1].result()
        else:
            if pending is not None:
                pending[1].result()  # another plan: let it finish, then decode this one
            self._sync_policy()
            rollouts, tallies, timings = self._generate(plan, list(prompts), decoding, self.server_policy)
        self.last_timings = timings
        self._read_serving()
        return rollouts, tallies

    def _generate(
        self, plan: RolloutPlan, prompts: list[torch.Tensor], decoding: Decoding, policy: int
    ) -> tuple[list[Rollout], dict[DraftKind, AcceptanceTally], dict[str, float]]:
        if any(p.draft != "adapted" for p in plan.rollouts):
            raise EngineError("server rollouts: one server serves one draft: use rl.engine.frozen_fraction=0")
        t0 = time.perf_counter()
        before = self.server.counters()
        seeds = plan.seeds(SEED_BITS)
        futures = [
            self.pool.submit(self._complete, prompts[p.prompt_index], seed, decoding)
            for p, seed in zip(plan.rollouts, seeds, strict=True)
        ]
        outs = [f.result() for f in futures]
        counted = self.server.counters() - before
        rollouts = []
        for p, (tokens, logprobs, finished) in zip(plan.rollouts, outs, strict=True):
            rollouts.append(
                Rollout(
                    p.prompt_index,
                    prompts[p.prompt_index].cpu(),
                    tokens,
                    finished,
                    p.draft,
                    None,
                    engine_logprobs=logprobs,
                )
            )
        tallies = {kind: AcceptanceTally.empty(self.k) for kind in DRAFT_KINDS}
        tallies["adapted"] = counted.as_tally(self.k)
        seconds = time.perf_counter() - t0
        timings = {"generate_s_adapted": seconds, "rollout_policy_version": float(policy)}
        return rollouts, tallies, timings

    def _complete(
        self, prompt: torch.Tensor, seed: int, decoding: Decoding
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        stops = sorted(int(t) for t in decoding.eos_ids)
        body = {
            "model": self.model,
            "prompt": [int(t) for t in prompt.tolist()],
            "max_tokens": int(decoding.max_tokens),
            "temperature": float(decoding.temperature),
            "seed": int(seed),
            "stop_token_ids": stops,
            "logprobs": 0,
            "return_token_ids": True,
        }
        try:
            choice = self.server.complete(body)["choices"][0]
        except ServerError as e:
            raise EngineError(f"server rollouts: a request failed: {e}") from e
        ids = [int(t) for t in choice.get("token_ids") or []]
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        lp = [float(x) if x is not None else math.nan for x in lps][: len(ids)]
        lp += [math.nan] * (len(ids) - len(lp))
        finished = bool(ids) and ids[-1] in set(stops)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(lp, dtype=torch.float32), finished

    def step_metrics(self, rollouts: Sequence[Rollout], old_logprobs: torch.Tensor) -> dict[str, float]:
        engine_lp = torch.cat([r.engine_logprobs for r in rollouts if r.engine_logprobs is not None])
        return {**logprob_gap(engine_lp, old_logprobs.cpu()), **self.last_timings, **self.metrics()}

    def metrics(self) -> dict[str, float]:
        serving = self._adapted_key[0] if self._adapted_key is not None else 0
        return {
            "engine_draft_version": float(serving),
            "engine_policy_version": float(self.server_policy),
            "engine_policy_syncs": float(self.syncs),
        }

    def shutdown(self) -> None:
        """Finish a generation in flight, stop the pools (and the server this engine started); idempotent."""
        if self._pending is not None:
            try:
                self._pending[1].result()
            except Exception:  # noqa: BLE001  (shutting down: the job is over)
                pass
            self._pending = None
        self.generator.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        if self.process is not None:
            self.process.stop()


__all__ = ["SEED_BITS", "ServerRollouts"]
