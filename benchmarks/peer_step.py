"""draft_align's EAGLE-3 TTT train step against speculators' (the peer), on the same CPU in one process.

    .venv/bin/python benchmarks/peer_step.py [--ks 3 7] [--seq-len 512] [--batch-tokens 1536] [--reps 5]
        [--threads 2] [--speculators-attn sdpa]

Prints a markdown table and writes ``benchmarks/out/peer_step.json``; ``benchmarks/scale.py`` calls
:func:`measure_peer` and :func:`render_peer` for its RESULTS.md section (this file writes none).

The same draft on both sides
----------------------------
One random-weight EAGLE-3 draft at SmolLM2-135M's shapes (``benchmarks/train_step_memory.SMOLLM2``: hidden 576,
intermediate 1536, 9 query / 3 KV heads of 64, draft vocab 16,384 of the target's 49,152, 3 aux layers), built by
``benchmarks/train_step_profile.build`` for draft_align, then copied tensor for tensor (``fc``, the layer,
``norm``, ``lm_head``, ``d2t``/``t2d``: ``Eagle3Draft.engine_state_dict``, ``midlayer.*`` named ``layers.0.*``) into
speculators' ``Eagle3DraftModel``, constructed as ``Eagle3DraftModel.from_training_args`` constructs it (one
Llama layer, ``LlamaConfig`` from the same shapes) with the forward draft_align computes: ``norm_before_residual``,
``norm_before_fc``, ``fc_norm``, ``norm_output`` off (its train CLI's eagle3 defaults turn on
``norm_before_residual``, ``norm_before_fc`` and ``norm_output``, Eagle 3.1's variant: another model, whose extra
RMSNorms are cheap elementwise work) and one full-attention layer (its CLI's default is a 2,048-token sliding
window, which no 512-token record reaches).  tests/test_peer_step_bench.py checks that the two models hold the
same trainable and frozen tensors and give the same draft logits at every TTT step (fp32).  There is no verifier folder: the tensors
``load_verifier_weights`` would read from one are set directly (embedding = draft_align's frozen embedding,
``verifier_lm_head`` = the target head rows draft_align's soft targets use, ``verifier_norm`` = ones).

The same records
----------------
``batch_tokens // seq_len`` records of ``seq_len`` tokens (draft_align's collated batch from ``build``), the last
75% of each a response, 3 aux hidden states and the final hidden state in bf16.  speculators gets them as its
dataloader gives them: each record through its ``shift_batch`` (drops the first position), packed by its
``CollateFn`` into one ``[1, batch_tokens]`` row with ``document_ids`` (its ``--total-seq-len`` = batch_tokens;
the last records-many positions are padding).

The same step
-------------
Both: bf16 autocast where ``draft_align.train.precision.resolve_autocast`` says the CPU computes bf16 natively
(else fp32 on both), fp32 master weights, forward + backward, gradient-norm clipping, one AdamW step and the LR
schedule's step, the step's scalars read back.  draft_align: ``DraftTrainer.train_step`` (soft CE through the
fused log-sum-exp, the recipe default), with ``train_lm_head`` off and ``step_decay`` 1.0 to match speculators
(which freezes ``lm_head``: it is the verifier's, ``requires_grad=False``, in every speculators model, and weighs
every TTT step equally by default).  speculators: the body of its ``Trainer.train_epoch`` (``torch.autocast`` with
``hidden_states_dtype``, ``model(**batch, **get_trainer_kwargs(...))``, ``zero_grad``, ``backward``,
``clip_grad_norm_(…, 1.0)``, its ``build_optimizers`` AdamW, a linear warmup schedule), loss ``kl_div`` (its
default for eagle3) in its ``eager`` implementation (its ``fused`` one is a Triton GPU kernel) and attention
``--speculators-attn`` (default ``sdpa``: its ``simple_flex_attention`` default raises "FlexAttention does not
support backward on CPU" in torch 2.13, and ``sdpa`` was about twice as fast as ``eager``, the third choice it
offers, in a development run at K = 7).  Learning rates differ (speculators' default 1e-3, ``build``'s 1e-4): no
difference in work.

What differs, and how much (it cannot be made equal through speculators' API)
------------------------------------------------------------------------------
- **Loss form.** speculators' forward KL(p‖q) and draft_align's soft CE H(p, q) differ by the target's entropy, a
  constant: the same gradient.  speculators materialises fp32 log-softmax / softmax of the ``[1, T, Vd]`` logits
  at every step; draft_align never forms the logits' gradient tensor outside one row block (train/fused_lse.py).
  Both score the draft vocabulary only (the target distribution renormalised over it: speculators'
  ``verifier_lm_head`` holds the t2d-selected rows, draft_align's ``rows`` are the same rows); speculators also
  applies the verifier's final RMSNorm to the last hidden state where draft_align reads it post-norm (cheap).
- **Which positions run.** speculators runs every TTT step at every packed position and masks the loss after;
  draft_align runs the layer's query side, MLP and ``lm_head`` only at chain starts that some step scores
  (prompt positions cost fc + k/v only).  The gradient is the same (a chain that scores nothing gets none).  The
  loss mask lines up one position apart (speculators shifts it with the targets: it scores the prediction of
  token n+1 where token n is a response token; draft_align where token n+1 is): the same count up to one position
  per record (``speculators_scored_step0`` in the JSON).
- **Attention.** speculators packs the records into one row and attends densely over it: step j has ``T_packed``
  queries × ``(j+1)·T_packed`` keys (a block-diagonal document mask, the earlier steps' keys on a diagonal), so
  its attention FLOPs grow with K² and with the packed length, not the record length.  draft_align attends per
  record: chain starts × (record length + j).  ``executed_gflop`` in the JSON estimates each side's matmul +
  attention FLOPs as computed (dense, masked entries included); the table's GFLOP and roofline fractions use
  ONE count for both sides: the useful matmul FLOPs of the step (``benchmarks/warmstart.train_step_flops``
  with the frozen ``lm_head``'s weight gradient taken out; attention not counted), so a fraction is "useful work
  per second against this CPU's measured matmul rate" on both sides.

Timing: both sides built per K, 2 warm-up steps each (alternated), then ``reps`` steps alternated between the
sides (and draft_align as its recipes run it, lm_head trained and step decay 0.8, as a third side: reported
below the table); medians of wall time.  This machine's cores are shared with other processes, which can make one
step several times slower than the next: the JSON keeps every step and its CPU seconds (this process, all
threads; inflated by a busy neighbour too, but less), and the lines under the table give the spread, the ratio
of the fastest steps and of the CPU seconds.  The roofline is
``benchmarks/warmstart.matmul_roofline`` of the compute dtype, measured before and after the steps in the same
run (the higher one is used: a busy moment can only make it lower).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

OUT_JSON = ROOT / "benchmarks" / "out" / "peer_step.json"
SIDES = ("draft_align", "speculators")
SPECULATORS_ATTN = ("sdpa", "eager", "simple_flex_attention")


def useful_flops(cfg: Any, targets: int, tokens: int, steps: int, train_lm_head: bool) -> float:
    """Matmul FLOPs of one TTT step's useful work (warmstart.train_step_flops), less the lm_head weight
    gradient when the head is frozen (2·H·Vd per chain start and step)."""
    from benchmarks.warmstart import train_step_flops

    flops = train_step_flops(cfg, targets, tokens, steps)
    if not train_lm_head:
        flops -= targets * steps * 2 * cfg.hidden_size * cfg.draft_vocab_size
    return float(flops)


def attention_flops(cfg: Any, queries: int, keys: int) -> float:
    """Forward + backward FLOPs of dense attention of ``queries`` × ``keys`` (QKᵀ and PV, backward ≈ 2×)."""
    return 3.0 * 2 * 2 * cfg.num_attention_heads * cfg.head_dim * queries * keys


def executed_flops(cfg: Any, batch: Any, steps: int, packed_len: int) -> dict[str, float]:
    """Estimated FLOPs each side executes (matmuls at the positions it runs them, attention dense with masked
    entries included), forward + backward, frozen lm_head."""
    b, t = batch.input_ids.shape
    targets = int(batch.starts_valid.sum())
    m = batch.starts.shape[1]
    ours = useful_flops(cfg, targets, int(batch.valid.sum()), steps, False)
    ours += sum(attention_flops(cfg, b * m, t + j) for j in range(steps))
    theirs = useful_flops(cfg, packed_len, packed_len, steps, False)
    theirs += sum(attention_flops(cfg, packed_len, (j + 1) * packed_len) for j in range(steps))
    return {"draft_align": ours, "speculators": theirs}


# ------------------------------------------------------------------------------------------------ build
def build_draft_align(k: int, seq_len: int, batch_tokens: int) -> tuple[Any, Any, Any]:
    """draft_align's trainer (benchmarks/train_step_profile.build: soft CE, fused, the recipe's autocast
    rule), made like speculators' step: lm_head frozen, every TTT step weighted 1."""
    from benchmarks.train_step_profile import build

    trainer, batch, cfg = build(batch_tokens, seq_len, k, None, "soft", True)
    trainer.loss_settings = dataclasses.replace(trainer.loss_settings, train_lm_head=False, step_decay=1.0)
    trainer.draft.lm_head.weight.requires_grad_(False)
    trainer.build_optimizer()  # over the parameters that now train
    return trainer, batch, cfg


