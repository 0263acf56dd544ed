"""Where one draft train step's time goes (the roofline question): torch.profiler over warm steps of the
warm-start's own step shape, the operators grouped into matmul / softmax & log-sum-exp / attention /
elementwise & casts / optimizer / other, beside the step's matmul FLOPs as a fraction of this CPU's measured bf16
matmul rate.

    .venv/bin/python benchmarks/train_step_profile.py [--batch-tokens 1536] [--seq-len 512] [--steps 7]
        [--reps 6] [--threads 2] [--loss soft] [--no-autocast]

A random-weight EAGLE-3 draft shaped like SmolLM2-135M's (benchmarks/train_step_memory.SMOLLM2, no download);
``batch-tokens / seq-len`` records of ``seq-len`` tokens, the last 75% of each a response (the warm-start's
data is ~70% response positions); ``DraftTrainer.train_step`` with TTT K = ``--steps`` and the recipe defaults
(bf16 autocast where the CPU computes bf16 natively).  Two warm-up steps, then ``--reps`` timed steps (median)
of which the last is profiled.  Writes ``benchmarks/out/train_step_profile.json`` and its section in
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common.results_md import replace_section  # noqa: E402

HEAD = "## Train-step profile (benchmarks/train_step_profile.py)"
# operator name → group; the first matching prefix wins (aten names, as torch.profiler reports them)
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "matmul",
        (
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::matmul",
            "aten::linear",
            "aten::baddbmm",
            "aten::_mkl",
            "mkldnn",
            "aten::mkldnn",
        ),
    ),
    (
        "attention",
        ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_flash", "aten::_efficient"),
    ),
    (
        "softmax / log-sum-exp",
        (
            "aten::logsumexp",
            "aten::_log_softmax",
            "aten::_softmax",
            "aten::softmax",
            "aten::log_softmax",
            "aten::exp",
            "aten::max",
            "aten::amax",
        ),
    ),
    ("optimizer", ("Optimizer.", "aten::_foreach", "aten::_fused_adam")),
    (
        "copies & casts",
        (
            "aten::copy_",
            "aten::to",
            "aten::_to_copy",
            "aten::clone",
            "aten::contiguous",
            "aten::cat",
            "aten::stack",
            "aten::index",
            "aten::gather",
            "aten::scatter",
            "aten::index_select",
            "aten::embedding",
        ),
    ),
    (
        "elementwise",
        (
            "aten::mul",
            "aten::add",
            "aten::sub",
            "aten::div",
            "aten::rsqrt",
            "aten::pow",
            "aten::neg",
            "aten::silu",
            "aten::sigmoid",
            "aten::where",
            "aten::sum",
            "aten::mean",
            "aten::fill_",
            "aten::zero_",
            "aten::zeros",
            "aten::sqrt",
            "aten::clamp",
            "aten::ne",
            "aten::eq",
            "aten::lt",
            "aten::ge",
            "aten::masked_fill",
            "aten::threshold",
        ),
    ),
)


def group_of(name: str) -> str:
    """The group of one profiler event name (backward nodes are named after the forward op they differentiate:
    ``MmBackward0`` counts under the op it calls, so only aten names are grouped)."""
    for group, prefixes in GROUPS:
        if name.startswith(prefixes):
            return group
    return "other"


def build(
    batch_tokens: int, seq_len: int, steps: int, autocast: bool | None, loss: str, fused: bool
) -> tuple[Any, Any, Any]:
    """The trainer (soft CE fused or in checkpointed blocks: ``train.objective.fused_soft_ce``), one collated batch and
    the draft's config."""
    from torch import nn

    from benchmarks.train_step_memory import SMOLLM2
    from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
    from draft_align.train.objective import LossSettings
    from draft_align.train.precision import resolve_autocast
    from draft_align.train.records import Record, collate
    from draft_align.train.trainer import DraftTrainer, OptimSettings

    torch.manual_seed(0)
    cfg = Eagle3Config(**SMOLLM2)
    draft = Eagle3Draft(cfg)
    for p in draft.parameters():
        nn.init.normal_(p, std=0.02)
    draft.set_vocab(torch.arange(cfg.draft_vocab_size) * 3)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    rows = torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size) * 0.05
    bf16 = resolve_autocast(autocast, torch.device("cpu"))
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(1)
    recs = []
    for _ in range(max(1, batch_tokens // seq_len)):
        ids = torch.randint(0, cfg.vocab_size, (seq_len,), generator=g)
        mask = torch.arange(seq_len) >= seq_len // 4
        recs.append(
            Record(
                ids,
                mask,
                torch.randn(seq_len, cfg.fc_in_features, generator=g).to(dtype),
                torch.randn(seq_len, cfg.target_hidden_size, generator=g).to(dtype),
            )
        )
    batch = collate(recs, steps)
    trainer = DraftTrainer(
        draft,
        embed,
        rows,
        OptimSettings(lr=1e-4, warmup_steps=1, total_steps=1000),
        LossSettings(ttt_steps=steps, autocast_bf16=autocast, kind=loss, fused_soft_ce=fused),
    )
    return trainer, batch, cfg


VARIANTS = ("checkpointed", "fused")  # LossSettings.fused_soft_ce off / on


def profile_groups(prof: Any) -> tuple[dict[str, float], list[tuple[str, int, float]]]:
    """Self CPU ms per operator group, and every operator (name, calls, ms), largest first."""
    groups: dict[str, float] = {}
    ops = []
    for ev in prof.key_averages():
        ms = ev.self_cpu_time_total / 1e3
        if ms > 0:
            groups[group_of(ev.key)] = groups.get(group_of(ev.key), 0.0) + ms
            ops.append((ev.key, ev.count, ms))
    ops.sort(key=lambda o: -o[2])
    return groups, ops


def render(r: dict[str, Any]) -> str:
    v = r["variants"]
    lines = [
        HEAD,
        "",
        f"Command: `{r['command']}` (one run; {r['date']}; 2-core CPU).",
        "",
        f"{r['records']} records × {r['seq_len']} tokens ({r['targets']} chain starts), TTT K = {r['ttt_steps']}, "
        f"loss `{r['loss']}`, bf16 autocast {r['autocast_bf16']}, {r['threads']} threads; matmul FLOPs per step "
        f"(benchmarks/warmstart.train_step_flops) {r['step_gflop']:.1f} GFLOP; measured bf16 matmul rate "
        f"{r['roofline_bf16']:.0f} GFLOP/s (fp32 {r['roofline_fp32']:.0f}). The soft-CE head two ways, steps "
        "alternated in one process: `checkpointed` (autograd through row blocks of logits, each recomputed in "
        "backward) and `fused` (train/fused_lse.py: one pass per block, gradient formed in the forward pass).",
        "",
        "| variant | step s (median) | positions/s | GFLOP/s | of bf16 roofline | matmul ms | other ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in VARIANTS:
        x = v[name]
        mm = x["groups_ms"].get("matmul", 0.0)
        lines.append(
            f"| {name} | {x['step_s_median']:.3f} | {x['targets_per_s']:.0f} | {x['gflops']:.0f} | "
            f"**{x['roofline_fraction']:.2f}** | {mm:.0f} | {sum(x['groups_ms'].values()) - mm:.0f} |"
        )
    lines += [
        "",
        f"fused / checkpointed step time: **{r['fused_over_checkpointed']:.3f}×** (median of "
        f"{r['reps']} alternated steps each; matmul and other: self CPU ms of one profiled step).",
        "",
        "Self CPU ms of one profiled step by operator group:",
        "",
        "| group | " + " | ".join(VARIANTS) + " |",
        "|---|" + "---:|" * len(VARIANTS),
    ]
    for g in sorted(v["fused"]["groups_ms"], key=lambda k: -v["checkpointed"]["groups_ms"].get(k, 0.0)):
        lines.append(
            f"| {g} | " + " | ".join(f"{v[n]['groups_ms'].get(g, 0.0):.0f}" for n in VARIANTS) + " |"
        )
    lines += [
        "",
        "Top operators of the fused step (self CPU ms):",
        "",
        "| operator | calls | ms |",
        "|---|---:|---:|",
    ]
    for name, calls, ms in v["fused"]["top_ops"]:
        lines.append(f"| `{name}` | {calls} | {ms:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-tokens", type=int, default=1536)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--loss", default="soft")
    ap.add_argument("--no-autocast", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out")
    ap.add_argument("--no-results-md", action="store_true")
    a = ap.parse_args()
    from benchmarks.warmstart import matmul_roofline, train_step_flops

    torch.set_num_threads(a.threads)
    built = {
        name: build(
            a.batch_tokens, a.seq_len, a.steps, False if a.no_autocast else None, a.loss, name == "fused"
        )
        for name in VARIANTS
    }
    trainer, batch, cfg = built["fused"]
    targets = int(batch.starts_valid.sum())  # chain starts: what the trainer counts as positions trained
    flops = train_step_flops(cfg, targets, int(batch.valid.sum()), a.steps)

    def step(name: str) -> float:
        tr, b, _ = built[name]
        t = time.perf_counter()
        tr.train_step(b)
        return time.perf_counter() - t

    for _ in range(2):
        for name in VARIANTS:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(a.reps):
        for name in VARIANTS:
            times[name].append(step(name))
    roof16, roof32 = matmul_roofline(torch.bfloat16), matmul_roofline(torch.float32)
    variants: dict[str, Any] = {}
    for name in VARIANTS:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(name)
        groups, ops = profile_groups(prof)
        med = statistics.median(times[name])
        variants[name] = {
            "step_s": times[name],
            "step_s_median": med,
            "targets_per_s": targets / med,
            "gflops": flops / med / 1e9,
            "roofline_fraction": flops / med / 1e9 / roof16,
            "groups_ms": groups,
            "top_ops": ops[:15],
        }
    r = {
        "command": " ".join(["python benchmarks/train_step_profile.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "records": batch.input_ids.shape[0],
        "seq_len": a.seq_len,
        "targets": targets,
        "ttt_steps": a.steps,
        "loss": a.loss,
        "threads": a.threads,
        "autocast_bf16": trainer.autocast_bf16,
        "reps": a.reps,
        "step_gflop": flops / 1e9,
        "roofline_bf16": roof16,
        "roofline_fp32": roof32,
        "variants": variants,
        "fused_over_checkpointed": variants["fused"]["step_s_median"]
        / variants["checkpointed"]["step_s_median"],
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "train_step_profile.json").write_text(json.dumps(r, indent=2))
    text = render(r)
    if not a.no_results_md:
        replace_section(ROOT / "benchmarks" / "RESULTS.md", HEAD, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
