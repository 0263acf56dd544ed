"""A small but real GRPO job: LoRA policy, rule-based reward, rollouts by speculative decoding.

One RL step (``GRPOJob.step``), never blocking on the sidecar (docs/architecture.md):

a. ``drafts.poll()``: take the sidecar's newest published draft that the source's verifier thread already
   hashed, loaded and checked (no wait, no hashing on this thread);
b. rollouts from the :class:`~draft_align.rl.rollouts.RolloutEngine` (the reference decoder or vLLM, which
   first syncs the policy and is offered the new draft): frozen and adapted drafts on one seeded plan;
   ``drafts.judge`` then checks a newly served draft on this step's counters (the silent-zero guard: a
   collapsed one is rolled back at the next step's ``poll``/``prepare``);
c. rewards and group-normalised advantages (:mod:`draft_align.rl.loss`);
d. the log-prob pass inside ``tap.capturing()``: one no-grad forward per micro-batch, handed to
   ``tap.submit``; these are the "old" log-probs (an engine's own are only compared with them); then
   ``tap.end_step()``.  ``tap.head_sync`` runs once per policy version, before its first TapBatch;
e. one AdamW step on the clipped surrogate [+ β·k3] → policy version + 1, adapter saved under
   ``run_dir/policy/v{version:04d}``;
f. KL(π ‖ π_initial) on fixed sequences; the metrics, with the step's stage profile
   (:class:`~draft_align.monitor.step_profile.StepProfile`), go to ``run_dir/rl/steps.jsonl`` and, as a
   StepReport, to the sink (non-blocking offer).

``policy_merged/v{version:04d}/`` holds a plain HF folder after each step listed in ``rl.policy.save_merged_at``
(0-based step indices) and after the last step.  The one wait is opt-in and at start only: ``run()`` polls
for a first draft for up to ``rl.wait_for_draft_s``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from draft_align.acceptance import AcceptanceTally
from draft_align.conventions import DRAFT_KINDS, DraftKind
from draft_align.data.tasks import score
from draft_align.engines.rollout_types import Decoding, Rollout
from draft_align.monitor.step_profile import StepProfile
from draft_align.rl.drafts import DraftSource
from draft_align.rl.loss import GRPOError, clipped_surrogate, group_advantages, k3_kl, token_logprobs
from draft_align.rl.policy import Policy, Sequences, adapter_dir, gather_response
from draft_align.rl.rewards import TASK_REWARDS, reward_fn, safe_reward
from draft_align.rl.rollouts import ReferenceRollouts, RolloutEngine, plan_rollouts
from draft_align.wire.messages import StepReport

if TYPE_CHECKING:
    from draft_align.config import RLConfig
    from draft_align.tap.protocol import PolicyTap, TapSink

log = logging.getLogger(__name__)

STEPS_FILE = "steps.jsonl"
MERGED_DIR = "policy_merged"


def _clean(v: Any) -> float | None:
    """A JSON / wire metric: a finite float or None."""
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _rounded(v: float | None, digits: int = 3) -> str:
    """A log line's number: ``digits`` decimals, ``-`` when there is none (no rollouts of that draft)."""
    return "-" if v is None else f"{v:.{digits}f}"


