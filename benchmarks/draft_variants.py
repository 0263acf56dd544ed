"""Draft variants benchmark: full fine-tuning vs LoRA, EAGLE-3 vs MTP, re-aligning a draft to a drifted policy.

    .venv/bin/python benchmarks/draft_variants.py [--target smollm2-135m] [--drifted PATH]
        [--eagle-draft checkpoints/smollm2-bench-ttt] [--warm-s 120] [--adapt-s 120] [--threads 2] [--tiny]

    e.g. the drift benchmark's policy after 20 GRPO steps, its warm-start EAGLE-3 draft as the base:
    .venv/bin/python benchmarks/draft_variants.py --eagle-draft checkpoints/smollm2-bench-ttt \
        --drifted checkpoints/smollm2-drift/policy_merged/v0020 --warm-s 600 --adapt-s 180
    smoke run (≈ 50 s, meaningless numbers): --tiny --warm-s 8 --adapt-s 4 --warm-seqs 24 --adapt-seqs 24
        --eval-seqs 8 --max-new-tokens 24 --threads 1 --draft-vocab 64 --out /tmp/dv --no-results-md

1. Data.  Chat prompts (ShareGPT asset, or random ids with ``--tiny``); responses sampled (T=1) from the
   base policy (warm-start data) and from the drifted policy (adaptation data and a disjoint held-out set).
   One target forward per sequence with an HFTap gives the EAGLE-3 aux states, the final hidden state
   (= MTP's input, HF index L) and the full-vocab logsumexp / top-k for the estimator.
2. Base drafts (trained on the BASE policy): the EAGLE-3 draft of ``--eagle-draft`` (a published folder or
   run folder), else one warm-started here for ``--warm-s``; an MTP head (depth 1, DeepSeek-V3 layout)
   attached to the policy (block = its last layer) and warm-started for ``--warm-s``.
3. Drift.  ``--drifted``: an HF folder of the drifted policy (e.g. a merged GRPO policy saved by
   benchmarks/drift.py with ``rl.policy.save_merged_at``); without it a synthetic drift: Gaussian noise of relative
   size ``--drift-noise`` on the upper half of the decoder layers (stated in the output).
4. For each head × {full, lora}: the base draft adapted on drifted-policy records for ``--adapt-s`` with the
   sidecar's trainer (soft targets from the drifted policy's head; LoRA rank ``--lora-rank`` over the frozen
   base with its own LR).  Measured: estimated acceptance length on the held-out drifted records (engine
   replay, :func:`monitor.tapped_estimate.estimate_records`; greedy_draft at T=1 and greedy at T=0) of the frozen
   base draft, the adapted draft and the recovery; train tokens/s; trainer bytes (parameters + gradients +
   AdamW moments of what trains) and the process's peak RSS; published bytes per version (the merged
   engine-format model.safetensors, and for LoRA the adapter-only delta).

Writes ``<out>/draft_variants.json`` and the "Draft variants" section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.results_md import replace_section, repo_relative  # noqa: E402

log = logging.getLogger("bench.draft_variants")
HEAD = "## Draft variants: full vs LoRA, EAGLE-3 vs MTP"


# ----------------------------------------------------------------------------- models and data
def tiny_policy(seed: int = 0) -> Any:
    """A random 6-layer Llama (hidden 64, vocab 96), peaky head: the smoke run's policy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=96,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)
    return model


