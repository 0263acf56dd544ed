"""A policy that can do a long task: SFT of SmolLM2-135M-Instruct on a task's reference solutions, as real RL
starts from an SFT checkpoint.

    .venv/bin/python benchmarks/task_sft.py [--task total] [--examples 480] [--epochs 1] \
        [--out checkpoints/smollm2-total-sft]

TRL's ``SFTTrainer`` with a LoRA (peft; r 32 on every linear layer of the blocks), prompt-completion rows (the
task's system prompt and question as the prompt, the reference solution as the completion, loss on the
completion only), then ``merge_and_unload`` and a plain HF folder (weights + tokenizer) that every recipe takes
as ``target.model``.  The training problems are the task source's own pool minus its held-out split
(``data.split_heldout`` with the recipe defaults), so the benchmark's held-out problems stay unseen.

Writes the folder, its ``sft.json`` (loss curve, seconds, settings) and prints a one-line summary.  Check the
result with ``benchmarks/task_probe.py --model FOLDER --tasks total``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.results_md import repo_relative  # noqa: E402

log = logging.getLogger("bench.task_sft")


def sft_rows(task: str, n: int, heldout: int, split_seed: int) -> list[dict]:
    """``n`` prompt-completion rows from the training side of ``task:TASK``'s pool (held-out problems excluded)."""
    from draft_align import data

    convs = data.load_conversations(f"task:{task}")
    train, _ = data.split_heldout(convs, heldout, split_seed)
    rows = []
    for c in train[:n]:
        *prompt, answer = c.messages
        rows.append(
            {
                "prompt": [{"role": m.role, "content": m.content} for m in prompt],
                "completion": [{"role": answer.role, "content": answer.content}],
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="total")
    ap.add_argument("--examples", type=int, default=480)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--heldout", type=int, default=64, help="the recipes' data.heldout (kept unseen)")
    ap.add_argument("--split-seed", type=int, default=0, help="the recipes' data.split_seed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="default: checkpoints/smollm2-TASK-sft")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from draft_align import assets

    out = Path(args.out or ROOT / "checkpoints" / f"smollm2-{args.task}-sft")
    base = assets.resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rows = sft_rows(args.task, args.examples, args.heldout, args.split_seed)
    work = out.with_name(out.name + ".trainer")
    cfg = SFTConfig(
        output_dir=str(work),
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=512,
        completion_only_loss=True,
        seed=0,
        disable_tqdm=True,
    )
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(
        model=model,
        args=cfg,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=lora,
    )
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    merged = trainer.model.merge_and_unload()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    summary = {
        "task": args.task,
        "base": "smollm2-135m",
        "examples": len(rows),
        "epochs": args.epochs,
        "batch": args.batch,
        "lr": args.lr,
        "lora_r": args.lora_r,
        "optimizer_steps": trainer.state.global_step,
        "seconds": seconds,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "losses": losses,
        "command": " ".join(["python benchmarks/task_sft.py", *sys.argv[1:]]),
    }
    (tmp / "sft.json").write_text(json.dumps(summary, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # the folder appears whole or not at all
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"SFT {args.task}: {len(rows)} examples, {summary['optimizer_steps']} steps in {seconds:.0f} s, loss "
        f"{summary['loss_first']:.3f} → {summary['loss_last']:.3f}; merged policy at {repo_relative(out)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