class GRPOJob:
    """The RL loop; its whole state is this object (see the module docstring for one step).

    ``tap`` (a PolicyTap) and ``sink`` (takes StepReports by a non-blocking ``offer``) may be None.
    ``kl_sequences`` come from :func:`~draft_align.rl.prompts.make_kl_sequences`, made once from the initial
    policy.  ``rl``: the recipe's ``rl`` section; ``seed`` (the recipe's) seeds the rollout plans; ``run_id``
    names the run in the step reports.  ``drafts``: the verified frozen and adapted drafts; ``engine``: what
    decodes the rollouts (default: :class:`~draft_align.rl.rollouts.ReferenceRollouts` on ``drafts``).
    """

    def __init__(
        self,
        rl: RLConfig,
        policy: Policy,
        tokenizer: Any,
        prompts: list[torch.Tensor],
        kl_sequences: Sequences,
        drafts: DraftSource,
        tap: PolicyTap | None,
        sink: TapSink | None,
        run_dir: Path,
        eos_ids: set[int],
        *,
        seed: int,
        run_id: str,
        pad_id: int | None = None,
        extra_metrics: Callable[[], dict[str, Any]] | None = None,
        engine: RolloutEngine | None = None,
        answers: list[int] | None = None,
    ) -> None:
        task, engine_cfg = rl.task, rl.engine
        if not prompts:
            raise GRPOError("no RL prompts")
        if answers is not None and len(answers) != len(prompts):
            raise GRPOError(f"{len(answers)} answers for {len(prompts)} prompts")
        if task.reward in TASK_REWARDS and answers is None:
            raise GRPOError(
                f"rl.task.reward={task.reward} checks answers: data.source must be a task (task:NAME)"
            )
        if task.prompts_per_step < 1 or task.prompts_per_step > len(prompts):
            raise GRPOError(
                f"rl.task.prompts_per_step={task.prompts_per_step} must be in 1..{len(prompts)} (prompts)"
            )
        if task.group_size < 2:
            raise GRPOError(
                f"rl.task.group_size={task.group_size} must be ≥ 2 (GRPO normalises within a group)"
            )
        if not 0.0 <= engine_cfg.frozen_fraction <= 1.0:
            raise GRPOError(f"rl.engine.frozen_fraction={engine_cfg.frozen_fraction} must be in [0, 1]")
        if task.max_new_tokens < 1 or rl.policy.micro_batch < 1 or engine_cfg.spec_k < 1:
            raise GRPOError("rl.task.max_new_tokens, rl.policy.micro_batch and rl.engine.spec_k must be ≥ 1")
        if any(p.dim() != 1 or p.numel() < 1 for p in prompts):
            raise GRPOError("every prompt must be a non-empty 1-D tensor of token ids")
        self.rl, self.task = rl, task
        self.seed, self.run_id = seed, run_id
        self.policy = policy
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.kl_sequences = kl_sequences
        self.drafts = drafts
        self.tap = tap
        self.sink = sink
        self.run_dir = Path(run_dir)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        tok_pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(
            pad_id if pad_id is not None else tok_pad if tok_pad is not None else min(eos_ids, default=0)
        )
        self.reward = reward_fn(task.reward)
        self.answers = answers  # the checked answer of each prompt (task rewards), None for chat prompts
        self.reward_errors = 0  # completions whose reward raised or was not finite (rewarded 0, counted)
        self._reward_metrics: dict[str, Any] = {}
        self.optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=rl.policy.lr, weight_decay=0.0)
        self.step_index = 0
        # when each policy version was created (its update) and tapped (its log-prob pass), for the lag from
        # there to the first step served by a draft trained on it
        self._created: dict[int, float] = {policy.version: time.time()}
        self._tapped: dict[int, float] = {}
        self._served_policy_version = -1
        self.synced_version: int | None = None
        self.head_syncs_refused = 0
        self.last_rollouts: list[Rollout] = []  # the latest step's rollouts (for inspection)
        self.last_reward_s = 0.0  # seconds the latest rollouts' rewards took (the data stage)
        self.steps_path = self.run_dir / "rl" / STEPS_FILE
        self.extra_metrics = extra_metrics  # e.g. the wire sender's counters, merged into each step's metrics
        self.engine: RolloutEngine = (
            engine
            if engine is not None
            else ReferenceRollouts(
                policy.hf_model,
                drafts,
                engine_cfg.spec_k,
                engine_cfg.verify_mode,  # type: ignore[arg-type]
            )
        )

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
        """At start only: poll for a first published draft for up to ``rl.wait_for_draft_s`` (0 = do not wait)."""
        deadline = time.monotonic() + self.rl.wait_for_draft_s
        while self.drafts.adapted_version is None and not self.drafts.poll() and time.monotonic() < deadline:
            time.sleep(0.2)

    def merged_dir(self, version: int) -> Path:
        return self.run_dir / MERGED_DIR / f"v{int(version):04d}"

    def step(self) -> dict[str, float | None]:
        """One RL step (a–f in the module docstring); returns its metrics."""
        t_start = time.perf_counter()
        s = self.step_index
        refreshed = self.drafts.poll()
        poll_s = time.perf_counter() - t_start
        rollout_version = self.policy.version
        engine_metrics = self.engine.prepare(
            self.policy.hf_model, rollout_version, self.drafts.adapted_version
        )
        served_at = time.time()

        t0 = time.perf_counter()
        rollouts, tallies = self.rollouts(s)
        rollout_s = time.perf_counter() - t0
        self.last_rollouts = rollouts
        served = self.engine.adapted  # the adapted draft these rollouts were decoded with
        t0 = time.perf_counter()
        rolled_back = self.drafts.judge(served, tallies)
        judge_s = time.perf_counter() - t0
        served_version = served.version if served is not None else 0
        served_policy_version = served.policy_version if served is not None else 0
        lags = self._serve_lags(served_policy_version if served is not None else None, served_at)

        t0 = time.perf_counter()
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
        adv = group_advantages(rewards.view(self.task.prompts_per_step, self.task.group_size)).flatten()
        for r, a in zip(rollouts, adv.tolist(), strict=True):
            r.advantage = a
        seqs = Sequences.pack([(r.prompt, r.response) for r in rollouts], self.pad_id)
        data_s = self.last_reward_s + time.perf_counter() - t0

        t0 = time.perf_counter()
        old_logp, tap_s, tap_tokens, head_ok = self._logprob_pass(seqs, s, rollout_version)
        logprob_s = time.perf_counter() - t0
        self._tapped.setdefault(rollout_version, time.time())
        engine_metrics.update(self.engine.step_metrics(rollouts, old_logp))

        t0 = time.perf_counter()
        upd = self._update(seqs, old_logp, adv)
        update_s = time.perf_counter() - t0
        if upd["updated"]:
            self._created[self.policy.version] = time.time()

        save_s = self._save(s, updated=bool(upd["updated"]))

        t0 = time.perf_counter()
        kl = self.policy.kl_to_initial(self.kl_sequences, self.rl.policy.micro_batch)
        kl_s = time.perf_counter() - t0

        metrics: dict[str, Any] = {
            "step": s,
            "policy_version": self.policy.version,
            "rollout_policy_version": rollout_version,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "finished_frac": sum(r.finished for r in rollouts) / len(rollouts),
            **self._reward_metrics,
            "kl_to_initial": kl,
            **self._acceptance(rollouts, tallies),
            "draft_version": served_version,
            "draft_policy_version": served_policy_version,
            "staleness": rollout_version - served_policy_version,
            **lags,
            "draft_refreshed": float(refreshed),
            "draft_failures": self.drafts.failures,
            "draft_rolled_back": float(rolled_back),
            "draft_rollbacks": self.drafts.rollbacks,
            "draft_verify_s": self.drafts.verify_s,  # the latest verification, on the verifier thread
            "rollout_tokens": sum(r.response.numel() for r in rollouts),
            "response_tokens_mean": sum(r.response.numel() for r in rollouts) / len(rollouts),
            **{k: upd[k] for k in ("loss", "grad_norm", "clip_frac", "ratio_mean", "kl_penalty")},
            "draft_poll_s": poll_s,
            "rollout_s": rollout_s,
            "logprob_s": logprob_s,
            "tap_s": tap_s,
            "update_s": update_s,
            "save_s": save_s,
            "kl_s": kl_s,
            "draft_judge_s": judge_s,
            "tap_tokens_accepted": tap_tokens,
            "head_sync_ok": head_ok,
            **engine_metrics,
        }
        return self._finish(s, metrics, t_start, rollout_s, data_s)

    def _save(self, s: int, *, updated: bool) -> float:
        """The policy's adapter after an update, and its merged HF model at ``rl.policy.save_merged_at``
        steps; returns the seconds it took."""
        t0 = time.perf_counter()
        if updated:
            self.policy.save_adapter(self._adapter_dir(), overwrite=True)
        if s in self.rl.policy.save_merged_at:
            self.policy.save_merged(self.merged_dir(self.policy.version), self.tokenizer, overwrite=True)
        return time.perf_counter() - t0

    def _finish(
        self, s: int, metrics: dict[str, Any], t_start: float, rollout_s: float, data_s: float
    ) -> dict[str, float | None]:
        """Step ``s``'s metrics completed (the Tap's counters, the caller's extra metrics, the step's time and
        stage profile), cleaned, recorded and logged in one line."""
        if self.tap is not None:
            metrics.update({f"tap_{k}": v for k, v in self.tap.stats().items()})
        if self.extra_metrics is not None:
            metrics.update(self.extra_metrics())
        metrics["step_s"] = time.perf_counter() - t_start
        metrics.update(self._profile(metrics, rollout_s, data_s).to_metrics())
        clean = {k: _clean(v) for k, v in metrics.items()}
        self._record(s, clean)
        self.step_index += 1
        log.info(
            "rl step %d: v%d reward %.3f kl %.4f acc adapted %s frozen %s (draft v%d) %.1fs",
            s,
            self.policy.version,
            metrics["reward_mean"],
            metrics["kl_to_initial"],
            _rounded(clean["accept_measured_adapted"]),
            _rounded(clean["accept_measured_frozen"]),
            metrics["draft_version"],
            metrics["step_s"],
        )
        return clean

    def _profile(self, m: dict[str, Any], rollout_s: float, data_s: float) -> StepProfile:
        """The step's stage profile from its timers (docs/advise.md): generation is the engine's rollout time
        without its draft swaps and verify-mode measurement; rewards belong to the data stage."""
        swap = float(m.get("draft_swap_s") or 0.0)
        choice = float(m.get("verify_choice_s") or 0.0)
        return StepProfile(
            float(m["step_s"]),
            {
                "data": data_s,
                "weight_sync": float(m.get("policy_sync_s") or 0.0),
                "generation": max(rollout_s - self.last_reward_s - swap - choice, 0.0),
                "logprob": max(m["logprob_s"] - m["tap_s"], 0.0) + m["kl_s"],
                "train": m["update_s"],
                "draft_refresh": m["draft_poll_s"]
                + float(m.get("draft_offer_s") or 0.0)
                + swap
                + choice
                + m["draft_judge_s"],
                "tap": m["tap_s"],
                "checkpoint": m["save_s"],
            },
        )

    # ----------------------------------------------------------------- b: rollouts
    def rollouts(self, step: int) -> tuple[list[Rollout], dict[DraftKind, AcceptanceTally]]:
        """Step ``step``'s rollouts from the engine, rewarded, and each draft's measured acceptance (the
        engine's state is used as it is: :meth:`step` prepares it first)."""
        task, frozen = self.task, self.rl.engine.frozen_fraction
        plan = plan_rollouts(
            self.seed, step, len(self.prompts), task.prompts_per_step, task.group_size, frozen
        )
        decoding = Decoding(task.temperature, task.max_new_tokens, self.eos_ids)
        rollouts, tallies = self.engine.rollouts(plan, self.prompts, decoding)
        if step + 1 < self.rl.steps:  # an asynchronous engine decodes the next step while this one trains
            nxt = plan_rollouts(
                self.seed, step + 1, len(self.prompts), task.prompts_per_step, task.group_size, frozen
            )
            self.engine.prefetch(nxt, self.prompts, decoding)
        t0 = time.perf_counter()
        correct = 0
        for i, r in enumerate(rollouts):
            text = self.tokenizer.decode(r.response.tolist(), skip_special_tokens=True)
            answer = self.answers[r.prompt_index] if self.answers is not None else None
            r.reward, error = safe_reward(self.reward, text, r.finished, answer)
            if error is not None:
                self.reward_errors += 1
                log.warning("step %d: reward of rollout %d refused (%s); it gets 0", step, i, error)
            elif answer is not None:
                correct += score(answer, text, r.finished).correct
        self._reward_metrics = {"reward_errors": self.reward_errors}
        if self.answers is not None:
            self._reward_metrics["correct_frac"] = correct / len(rollouts)
        self.last_reward_s = time.perf_counter() - t0
        return rollouts, tallies

    def _acceptance(
        self, rollouts: list[Rollout], tallies: dict[DraftKind, AcceptanceTally]
    ) -> dict[str, Any]:
        """Measured acceptance per draft: mean acceptance length, r_i and rounds (engine-style tallies)."""
        out: dict[str, Any] = {}
        for kind in DRAFT_KINDS:
            tally = tallies[kind]
            out[f"accept_measured_{kind}"] = tally.mean_length()
            for i, rate in enumerate(tally.per_position()):
                out[f"accept_r{i}_{kind}"] = rate
            out[f"accept_rounds_{kind}"] = tally.rounds
            out[f"rollouts_{kind}"] = sum(r.draft == kind for r in rollouts)
        return out

    def _serve_lags(self, policy_version: int | None, served_at: float) -> dict[str, float | None]:
        """The first step served by a draft trained up to policy version v (newer than any served before):
        seconds from v's update (``draft_serve_lag_s``) and from v's taps (``draft_tap_to_serve_s``) to the
        draft being in place; None on the other steps."""
        out: dict[str, float | None] = {"draft_serve_lag_s": None, "draft_tap_to_serve_s": None}
        if policy_version is None or policy_version <= self._served_policy_version:
            return out
        self._served_policy_version = policy_version
        created, tapped = self._created.get(policy_version), self._tapped.get(policy_version)
        for times in (self._created, self._tapped):  # versions up to this one are never asked for again
            for v in [v for v in times if v <= policy_version]:
                del times[v]
        out["draft_serve_lag_s"] = served_at - created if created is not None else None
        out["draft_tap_to_serve_s"] = served_at - tapped if tapped is not None else None
        return out

    # ----------------------------------------------------------------- d: log-prob pass (+ tap)
    @torch.no_grad()
    def _logprob_pass(
        self, seqs: Sequences, step: int, version: int
    ) -> tuple[torch.Tensor, float, int, bool]:
        """(old log-probs [N] at T, seconds inside the tap, tokens the tap's sink accepted, HeadSync taken)."""
        tap, temperature = self.tap, self.task.temperature
        tap_s, tap_tokens, head_ok = 0.0, 0, True
        if tap is not None and self.synced_version != version:
            t0 = time.perf_counter()
            head_ok = bool(tap.head_sync(version, self.drafts.draft_to_target))
            tap_s += time.perf_counter() - t0
            self.synced_version = version
            self.head_syncs_refused += not head_ok
        dev = self.policy.device
        self.policy.hf_model.eval()
        old: list[torch.Tensor] = []
        with tap.capturing() if tap is not None else contextlib.nullcontext():
            for mb in seqs.micro_batches(self.rl.policy.micro_batch):
                mb = mb.to(dev)
                logits = self.policy.logits(mb.input_ids, mb.attention_mask)  # [B, T, V]
                if tap is not None:
                    t0 = time.perf_counter()
                    tap.submit(
                        input_ids=mb.input_ids,
                        attention_mask=mb.attention_mask,
                        loss_mask=mb.loss_mask,
                        logits=logits,
                        policy_version=version,
                        step=step,
                        temperature=temperature,
                    )
                    tap_s += time.perf_counter() - t0
                old.append(token_logprobs(*gather_response(logits, mb), temperature))
                del logits
        if tap is not None:
            t0 = time.perf_counter()
            tap_tokens = int(tap.end_step())
            tap_s += time.perf_counter() - t0
        return torch.cat(old), tap_s, tap_tokens, head_ok

    # ----------------------------------------------------------------- e: update
    def _update(self, seqs: Sequences, old_logp: torch.Tensor, adv: torch.Tensor) -> dict[str, Any]:
        """One optimizer step on the clipped surrogate (token mean over the step) [+ β·k3]."""
        pc, temperature = self.rl.policy, self.task.temperature
        dev = self.policy.device
        n_tok = seqs.num_response_tokens
        counts = seqs.loss_mask.sum(1)  # [B] response tokens per row
        params = self.policy.trainable_parameters()
        self.policy.hf_model.train(pc.lora.dropout > 0)  # dropout only matters when there is some
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = kl_sum = clipped = ratio_sum = 0.0
        offset = 0
        for start in range(0, len(seqs), pc.micro_batch):
            rows = range(start, min(start + pc.micro_batch, len(seqs)))
            mb = seqs.select(rows)
            m = int(counts[start : rows.stop].sum())
            old = old_logp[offset : offset + m].to(dev)
            a_tok = adv[start : rows.stop].repeat_interleave(counts[start : rows.stop]).to(dev, torch.float32)
            offset += m
            logits, tokens = self.policy.response_logits(mb)
            logp = token_logprobs(logits, tokens, temperature)
            per_tok = clipped_surrogate(logp, old, a_tok, pc.clip_eps)
            with torch.no_grad():
                ratio = torch.exp(logp - old)
                clipped += float(((ratio - 1.0).abs() > pc.clip_eps).sum())
                ratio_sum += float(ratio.sum())
                loss_sum += float(per_tok.sum())
            if pc.kl_coef > 0:
                with torch.no_grad(), self.policy.initial():
                    ref = token_logprobs(*self.policy.response_logits(mb), temperature)
                kl_tok = k3_kl(logp, ref)
                kl_sum += float(kl_tok.detach().sum())
                per_tok = per_tok + pc.kl_coef * kl_tok
            (per_tok.sum() / n_tok).backward()
            del logits, logp, per_tok
        self.policy.hf_model.eval()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, pc.grad_clip))
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
            "kl_penalty": kl_sum / n_tok if pc.kl_coef > 0 else None,
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
                run_id=self.run_id, step=step, policy_version=self.policy.version, metrics=dict(metrics)
            )
            if not self.sink.offer(report):
                log.debug("step report %d refused by the sink", step)