def drift(model: Any, noise: float, seed: int) -> Any:
    """A copy of ``model`` with relative Gaussian noise on the upper half of its decoder layers."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    layers = out.model.layers
    with torch.no_grad():
        for layer in layers[len(layers) // 2 :]:
            for p in layer.parameters():
                if p.dim() >= 2:
                    p.add_(
                        torch.randn(p.shape, generator=g).to(p.dtype) * noise * p.float().std().to(p.dtype)
                    )
    return out.eval()


def prompts_for(args: argparse.Namespace, tok: Any, n: int, vocab: int) -> list[torch.Tensor]:
    if tok is None:
        g = torch.Generator().manual_seed(args.seed)
        return [
            torch.randint(3, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g)
            for _ in range(n)
        ]
    from draft_align import data

    out = []
    for conv in data.load_conversations(args.data, limit=4 * n):
        p = data.encode_prompt(tok, conv)
        if len(p) <= args.max_prompt_tokens:
            out.append(p)
        if len(out) >= n:
            break
    return out


def sample(model: Any, prompts: list[torch.Tensor], args: argparse.Namespace, seed: int) -> list[tuple]:
    from draft_align.hf.generate import generate_responses

    eos = {int(model.config.eos_token_id)} if model.config.eos_token_id is not None else set()
    resp = generate_responses(
        model,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        eos_ids=eos,
        pad_id=int(model.config.pad_token_id or 0),
        batch_size=16,
        seed=seed,
    )
    return [(p, r) for p, r in zip(prompts, resp, strict=True) if r is not None and r.numel() > 1]


def tap_records(model: Any, pairs: list[tuple], eagle_aux: tuple[int, ...]) -> dict[str, list]:
    """TappedRecords for both heads (EAGLE-3 aux states / MTP's final hidden) from one forward each."""
    from draft_align.hf.capture import HFTap
    from draft_align.train.records import Record, TappedRecord

    out: dict[str, list] = {"eagle3": [], "mtp": []}
    with torch.no_grad(), HFTap(model, eagle_aux, capture_final=True) as tap:
        for i, (p, r) in enumerate(pairs):
            ids = torch.cat((p, r)).long()
            logits = model(ids[None]).logits[0].float()
            cap = tap.pop()
            mask = torch.arange(ids.numel()) >= p.numel()
            lse, top = torch.logsumexp(logits, -1), logits.topk(2, -1).indices
            fin = cap.final[0].float()
            for head, aux in (("eagle3", cap.aux[0].float()), ("mtp", fin)):
                out[head].append(
                    TappedRecord(
                        Record(ids, mask, aux, fin),
                        policy_version=0,
                        step=0,
                        arrival=i,
                        logit_lse=lse,
                        topk_ids=top,
                    )
                )
    return out


# ----------------------------------------------------------------------------- training and measuring
def train_for(trainer: Any, records: list, seconds: float, batch_tokens: int, steps: int, seed: int) -> dict:
    """Optimizer steps on random batches of ``records`` for ``seconds``; returns tokens, steps and time."""
    from draft_align.train.records import collate, make_batches

    lengths = [len(r.record) for r in records]
    g = torch.Generator().manual_seed(seed)
    tokens = n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for idx in make_batches(lengths, batch_tokens, g):
            batch = collate([records[i].record for i in idx], steps)
            trainer.train_step(batch)
            tokens += batch.num_tokens
            n += 1
            if time.perf_counter() - t0 >= seconds:
                break
    dt = time.perf_counter() - t0
    return {
        "train_steps": n,
        "train_tokens": tokens,
        "train_s": dt,
        "train_tokens_per_s": tokens / max(dt, 1e-9),
    }


def make_trainer(draft: Any, embed: Any, rows: torch.Tensor, args: argparse.Namespace, lr: float) -> Any:
    from draft_align.config import step_decay
    from draft_align.train.objective import LossSettings
    from draft_align.train.trainer import DraftTrainer, OptimSettings

    return DraftTrainer(
        draft,
        embed,
        rows,
        OptimSettings(lr=lr, warmup_steps=5, total_steps=10**9, min_lr_ratio=1.0),
        LossSettings(
            ttt_steps=args.ttt_steps,
            step_decay=step_decay(None, draft.kind),
            kind="soft",
            autocast_bf16=args.bf16,
        ),
    )


def trainer_bytes(trainer: Any) -> dict[str, int]:
    """Bytes of all draft parameters, and of gradients + AdamW moments of the trainable ones."""
    params = list(trainer.draft.parameters())
    trainable = [p for p in params if p.requires_grad]
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    t_bytes = sum(p.numel() * p.element_size() for p in trainable)
    return {
        "param_bytes": p_bytes,
        "trainable_params": sum(p.numel() for p in trainable),
        "grad_and_optimizer_bytes": 3 * t_bytes,
        "trainer_bytes": p_bytes + 3 * t_bytes,
    }


def acceptance(draft: Any, embed: Any, rows: torch.Tensor, records: list, k: int) -> dict[str, float]:
    from draft_align.monitor.tapped_estimate import estimate_records

    out = {}
    for mode, temp in (("greedy_draft", 1.0), ("greedy", 0.0)):
        est = estimate_records(draft, embed, rows, records, k, mode, temp)
        out[f"al_{mode}_T{temp:g}"] = est["acceptance_length_est"]
    return out


def published_bytes(draft: Any, base_dir: Path | None, policy: Any, work: Path, name: str) -> dict[str, int]:
    from draft_align.heads.lora import is_lora
    from draft_align.publish import export_draft
    from draft_align.publish.lora_delta import export_adapter

    out = export_draft(
        draft,
        work / name / "v0002",
        target_config=policy.config,
        target_name="bench",
        metrics={},
        draft_version=2,
        policy_version=1,
        tokenizer_fingerprint="bench",
    )
    res = {"published_bytes_merged": (out / "model.safetensors").stat().st_size}
    if is_lora(draft) and base_dir is not None:
        info = export_adapter(
            draft, work / name / "adapter-v0002", base_dir, draft_version=2, policy_version=1
        )
        res["published_bytes_delta"] = info.bytes
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    from draft_align import assets
    from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
    from draft_align.heads.lora import LoraSettings, apply_lora
    from draft_align.heads.mtp import MTPDraft
    from draft_align.heads.vocab import select_vocab
    from draft_align.hf.parts import frozen_embedding, head_rows
    from draft_align.publish import export_draft, load_draft
    from draft_align.publish.versions import resolve_draft_dir

    torch.manual_seed(args.seed)
    t_all = time.time()
    if args.tiny:
        policy, tok = tiny_policy(args.seed), None
    else:
        policy, tok = assets.load_target(args.target, torch.float32, "cpu")
    if args.drifted:
        drifted, _ = assets.load_target(args.drifted, torch.float32, "cpu")
        drift_desc = f"policy {args.drifted}"
    else:
        drifted = drift(policy, args.drift_noise, args.seed + 1)
        drift_desc = f"synthetic: relative noise {args.drift_noise} on decoder layers ≥ L/2"
    cfg = policy.config
    n_layers, vocab = int(cfg.num_hidden_layers), int(cfg.vocab_size)
    eagle_aux = tuple(args.eagle_aux) if args.eagle_aux else Eagle3Config.default_aux_layer_ids(n_layers)
    if len(set(eagle_aux)) != len(eagle_aux):
        eagle_aux = (1, n_layers // 2, n_layers - 2)
    start_draft = None
    if args.eagle_draft:
        start_draft, man = load_draft(resolve_draft_dir(Path(args.eagle_draft)))
        eagle_aux = tuple(start_draft.cfg.aux_layer_ids)

    t0 = time.time()
    prompts = prompts_for(args, tok, args.warm_seqs + args.adapt_seqs + args.eval_seqs, vocab)
    warm_pairs = sample(policy, prompts[: args.warm_seqs], args, seed=1)
    drift_pairs = sample(drifted, prompts[args.warm_seqs :], args, seed=2)
    adapt_pairs, eval_pairs = drift_pairs[: args.adapt_seqs], drift_pairs[args.adapt_seqs :]
    warm = tap_records(policy, warm_pairs, eagle_aux)
    adapt = tap_records(drifted, adapt_pairs, eagle_aux)
    held = tap_records(drifted, eval_pairs, eagle_aux)
    data_s = time.time() - t0
    log.info(
        "data: %d warm, %d adapt, %d eval sequences (%.0f s)",
        len(warm_pairs),
        len(adapt_pairs),
        len(eval_pairs),
        data_s,
    )

    embed = frozen_embedding(policy)
    embed_d = frozen_embedding(drifted)
    work = Path(tempfile.mkdtemp(prefix="draft_variants-"))
    bases: dict[str, Any] = {}
    warm_stats: dict[str, Any] = {}
    for head in ("eagle3", "mtp"):
        if head == "eagle3" and start_draft is not None:
            bases[head] = start_draft
            warm_stats[head] = {"source": str(args.eagle_draft)}
            continue
        if head == "eagle3":
            counts = torch.zeros(vocab)
            for r in warm["eagle3"]:
                counts += torch.bincount(r.record.input_ids[r.record.loss_mask], minlength=vocab).float()
            d = Eagle3Draft(
                Eagle3Config.from_target(cfg, min(args.draft_vocab, vocab), eagle_aux, torch_dtype="float32")
            )
            d.set_vocab(select_vocab(counts, d.cfg.draft_vocab_size))
            with torch.no_grad():
                d.lm_head.weight.copy_(head_rows(policy, d.draft_to_target))
        else:
            d = MTPDraft.attach(policy, depth=1, layout="deepseek_v3")
        tr = make_trainer(d, embed, head_rows(policy, d.draft_to_target), args, args.lr)
        warm_stats[head] = train_for(
            tr, warm[head], args.warm_s, args.batch_tokens, args.ttt_steps, args.seed
        )
        bases[head] = d.eval()
    base_dirs = {}
    for head, d in bases.items():  # the frozen base as published (LoRA deltas are recorded against it)
        base_dirs[head] = export_draft(
            d,
            work / f"base-{head}" / "v0001",
            target_config=cfg,
            target_name="bench",
            metrics={},
            draft_version=1,
            policy_version=0,
            tokenizer_fingerprint="bench",
        )
        bases[head], _ = load_draft(base_dirs[head])

    results = []
    for head in ("eagle3", "mtp"):
        rows = head_rows(drifted, bases[head].draft_to_target)
        frozen_acc = acceptance(bases[head], embed_d, rows, held[head], args.k)
        for adapt_kind in ("full", "lora"):
            d = copy.deepcopy(bases[head])
            if getattr(d, "shares_target_head", False):
                d.set_head(drifted.lm_head.weight)  # MTP shares the (drifted) policy's own head
            if adapt_kind == "lora":
                targets = tuple(args.lora_targets.split(","))
                apply_lora(
                    d, LoraSettings(rank=args.lora_rank, alpha=2.0 * args.lora_rank, target_modules=targets)
                )
            tr = make_trainer(d, embed_d, rows, args, args.lora_lr if adapt_kind == "lora" else args.lr)
            stats = train_for(tr, adapt[head], args.adapt_s, args.batch_tokens, args.ttt_steps, args.seed + 7)
            d.eval()
            after = acceptance(d, embed_d, rows, held[head], args.k)
            row: dict[str, Any] = {"head": head, "adapt": adapt_kind, **stats, **trainer_bytes(tr)}
            for key, v in after.items():
                row[f"{key}_frozen"] = frozen_acc[key]
                row[f"{key}_adapted"] = v
                row[f"{key}_recovery"] = v - frozen_acc[key]
            row.update(published_bytes(d, base_dirs[head], drifted, work, f"{head}-{adapt_kind}"))
            results.append(row)
            log.info(
                "%s/%s: %s",
                head,
                adapt_kind,
                {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
            )
    return {
        "command": " ".join(sys.argv),
        "settings": {k: repo_relative(v) if k == "out" else v for k, v in vars(args).items()},
        "drift": drift_desc,
        "eagle_aux": list(eagle_aux),
        "data": {
            "warm_sequences": len(warm_pairs),
            "adapt_sequences": len(adapt_pairs),
            "eval_sequences": len(eval_pairs),
            "seconds": data_s,
        },
        "warm_start": warm_stats,
        "results": results,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "wall_s": time.time() - t_all,
        "threads": torch.get_num_threads(),
    }


def results_md(res: dict[str, Any]) -> str:
    lines = [
        HEAD,
        "",
        f"`{res['command']}`",
        "",
        f"Drift: {res['drift']}.  Held-out drifted sequences: {res['data']['eval_sequences']}; "
        f"adaptation: {res['data']['adapt_sequences']} sequences for {res['settings']['adapt_s']} s per variant "
        f"({res['threads']} threads).  Acceptance: estimated engine-replay mean acceptance length at "
        f"k={res['settings']['k']} on tapped records (greedy_draft at T=1; greedy at T=0).  Trainer bytes: "
        f"all draft parameters + gradients and AdamW moments of what trains (peak RSS of the whole process: "
        f"{res['peak_rss_bytes'] / 2**20:.0f} MiB).",
        "",
        "| head | adapt | AL T=1 frozen → adapted (recovery) | AL T=0 frozen → adapted (recovery) | train tok/s "
        "| trainable params | trainer MiB | published bytes (merged / delta) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["results"]:
        a1, a0 = "al_greedy_draft_T1", "al_greedy_T0"
        delta = r.get("published_bytes_delta")
        lines.append(
            f"| {r['head']} | {r['adapt']} | {r[a1 + '_frozen']:.3f} → {r[a1 + '_adapted']:.3f} "
            f"({r[a1 + '_recovery']:+.3f}) | {r[a0 + '_frozen']:.3f} → {r[a0 + '_adapted']:.3f} "
            f"({r[a0 + '_recovery']:+.3f}) | {r['train_tokens_per_s']:.0f} | {r['trainable_params']:,} "
            f"| {r['trainer_bytes'] / 2**20:.1f} | {r['published_bytes_merged']:,} / "
            f"{'—' if delta is None else f'{delta:,}'} |"
        )
    lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drifted", default=None, help="HF folder of the drifted policy (else synthetic drift)")
    p.add_argument("--drift-noise", type=float, default=0.05)
    p.add_argument(
        "--eagle-draft", default=None, help="published EAGLE-3 draft (or run folder) of the base policy"
    )
    p.add_argument("--eagle-aux", type=int, nargs="*", default=None)
    p.add_argument("--data", default="sharegpt")
    p.add_argument("--tiny", action="store_true", help="random tiny policy and prompts: a smoke run")
    p.add_argument("--warm-seqs", type=int, default=96)
    p.add_argument("--adapt-seqs", type=int, default=96)
    p.add_argument("--eval-seqs", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--warm-s", type=float, default=120.0, help="warm-start seconds per head (base policy)")
    p.add_argument(
        "--adapt-s", type=float, default=120.0, help="adaptation seconds per variant (drifted policy)"
    )
    p.add_argument("--draft-vocab", type=int, default=16000)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batch-tokens", type=int, default=1536)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--lora-lr", type=float, default=2e-3)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=True, help="autocast bf16 training"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    p.add_argument("--no-results-md", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_variants.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    if not args.no_results_md:
        replace_section(ROOT / "benchmarks" / "RESULTS.md", HEAD, results_md(res))
    print(results_md(res))


if __name__ == "__main__":
    main()
