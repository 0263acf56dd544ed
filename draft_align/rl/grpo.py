"""A small but real GRPO job: LoRA policy, rule-based reward, rollouts by speculative decoding.

One RL step (``GRPOJob.step``):

a. ``watcher.refresh()``: pick up the sidecar's newest published draft (a file read, never a wait);
b. rollouts: ``prompts_per_step`` prompts × ``group_size`` responses at ``rl.temperature``.  A seeded
   random ``frozen_fraction`` of them uses the frozen warm-start draft, the rest the adapted draft.
   Speculative decoding is lossless, so the RL data has the policy's distribution either way, and both
   drafts' acceptance is measured on real rollouts of the same step.  With an ``engine``
   (:class:`~draft_align.engines.rollouts.VLLMRollouts`) the policy's current weights are synced into vLLM,
   a newly published draft is offered to it (probe guard, rollback), and each draft's rollouts are one
   batched ``generate`` whose acceptance comes from vLLM's counters; without one, each rollout is decoded by
   :class:`SpecDecoder` (batch 1, target = the policy, k = ``rl.spec_k``, ``rl.verify_mode``);
c. rewards r and group-normalised advantages  A = (r − mean_group(r)) / (std_group(r) + 1e-4)
   (std with Bessel's correction);
d. the log-prob pass: one no-grad forward per micro-batch of right-padded prompt ⧺ response rows inside
   ``tap.capturing()``, each handed to ``tap.submit``; these are the "old" log-probs (also with an engine:
   its own log-probs are only compared with them, ``engine_logprob_gap_*``); then ``tap.end_step()``.  ``tap.head_sync`` runs once per policy version, before its first TapBatch;
e. the update: per response token, with ρ = exp(log π(y) − log π_old(y)) at temperature T,
       ℓ = −min(ρ·A, clip(ρ, 1 − ε, 1 + ε)·A)  [+ β·k3,  k3 = exp(log π0 − log π) − (log π0 − log π) − 1]
   averaged over every response token of the step (gradient accumulation over micro-batches), the
   gradient norm clipped, one AdamW step on the LoRA parameters → policy version + 1; the adapter is
   saved under ``run_dir/policy/v{version:04d}``;
f. KL(π ‖ π_initial) on the fixed sequences; the metrics go to ``run_dir/rl/steps.jsonl`` and, as a
   StepReport, to the sink (non-blocking offer).

Files under ``run_dir``: ``policy/v{version:04d}/`` the adapter of each version; ``policy_merged/
v{version:04d}/`` a plain HF folder after each step listed in ``rl.save_merged_at`` (0-based step
indices; the folder holds the version that step produced) and after the last step; ``rl/steps.jsonl``.

The job never blocks on the sidecar: sends are offers, the draft refresh is a file read.  The one
exception is opt-in and at start only: ``run()`` polls ``latest`` for up to ``rl.wait_for_draft_s``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from draft_align import data
from draft_align.engines.vllm_engine import SpecCounters
from draft_align.hf.generate import generate_responses
from draft_align.monitor.acceptance import AcceptanceTally
from draft_align.monitor.specdec import SpecDecoder
from draft_align.rl.drafts import DraftWatcher
from draft_align.rl.policy import Policy, Sequences, adapter_dir, gather_response
from draft_align.rl.rewards import reward_fn
from draft_align.wire.messages import StepReport

if TYPE_CHECKING:
    from draft_align.config import CotrainRecipe
    from draft_align.engines.rollouts import VLLMRollouts
    from draft_align.tap.protocol import PolicyTap, TapSink

log = logging.getLogger(__name__)

ADV_EPS = 1e-4
STEPS_FILE = "steps.jsonl"
MERGED_DIR = "policy_merged"
DRAFT_KINDS = ("adapted", "frozen")


class GRPOError(ValueError):
    """A GRPO job that cannot run as configured."""


# --------------------------------------------------------------------------------------- math
def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [G, N] (G groups of N rollouts, N ≥ 2) → A [G, N] = (r − mean_g) / (std_g + 1e-4)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise GRPOError(f"rewards must be [groups, group_size ≥ 2], got {tuple(rewards.shape)}")
    r = rewards.double()
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + ADV_EPS)).to(rewards.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[token]: logits [N, V], tokens [N] → [N] float32 (T ≤ 0 is read as 1)."""
    t = temperature if temperature > 0 else 1.0
    return F.log_softmax(logits.float() / t, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def clipped_surrogate(
    logp: torch.Tensor,  # [N] current log-probs (with grad)
    old_logp: torch.Tensor,  # [N] log-probs of the rollout policy
    advantages: torch.Tensor,  # [N] per-token advantage
    clip_eps: float,
) -> torch.Tensor:
    """Per-token GRPO/PPO loss [N]: −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) with ρ = exp(logp − old_logp)."""
    ratio = torch.exp(logp - old_logp)
    return -torch.minimum(ratio * advantages, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π ‖ π_ref) on samples of π: exp(d) − d − 1 with d = ref_logp − logp (≥ 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def _clean(v: Any) -> float | None:
    """A JSON / wire metric: a finite float or None."""
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


# --------------------------------------------------------------------------------------- data helpers
def build_prompts(
    tokenizer: Any, conversations: Sequence[data.Conversation], n: int, max_prompt_tokens: int
) -> list[torch.Tensor]:
    """The first ``n`` conversations' prompts (chat template + generation prompt) of ≤ ``max_prompt_tokens``.

    Longer prompts and conversations the template cannot render are skipped.
    """
    if n < 1 or max_prompt_tokens < 1:
        raise GRPOError(f"n ({n}) and max_prompt_tokens ({max_prompt_tokens}) must be ≥ 1")
    out: list[torch.Tensor] = []
    skipped = 0
    for conv in conversations:
        if len(out) >= n:
            break
        try:
            ids = data.encode_prompt(tokenizer, conv)
        except data.DataError:
            skipped += 1
            continue
        if 1 <= ids.numel() <= max_prompt_tokens:
            out.append(ids)
        else:
            skipped += 1
    if skipped:
        log.info("build_prompts: %d prompts kept, %d skipped (too long or unrenderable)", len(out), skipped)
    return out


@torch.no_grad()
def make_kl_sequences(
    policy: Policy,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    eos_ids: set[int],
    seed: int,
    *,
    temperature: float = 0.0,
    pad_id: int | None = None,
    batch_size: int = 16,
) -> Sequences:
    """Fixed teacher-forced sequences for :meth:`Policy.kl_to_initial`: prompt ⧺ continuation of the
    initial policy (adapter disabled, whatever the current version), greedy by default (T = 1 with
    ``temperature=1.0``)."""
    if not prompts:
        raise GRPOError("make_kl_sequences: no prompts")
    pad = pad_id if pad_id is not None else (min(eos_ids) if eos_ids else 0)
    was_training = policy.hf_model.training
    policy.hf_model.eval()
    with policy.initial():
        responses = generate_responses(
            policy.hf_model, list(prompts), max_new_tokens=max_new_tokens, temperature=temperature,
            eos_ids=set(eos_ids), pad_id=pad, batch_size=batch_size, seed=seed,
        )  # fmt: skip
    policy.hf_model.train(was_training)
    pairs = [(p, r) for p, r in zip(prompts, responses, strict=True) if r is not None and r.numel() > 0]
    return Sequences.pack(pairs, pad)


# --------------------------------------------------------------------------------------- the job
@dataclass
class Rollout:
    """One decoded response of a step."""

    prompt_index: int
    prompt: torch.Tensor  # [P]
    response: torch.Tensor  # [R] new tokens (eos included when finished)
    finished: bool  # ended with an eos token
    draft: str  # "adapted" | "frozen"
    tally: AcceptanceTally | None  # per-rollout tally of the reference decoder (None: an engine's rollout)
    reward: float = 0.0
    engine_logprobs: torch.Tensor | None = None  # [R] the engine's log-probs of the sampled tokens
    advantage: float = 0.0


class GRPOJob:
    """The RL loop; its whole state is this object (see the module docstring for one step).

    ``tap`` (a PolicyTap) and ``sink`` (takes StepReports by a non-blocking ``offer``) may be None.
    ``kl_sequences`` come from :func:`make_kl_sequences`, made once from the initial policy.
    """

    def __init__(
        self,
        recipe: CotrainRecipe,
        policy: Policy,
        tokenizer: Any,
        prompts: list[torch.Tensor],
        kl_sequences: Sequences,
        watcher: DraftWatcher,
        tap: PolicyTap | None,
        sink: TapSink | None,
        run_dir: Path,
        eos_ids: set[int],
        *,
        pad_id: int | None = None,
        extra_metrics: Callable[[], dict[str, Any]] | None = None,
        engine: VLLMRollouts | None = None,
    ) -> None:
        rl = recipe.rl
        if not prompts:
            raise GRPOError("no RL prompts")
        if rl.prompts_per_step < 1 or rl.prompts_per_step > len(prompts):
            raise GRPOError(
                f"rl.prompts_per_step={rl.prompts_per_step} must be in 1..{len(prompts)} (prompts)"
            )
        if rl.group_size < 2:
            raise GRPOError(f"rl.group_size={rl.group_size} must be ≥ 2 (GRPO normalises within a group)")
        if not 0.0 <= rl.frozen_fraction <= 1.0:
            raise GRPOError(f"rl.frozen_fraction={rl.frozen_fraction} must be in [0, 1]")
        if rl.max_new_tokens < 1 or rl.micro_batch < 1 or rl.spec_k < 1:
            raise GRPOError("rl.max_new_tokens, rl.micro_batch and rl.spec_k must be ≥ 1")
        if any(p.dim() != 1 or p.numel() < 1 for p in prompts):
            raise GRPOError("every prompt must be a non-empty 1-D tensor of token ids")
        self.recipe = recipe
        self.rl = rl
        self.policy = policy
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.kl_sequences = kl_sequences
        self.watcher = watcher
        self.tap = tap
        self.sink = sink
        self.run_dir = Path(run_dir)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        tok_pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(
            pad_id if pad_id is not None else tok_pad if tok_pad is not None else min(eos_ids, default=0)
        )
        self.reward = reward_fn(rl.reward)
        self.optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=rl.lr, weight_decay=0.0)
        self.step_index = 0
        self.synced_version: int | None = None
        self.head_syncs_refused = 0
        self.last_rollouts: list[Rollout] = []  # the latest step's rollouts (for inspection)
        self.steps_path = self.run_dir / "rl" / STEPS_FILE
        self.extra_metrics = extra_metrics  # e.g. the wire sender's counters, merged into each step's metrics
        self.engine = engine
        self._engine_counts: dict[str, SpecCounters] = {}

    # ----------------------------------------------------------------- loop
    def run(self) -> list[dict[str, float | None]]:
        """``rl.steps`` steps, then the merged policy of the final version; returns each step's metrics."""
        self.wait_for_first_draft()
        out = [self.step() for _ in range(self.rl.steps)]
        self.finish()
        return out

    def finish(self) -> Path:
        """Save the merged policy of the current (final) version; returns its folder."""
        final = self.merged_dir(self.policy.version)
        if not final.exists():
            self.policy.save_merged(final, self.tokenizer)
        return final

    def wait_for_first_draft(self) -> None:
        """At start only: poll ``latest`` for up to ``rl.wait_for_draft_s`` (0 = do not wait)."""
        deadline = time.monotonic() + self.rl.wait_for_draft_s
        while (
            self.watcher.adapted_version == 0 and not self.watcher.refresh() and time.monotonic() < deadline
        ):
            time.sleep(0.2)

    def merged_dir(self, version: int) -> Path:
        return self.run_dir / MERGED_DIR / f"v{int(version):04d}"

    def step(self) -> dict[str, float | None]:
        """One RL step (a–f in the module docstring); returns its metrics."""
        t_start = time.perf_counter()
        s = self.step_index
        refreshed = self.watcher.refresh()
        rollout_version = self.policy.version

        engine_metrics: dict[str, Any] = {}
        if self.engine is not None:
            t0 = time.perf_counter()
            self.engine.sync_policy(self.policy)
            sync_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            if self.watcher.adapted_path is not None:
                self.engine.offer(self.watcher.adapted_path)  # no-op unless new; refused → previous keeps serving
            engine_metrics = {"engine_vllm": 1.0, "policy_sync_s": sync_s, "draft_offer_s": time.perf_counter() - t0}

        t0 = time.perf_counter()
        rollouts = self._rollouts(s) if self.engine is None else self._engine_rollouts(s)
        rollout_s = time.perf_counter() - t0
        self.last_rollouts = rollouts

        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
        adv = group_advantages(rewards.view(self.rl.prompts_per_step, self.rl.group_size)).flatten()
        for r, a in zip(rollouts, adv.tolist(), strict=True):
            r.advantage = a
        seqs = Sequences.pack([(r.prompt, r.response) for r in rollouts], self.pad_id)

        t0 = time.perf_counter()
        old_logp, tap_s, tap_tokens, head_ok = self._logprob_pass(seqs, s, rollout_version)
        logprob_s = time.perf_counter() - t0
        if self.engine is not None:
            from draft_align.engines.rollouts import logprob_gap

            engine_lp = torch.cat([r.engine_logprobs for r in rollouts if r.engine_logprobs is not None])
            engine_metrics.update(logprob_gap(engine_lp, old_logp.cpu()))
            engine_metrics.update(self.engine.metrics())

        t0 = time.perf_counter()
        upd = self._update(seqs, old_logp, adv)
        update_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        if upd["updated"]:
            self.policy.save_adapter(self._adapter_dir(), overwrite=True)
        if s in self.rl.save_merged_at:
            self.policy.save_merged(self.merged_dir(self.policy.version), self.tokenizer, overwrite=True)
        save_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        kl = self.policy.kl_to_initial(self.kl_sequences, self.rl.micro_batch)
        kl_s = time.perf_counter() - t0

        metrics: dict[str, Any] = {
            "step": s,
            "policy_version": self.policy.version,
            "rollout_policy_version": rollout_version,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "finished_frac": sum(r.finished for r in rollouts) / len(rollouts),
            "kl_to_initial": kl,
            **self._acceptance(rollouts),
            "draft_version": self._adapted_version,
            "draft_policy_version": self._adapted_policy_version,
            "staleness": rollout_version - self._adapted_policy_version,
            "draft_refreshed": float(refreshed),
            "draft_failures": self.watcher.failures,
            "rollout_tokens": sum(r.response.numel() for r in rollouts),
            "response_tokens_mean": sum(r.response.numel() for r in rollouts) / len(rollouts),
            **{k: upd[k] for k in ("loss", "grad_norm", "clip_frac", "ratio_mean", "kl_penalty")},
            "rollout_s": rollout_s,
            "logprob_s": logprob_s,
            "tap_s": tap_s,
            "update_s": update_s,
            "save_s": save_s,
            "kl_s": kl_s,
            "step_s": time.perf_counter() - t_start,
            "tap_tokens_accepted": tap_tokens,
            "head_sync_ok": head_ok,
            **engine_metrics,
        }
        if self.tap is not None:
            metrics.update({f"tap_{k}": v for k, v in self.tap.stats().items()})
        if self.extra_metrics is not None:
            metrics.update(self.extra_metrics())
        clean = {k: _clean(v) for k, v in metrics.items()}
        self._record(s, clean)
        self.step_index += 1
        log.info(
            "rl step %d: v%d reward %.3f kl %.4f acc adapted %s frozen %s (draft v%d) %.1fs",
            s, self.policy.version, metrics["reward_mean"], kl, clean["accept_measured_adapted"],
            clean["accept_measured_frozen"], self._adapted_version, metrics["step_s"],
        )  # fmt: skip
        return clean

    @property
    def _adapted_version(self) -> int:
        """The adapted draft the rollouts used: the engine's (it may refuse a version) or the watcher's."""
        return self.engine.adapted_version if self.engine is not None else self.watcher.adapted_version

    @property
    def _adapted_policy_version(self) -> int:
        e = self.engine
        return e.adapted_policy_version if e is not None else self.watcher.adapted_policy_version

    # ----------------------------------------------------------------- b: rollouts
    def _plan(self, step: int) -> tuple[random.Random, list[int], set[int]]:
        """(the step's RNG, its prompt indices, the rollout indices decoded by the frozen draft)."""
        rl = self.rl
        rng = random.Random(f"grpo:{self.recipe.seed}:{step}")
        chosen = rng.sample(range(len(self.prompts)), rl.prompts_per_step)
        n = rl.prompts_per_step * rl.group_size
        return rng, chosen, set(rng.sample(range(n), round(rl.frozen_fraction * n)))

    def _engine_rollouts(self, step: int) -> list[Rollout]:
        """All rollouts through the engine: one batched generate per draft, the serving draft's first."""
        assert self.engine is not None
        rl = self.rl
        rng, chosen, frozen = self._plan(step)
        plan = [(i, pi, "frozen" if i in frozen else "adapted", rng.getrandbits(62))
                for i, pi in enumerate(pi for pi in chosen for _ in range(rl.group_size))]  # fmt: skip
        order = sorted(DRAFT_KINDS, key=lambda kind: kind != self.engine.serving)
        results: dict[int, Any] = {}
        self._engine_counts = {}
        for kind in order:
            mine = [p for p in plan if p[2] == kind]
            if not mine:
                continue
            self.engine.use(kind)
            outs, counts = self.engine.generate(
                [self.prompts[pi] for _, pi, _, _ in mine], [seed for *_, seed in mine],
                temperature=rl.temperature, max_tokens=rl.max_new_tokens, stop_ids=sorted(self.eos_ids),
            )  # fmt: skip
            self._engine_counts[kind] = counts
            results.update({i: o for (i, *_), o in zip(mine, outs, strict=True)})
        out = []
        for i, pi, kind, _ in plan:
            o = results[i]
            text = self.tokenizer.decode(o.tokens.tolist(), skip_special_tokens=True)
            out.append(Rollout(pi, self.prompts[pi].cpu(), o.tokens, o.finished, kind, None,
                               self.reward(text, o.finished), engine_logprobs=o.logprobs))  # fmt: skip
        return out

    def _rollouts(self, step: int) -> list[Rollout]:
        rl = self.rl
        rng, chosen, frozen = self._plan(step)
        decoders = {
            kind: SpecDecoder(self.policy.hf_model, draft, rl.spec_k, rl.verify_mode, rl.temperature)  # type: ignore[arg-type]
            for kind, draft in (("adapted", self.watcher.adapted), ("frozen", self.watcher.frozen))
        }
        dev = self.policy.device
        self.policy.hf_model.eval()
        out: list[Rollout] = []
        for g, pi in enumerate(chosen):
            prompt = self.prompts[pi]
            for j in range(rl.group_size):
                i = g * rl.group_size + j
                kind = "frozen" if i in frozen else "adapted"
                gen = torch.Generator(device=dev).manual_seed(rng.getrandbits(63))
                new, tally = decoders[kind].generate(prompt, rl.max_new_tokens, self.eos_ids, gen)
                new = new.cpu()
                finished = new.numel() > 0 and int(new[-1]) in self.eos_ids
                text = self.tokenizer.decode(new.tolist(), skip_special_tokens=True)
                out.append(Rollout(pi, prompt.cpu(), new, finished, kind, tally, self.reward(text, finished)))
        return out

    def _acceptance(self, rollouts: list[Rollout]) -> dict[str, Any]:
        """Measured acceptance per draft: mean acceptance length and r_i (summed engine-style tallies)."""
        out: dict[str, Any] = {}
        for kind in DRAFT_KINDS:
            mine = [r for r in rollouts if r.draft == kind]
            if self.engine is not None:  # vLLM's counters around this draft's generate
                counts = self._engine_counts.get(kind, SpecCounters())
                length, rates, rounds = counts.mean_acceptance_length(), counts.per_position(), counts.num_drafts
                rates = rates or [math.nan] * self.rl.spec_k
            else:
                total = AcceptanceTally.empty(self.rl.spec_k)
                for r in mine:
                    assert r.tally is not None
                    total.merge(r.tally)
                length, rates, rounds = total.mean_length(), total.per_position(), total.rounds
            out[f"accept_measured_{kind}"] = length
            for i, rate in enumerate(rates):
                out[f"accept_r{i}_{kind}"] = rate
            out[f"accept_rounds_{kind}"] = rounds
            out[f"rollouts_{kind}"] = len(mine)
        return out

    # ----------------------------------------------------------------- d: log-prob pass (+ tap)
    @torch.no_grad()
    def _logprob_pass(
        self, seqs: Sequences, step: int, version: int
    ) -> tuple[torch.Tensor, float, int, bool]:
        """(old log-probs [N] at T, seconds inside the tap, tokens the tap's sink accepted, HeadSync taken)."""
        tap, rl = self.tap, self.rl
        tap_s, tap_tokens, head_ok = 0.0, 0, True
        if tap is not None and self.synced_version != version:
            t0 = time.perf_counter()
            head_ok = bool(tap.head_sync(version, self.watcher.draft_to_target))
            tap_s += time.perf_counter() - t0
            self.synced_version = version
            self.head_syncs_refused += not head_ok
        dev = self.policy.device
        self.policy.hf_model.eval()
        old: list[torch.Tensor] = []
        with tap.capturing() if tap is not None else contextlib.nullcontext():
            for mb in seqs.micro_batches(rl.micro_batch):
                mb = mb.to(dev)
                logits = self.policy.logits(mb.input_ids, mb.attention_mask)  # [B, T, V]
                if tap is not None:
                    t0 = time.perf_counter()
                    tap.submit(
                        input_ids=mb.input_ids, attention_mask=mb.attention_mask, loss_mask=mb.loss_mask,
                        logits=logits, policy_version=version, step=step, temperature=rl.temperature,
                    )  # fmt: skip
                    tap_s += time.perf_counter() - t0
                old.append(token_logprobs(*gather_response(logits, mb), rl.temperature))
                del logits
        if tap is not None:
            t0 = time.perf_counter()
            tap_tokens = int(tap.end_step())
            tap_s += time.perf_counter() - t0
        return torch.cat(old), tap_s, tap_tokens, head_ok

    # ----------------------------------------------------------------- e: update
    def _update(self, seqs: Sequences, old_logp: torch.Tensor, adv: torch.Tensor) -> dict[str, Any]:
        """One optimizer step on the clipped surrogate (token mean over the step) [+ β·k3]."""
        rl = self.rl
        dev = self.policy.device
        n_tok = seqs.num_response_tokens
        counts = seqs.loss_mask.sum(1)  # [B] response tokens per row
        params = self.policy.trainable_parameters()
        self.policy.hf_model.train(rl.lora_dropout > 0)  # dropout only matters when there is some
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = kl_sum = clipped = ratio_sum = 0.0
        offset = 0
        for start in range(0, len(seqs), rl.micro_batch):
            rows = range(start, min(start + rl.micro_batch, len(seqs)))
            mb = seqs.select(rows)
            m = int(counts[start : rows.stop].sum())
            old = old_logp[offset : offset + m].to(dev)
            a_tok = adv[start : rows.stop].repeat_interleave(counts[start : rows.stop]).to(dev, torch.float32)
            offset += m
            logits, tokens = self.policy.response_logits(mb)
            logp = token_logprobs(logits, tokens, rl.temperature)
            per_tok = clipped_surrogate(logp, old, a_tok, rl.clip_eps)
            with torch.no_grad():
                ratio = torch.exp(logp - old)
                clipped += float(((ratio - 1.0).abs() > rl.clip_eps).sum())
                ratio_sum += float(ratio.sum())
                loss_sum += float(per_tok.sum())
            if rl.kl_coef > 0:
                with torch.no_grad(), self.policy.initial():
                    ref = token_logprobs(*self.policy.response_logits(mb), rl.temperature)
                kl_tok = k3_kl(logp, ref)
                kl_sum += float(kl_tok.detach().sum())
                per_tok = per_tok + rl.kl_coef * kl_tok
            (per_tok.sum() / n_tok).backward()
            del logits, logp, per_tok
        self.policy.hf_model.eval()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, rl.grad_clip))
        updated = math.isfinite(grad_norm)
        if updated:
            self.optimizer.step()
            self.policy.version += 1
        else:
            log.warning("rl update skipped: non-finite gradient norm %s", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "updated": updated,
            "loss": loss_sum / n_tok,
            "grad_norm": grad_norm,
            "clip_frac": clipped / n_tok,
            "ratio_mean": ratio_sum / n_tok,
            "kl_penalty": kl_sum / n_tok if rl.kl_coef > 0 else None,
        }

    def _adapter_dir(self) -> Path:
        return adapter_dir(self.run_dir, self.policy.version)

    # ----------------------------------------------------------------- f: record
    def _record(self, step: int, metrics: dict[str, float | None]) -> None:
        self.steps_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.steps_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), **metrics}) + "\n")
            f.flush()
        if self.sink is not None:
            report = StepReport(
                run_id=self.recipe.run, step=step, policy_version=self.policy.version, metrics=dict(metrics)
            )
            if not self.sink.offer(report):
                log.debug("step report %d refused by the sink", step)