def speculators_batch(batch: Any, max_len: int, dtype: torch.dtype) -> dict[str, Any]:
    """draft_align's collated records as speculators' dataloader hands them to its model: each record a
    sample (``input_ids``, ``hidden_states`` = aux, ``verifier_last_hidden_states`` = final, ``loss_mask``,
    ``lengths``, ``position_ids``), ``shift_batch``-ed and packed by its ``CollateFn`` into [1, max_len]."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    samples = []
    for i in range(batch.input_ids.shape[0]):
        n = int(batch.valid[i].sum())
        samples.append(
            {
                "hidden_states": batch.aux[i, :n],
                "input_ids": batch.input_ids[i, :n],
                "verifier_last_hidden_states": batch.final[i, :n],
                "loss_mask": batch.loss_mask[i, :n],
                "lengths": torch.tensor([n], dtype=torch.long),
                "position_ids": torch.arange(n, dtype=torch.long),
            }
        )
    hidden = batch.final.shape[-1]
    n_aux = batch.aux.shape[-1] // hidden
    out = CollateFn(max_len, hidden, n_aux, dtype=dtype, preprocess=shift_batch)(samples)
    # what its Trainer moves to the device and passes as model(**batch): the tensors
    return {key: v for key, v in out.items() if isinstance(v, torch.Tensor)}


def speculators_name(name: str) -> str:
    """speculators' name of a draft_align EAGLE-3 tensor: its one layer is ``layers.0``, ours ``midlayer``."""
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def build_speculators(trainer: Any, cfg: Any, k: int, attn_impl: str) -> Any:
    """speculators' Eagle3DraftModel holding draft_align's draft tensor for tensor (module doc)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    tl = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_act=cfg.hidden_act,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=dict(cfg.rope_parameters),
        max_position_embeddings=cfg.max_position_embeddings,
        num_hidden_layers=1,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        layer_types=["full_attention"],
    )
    tl._attn_implementation = attn_impl  # what from_training_args sets from --draft-attn-impl
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=tl,
        draft_vocab_size=cfg.draft_vocab_size,
        norm_before_residual=False,
        norm_before_fc=False,
        fc_norm=False,
        norm_output=False,
        embed_requires_grad=False,
        eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=k)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    draft = trainer.draft
    model.load_vocab_mappings(draft.t2d.clone(), draft.d2t.clone())
    ours = {speculators_name(n): t for n, t in draft.engine_state_dict().items()}
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(ours, strict=False)
        if unexpected:
            raise RuntimeError(f"draft_align tensors with no place in speculators' model: {unexpected}")
        # what load_verifier_weights reads from the verifier folder
        model.embed_tokens.weight.copy_(trainer.embed.weight)
        model.verifier_lm_head.weight.copy_(trainer.rows.float())
        model.verifier_norm.weight.fill_(1.0)
    for name, p in model.named_parameters():
        if torch.isnan(p).any():
            raise RuntimeError(f"speculators parameter {name} was never set")
    return model


class SpeculatorsStep:
    """One step of speculators' ``Trainer.train_epoch`` body on one packed batch."""

    def __init__(self, model: Any, batch: dict[str, Any], k: int, autocast: bool) -> None:
        from types import SimpleNamespace

        from speculators.models.eagle3 import Eagle3DraftModel
        from speculators.train.optimizers import build_optimizers
        from transformers import get_linear_schedule_with_warmup

        self.model, self.batch, self.autocast = model, batch, autocast
        self.call_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
            ttt_steps=k, ttt_step_loss_decay=1.0, loss_fn="kl_div", loss_implementation="eager"
        )
        # its TrainerConfig defaults: AdamW, lr 1e-3 (schema), weight decay 0.01
        self.optimizers = build_optimizers(
            model, SimpleNamespace(optimizer="adamw", lr=1e-3, weight_decay=0.01)
        )
        self.schedulers = [get_linear_schedule_with_warmup(o, 0, 1000) for o in self.optimizers]

    def __call__(self) -> dict[str, float]:
        from contextlib import nullcontext

        self.model.train()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else nullcontext()
        with ctx:
            _tokens, loss, metrics = self.model(**self.batch, **self.call_kwargs)
        for o in self.optimizers:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for o in self.optimizers:
            o.step()
        for s in self.schedulers:
            s.step()
        out = {key: float(v.item()) for key, v in metrics.items()}
        out["loss"] = float(loss.detach())
        return out


