"""Peak memory of one draft train step on one long sequence (docs/sizing.md, "Memory of one train step").

    .venv/bin/python benchmarks/train_step_memory.py [--lengths 512 1024 2048] [--steps 7] [--threads 2]
        [--response-frac 0.75] [--max-seq-tokens N] [--device cpu] [--loss soft]

One child process per length (``ru_maxrss`` only ever grows, so a process measures one step): a random-weight
EAGLE-3 draft shaped like SmolLM2-135M's (hidden 576, intermediate 1536, 9 query / 3 KV heads of 64, draft
vocab 16,384, target vocab 49,152, 3 aux layers), no model download; one record of T tokens whose last
``response-frac`` are response tokens; one ``DraftTrainer.train_step`` with TTT K = ``--steps`` (``--loss``: soft by default, any ``train.objective.loss``,
bf16 autocast, the sidecar's defaults; ``--no-autocast``: fp32).  Reported per length: the resident set before the step, the peak
during it (``getrusage`` high-water mark) and their difference, and the step's wall time.  On CUDA the
figure is ``torch.cuda.max_memory_allocated`` growth instead.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    draft_vocab_size=16384,
    target_hidden_size=576,
    aux_layer_ids=(2, 15, 27),
    target_num_layers=30,
    max_position_embeddings=8192,
)


def rss_now() -> int:
    """Current resident set in bytes (Linux /proc)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(
    tokens: int,
    steps: int,
    threads: int,
    response_frac: float,
    cap: int | None,
    device: str,
    autocast: bool,
    loss: str,
    shape: dict | None = None,
) -> dict:
    """One step of a random-weight EAGLE-3 draft of ``shape`` (default :data:`SMOLLM2`; benchmarks/scale.py passes
    the Qwen3-8B draft's) on one record of ``tokens`` tokens, in this process."""
    import torch
    from torch import nn

    from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
    from draft_align.train.objective import LossSettings
    from draft_align.train.records import Record, collate
    from draft_align.train.trainer import DraftTrainer, OptimSettings

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dev = torch.device(device)
    cfg = Eagle3Config(**(SMOLLM2 if shape is None else shape))
    draft = Eagle3Draft(cfg)
    for p in draft.parameters():
        nn.init.normal_(p, std=0.02)
    draft.set_vocab(torch.arange(cfg.draft_vocab_size) * (cfg.vocab_size // cfg.draft_vocab_size))
    draft.to(dev)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size).to(dev)
    rows = (torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size) * 0.05).to(dev)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    mask = torch.arange(tokens) >= int(tokens * (1 - response_frac))
    dtype = torch.bfloat16 if autocast else torch.float32  # as tapped (bf16); fp32 runs need fp32 inputs
    aux = torch.randn(tokens, cfg.fc_in_features, generator=g).to(dtype)
    final = torch.randn(tokens, cfg.target_hidden_size, generator=g).to(dtype)
    batch = collate([Record(ids, mask, aux, final)], steps).to(dev)
    kw = {} if cap is None else {"max_seq_tokens": cap}
    trainer = DraftTrainer(
        draft,
        embed,
        rows,
        OptimSettings(lr=5e-4, warmup_steps=1, total_steps=10),
        LossSettings(ttt_steps=steps, autocast_bf16=autocast, kind=loss),
        **kw,
    )
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    before = rss_now()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    out = trainer.train_step(batch)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res = {
        "loss_kind": loss,
        "tokens": tokens,
        "chain_starts": int(batch.starts_valid.sum()),
        "steps": steps,
        "seconds": secs,
        "rss_before": before,
        "peak_rss": peak,
        "step_bytes": peak - before,
        "loss": out["loss"],
        "setup_peak_above_step": peak_before >= peak,
    }
    if dev.type == "cuda":
        res["step_bytes"] = torch.cuda.max_memory_allocated() - base
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--response-frac", type=float, default=0.75)
    ap.add_argument("--max-seq-tokens", type=int, default=None, help="the trainer's cap (default: its own)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--no-autocast",
        action="store_true",
        help="fp32 throughout (bf16 is emulated, slow, on CPUs without AVX-512 BF16)",
    )
    ap.add_argument(
        "--loss",
        default="soft",
        help="the objective (train.objective.loss: soft | hard | tv | greedy_surrogate | expected_length)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(
            json.dumps(
                child(
                    a.child,
                    a.steps,
                    a.threads,
                    a.response_frac,
                    a.max_seq_tokens,
                    a.device,
                    not a.no_autocast,
                    a.loss,
                )
            )
        )
        return
    rows = []
    print("| T | chain starts | step peak − before (MiB) | peak RSS (MiB) | seconds | loss |")
    print("|---|---|---|---|---|---|")
    for t in a.lengths:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(t),
            "--steps",
            str(a.steps),
            "--threads",
            str(a.threads),
            "--response-frac",
            str(a.response_frac),
            "--device",
            a.device,
            "--loss",
            a.loss,
        ]
        if a.no_autocast:
            cmd.append("--no-autocast")
        if a.max_seq_tokens is not None:
            cmd += ["--max-seq-tokens", str(a.max_seq_tokens)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"T={t}: the measuring child failed:\n{done.stderr[-3000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(r)
        note = " (setup peak higher: bound only)" if r["setup_peak_above_step"] else ""
        print(
            f"| {t} | {r['chain_starts']} | {r['step_bytes'] / 2**20:,.0f}{note} | {r['peak_rss'] / 2**20:,.0f} | "
            f"{r['seconds']:.1f} | {r['loss']:.4f} |",
            flush=True,
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