# ------------------------------------------------------------------------------------------------ measure
def speculators_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("speculators")
    except PackageNotFoundError:  # pragma: no cover - imported from a source tree
        return "?"


def measure_peer(
    ks: tuple[int, ...] | list[int] = (3, 7),
    *,
    seq_len: int = 512,
    batch_tokens: int = 1536,
    reps: int = 5,
    threads: int = 2,
    warmup: int = 2,
    speculators_attn: str = "sdpa",
    with_default: bool = True,
) -> dict[str, Any]:
    """Both sides' train step at each K in ``ks`` (module doc); returns the JSON-able result that
    :func:`render_peer` renders.

    ``with_default``: also time draft_align as its recipes run it (lm_head trained, step decay 0.8), as a third
    side in the same alternation (``draft_align_default``: reported below the table, not in the ratio).
    """
    from benchmarks.train_step_profile import build
    from benchmarks.warmstart import matmul_roofline

    if speculators_attn not in SPECULATORS_ATTN:
        raise ValueError(f"speculators_attn {speculators_attn!r}: one of {SPECULATORS_ATTN}")
    torch.set_num_threads(threads)
    rows: list[dict[str, Any]] = []
    autocast = False
    roof_dtype = torch.float32
    roofs: list[float] = []
    for k in ks:
        trainer, batch, cfg = build_draft_align(k, seq_len, batch_tokens)
        autocast = trainer.autocast_bf16
        roof_dtype = torch.bfloat16 if autocast else torch.float32
        if not roofs:
            roofs.append(matmul_roofline(roof_dtype))
        packed = speculators_batch(batch, batch_tokens, torch.bfloat16 if autocast else torch.float32)
        model = build_speculators(trainer, cfg, k, speculators_attn)
        spec = SpeculatorsStep(model, packed, k, autocast)
        steps: dict[str, Any] = {
            "draft_align": lambda tr=trainer, b=batch: tr.train_step(b),
            "speculators": spec,
        }
        if with_default:
            default, dbatch, _ = build(batch_tokens, seq_len, k, None, "soft", True)
            steps["draft_align_default"] = lambda tr=default, b=dbatch: tr.train_step(b)
        last: dict[str, dict[str, float]] = {}

        def timed(
            side: str, steps: dict[str, Any] = steps, last: dict[str, Any] = last
        ) -> tuple[float, float]:
            # wall seconds, and this process's CPU seconds (all threads); a busy neighbour inflates both (spinning
            # threads, shared caches and memory bandwidth), the CPU time less
            t0, c0 = time.perf_counter(), time.process_time()
            last[side] = steps[side]()
            return time.perf_counter() - t0, time.process_time() - c0

        for _ in range(warmup):
            for side in steps:
                timed(side)
        times: dict[str, list[float]] = {side: [] for side in steps}
        cpu: dict[str, list[float]] = {side: [] for side in steps}
        for _ in range(reps):
            for side in steps:
                wall, used = timed(side)
                times[side].append(wall)
                cpu[side].append(used)
        targets = int(batch.starts_valid.sum())
        tokens = int(batch.valid.sum())
        packed_len = int(packed["input_ids"].shape[1])
        row: dict[str, Any] = {
            "k": k,
            "records": int(batch.input_ids.shape[0]),
            "positions": targets,
            "tokens": tokens,
            "packed_len": packed_len,
            "speculators_scored_step0": int(packed["loss_mask"].sum()),
            "useful_gflop": useful_flops(cfg, targets, tokens, k, False) / 1e9,
            "useful_gflop_lm_head_trained": useful_flops(cfg, targets, tokens, k, True) / 1e9,
            "executed_gflop": {s: v / 1e9 for s, v in executed_flops(cfg, batch, k, packed_len).items()},
        }
        for side in steps:
            med = statistics.median(times[side])
            row[side] = {
                "step_s": times[side],
                "step_s_median": med,
                "step_s_min": min(times[side]),
                "cpu_s": cpu[side],
                "cpu_s_median": statistics.median(cpu[side]),
                "positions_per_s": targets / med,
                "loss": last[side]["loss"],
            }
        row["ratio"] = row["speculators"]["step_s_median"] / row["draft_align"]["step_s_median"]
        row["ratio_min"] = row["speculators"]["step_s_min"] / row["draft_align"]["step_s_min"]
        row["ratio_cpu"] = row["speculators"]["cpu_s_median"] / row["draft_align"]["cpu_s_median"]
        if with_default:
            row["ratio_default"] = (
                row["speculators"]["step_s_median"] / row["draft_align_default"]["step_s_median"]
            )
        rows.append(row)
        del trainer, batch, model, spec, steps, packed, last
    roofs.append(matmul_roofline(roof_dtype))
    roof = max(roofs)  # the CPU's rate when least disturbed: the fractions err low
    for row in rows:
        for side in (*SIDES, "draft_align_default"):
            if side in row:
                key = "useful_gflop_lm_head_trained" if side == "draft_align_default" else "useful_gflop"
                gflops = row[key] / row[side]["step_s_median"]
                row[side]["gflops"] = gflops
                row[side]["roofline_fraction"] = gflops / roof
    return {
        "date": time.strftime("%Y-%m-%d"),
        "speculators_version": speculators_version(),
        "torch_version": torch.__version__,
        "seq_len": seq_len,
        "batch_tokens": batch_tokens,
        "reps": reps,
        "warmup": warmup,
        "threads": threads,
        "autocast_bf16": bool(autocast),
        "speculators_attn": speculators_attn,
        "speculators_loss": "kl_div (eager)",
        "roofline_dtype": "bf16" if roof_dtype == torch.bfloat16 else "fp32",
        "roofline_gflops": roof,
        "roofline_gflops_runs": roofs,
        "rows": rows,
    }


def noise_line(r: dict[str, Any]) -> str:
    """The steps' spread per side, the ratio of the fastest steps (the least disturbed) and, where measured, of
    the median CPU seconds per step: how much other processes on the cores moved the medians."""
    parts = []
    for x in r["rows"]:
        a, s = x["draft_align"]["step_s"], x["speculators"]["step_s"]
        part = (
            f"K = {x['k']}: {min(a):.2f}–{max(a):.2f} / {min(s):.2f}–{max(s):.2f} s, fastest "
            f"{min(s) / min(a):.2f}×"
        )
        if "ratio_cpu" in x:
            part += f", CPU {x['ratio_cpu']:.2f}×"
        parts.append(part)
    roofs = " and ".join(f"{g:.0f}" for g in r.get("roofline_gflops_runs", [r["roofline_gflops"]]))
    return (
        "Noise check (other processes share these cores): each side's step times, min–max, draft_align / "
        "speculators, the ratio of the fastest steps (the least disturbed) and, where measured, of the median CPU "
        "seconds this process used per step (a busy neighbour inflates them too, less than the wall time): "
        + "; ".join(parts)
        + f". Roofline measurements {roofs} GFLOP/s (before and after the steps; the higher is used)."
    )


def render_peer(result: dict[str, Any]) -> str:
    """The markdown table of one :func:`measure_peer` result, and the lines that say what it measured."""
    r = result
    dt = r["roofline_dtype"]
    lines = [
        "| K | draft_align step s (median) | speculators step s (median) | speculators / draft_align | "
        f"draft_align positions/s | speculators positions/s | draft_align of {dt} roofline | "
        f"speculators of {dt} roofline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        a, s = row["draft_align"], row["speculators"]
        lines.append(
            f"| {row['k']} | {a['step_s_median']:.3f} | {s['step_s_median']:.3f} | **{row['ratio']:.2f}×** | "
            f"{a['positions_per_s']:,.0f} | {s['positions_per_s']:,.0f} | {a['roofline_fraction']:.2f} | "
            f"{s['roofline_fraction']:.2f} |"
        )
    if not r["rows"]:
        return "\n".join(lines) + "\n"
    first = r["rows"][0]
    useful = ", ".join(f"K = {x['k']}: {x['useful_gflop']:.0f}" for x in r["rows"])
    executed = ", ".join(
        f"K = {x['k']}: {x['executed_gflop']['draft_align']:.0f} / {x['executed_gflop']['speculators']:.0f}"
        for x in r["rows"]
    )
    lines += [
        "",
        f"{first['records']} records × {r['seq_len']} tokens, {first['positions']} trained positions (chain starts) "
        f"per step, the same random-weight SmolLM2-135M-shaped EAGLE-3 draft on both sides; speculators "
        f"{r['speculators_version']} packs the records into one row of {first['packed_len']} as its dataloader "
        f"does. bf16 autocast {r['autocast_bf16']} on both, {r['threads']} threads, one AdamW step in each step; "
        f"medians of {r['reps']} steps alternated between the sides after {r['warmup']} warm-up steps each. Both "
        f"freeze lm_head (speculators always does) and weigh the TTT steps equally; draft_align soft CE (fused), "
        f"speculators {r['speculators_loss']} (the same gradient), attention `{r['speculators_attn']}`. Roofline: "
        f"this CPU's {dt} matmul rate measured in the same run, {r['roofline_gflops']:.0f} GFLOP/s, against ONE "
        f"useful-FLOP count for both sides (benchmarks/warmstart.train_step_flops less the frozen head's weight "
        f"gradient; attention not counted): {useful} GFLOP. Estimated FLOPs each side executes with attention "
        f"(dense, masked entries included), draft_align / speculators: {executed} GFLOP.",
    ]
    if all("step_s" in x["draft_align"] and "step_s" in x["speculators"] for x in r["rows"]):
        lines += ["", noise_line(r)]
    if all("draft_align_default" in x for x in r["rows"]):
        lines += [
            "",
            "draft_align as its recipes run it (lm_head trained, step decay 0.8; more work than speculators' "
            "step), in the same alternation: "
            + ", ".join(
                f"K = {x['k']}: {x['draft_align_default']['step_s_median']:.3f} s, speculators / it "
                f"{x['ratio_default']:.2f}×, {x['draft_align_default']['roofline_fraction']:.2f} of the roofline"
                for x in r["rows"]
            )
            + ".",
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--speculators-attn", default="sdpa", choices=SPECULATORS_ATTN)
    ap.add_argument(
        "--no-default",
        action="store_true",
        help="do not also time draft_align's default step (lm_head trained)",
    )
    ap.add_argument("--out", type=Path, default=OUT_JSON)
    a = ap.parse_args()
    res = measure_peer(
        tuple(a.ks),
        seq_len=a.seq_len,
        batch_tokens=a.batch_tokens,
        reps=a.reps,
        threads=a.threads,
        warmup=a.warmup,
        speculators_attn=a.speculators_attn,
        with_default=not a.no_default,
    )
    res["command"] = " ".join(["python benchmarks/peer_step.py", *sys.argv[1:]])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(render_peer(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
