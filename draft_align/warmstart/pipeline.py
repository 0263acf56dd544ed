"""The warm-start loop: build the draft → TTT training (resumable) → publish → acceptance on held-out prompts.

    conversations ─split─▶ train prompts ─(self-distillation: the target answers)─▶ responses
        ─target forward + Tap─▶ captured aux/final states (disk cache) ─▶ draft vocab
        ─TTT training (resumable)─▶ engine-format draft (checkpoints/<run>/drafts/v0001, latest)
        ─▶ acceptance on held-out prompts (estimated and measured)

The first three arrows are :mod:`draft_align.warmstart.preparation`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draft_align.config import WarmstartRecipe, recipe_to_dict, step_decay
from draft_align.config.sections import DraftConfig, TrainConfig
from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.heads.vocab import select_vocab
from draft_align.hf.generate import generate_responses
from draft_align.hf.parts import frozen_embedding, head_rows
from draft_align.monitor.sinks import Sinks, open_sinks
from draft_align.train.checkpoint import checkpoint_exists
from draft_align.train.objective import LossSettings
from draft_align.train.records import collate, make_batches
from draft_align.train.trainer import DraftTrainer, NonFiniteLossError, OptimSettings
from draft_align.warmstart.preparation import Prepared, WarmstartError, heldout_prompts, native_head, prepare

log = logging.getLogger(__name__)


def build_draft(
    target: nn.Module, recipe: WarmstartRecipe, aux: tuple[int, ...], prep: Prepared
) -> Eagle3Draft:
    """A fresh head shaped like the target's layers, with the data's vocab and the target's head rows;
    ``native_mtp``: the target checkpoint's own MTP layers; or, with ``draft.init_from``, that published draft
    (checked against the target and the recipe)."""
    if recipe.draft.init_from:
        return load_init_draft(target, recipe.draft, aux)
    if recipe.draft.head == "native_mtp":
        return native_head(recipe, target.config)  # type: ignore[return-value]
    if recipe.draft.head == "llama_block_mtp":
        from draft_align.heads.mtp import MTPDraft

        dc = recipe.draft
        return MTPDraft.attach(
            target, dc.mtp_depth, dc.mtp_layout, init_from_last_layer=dc.mtp_init == "last_layer"
        )
    cfg = Eagle3Config.from_target(target.config, recipe.draft.draft_vocab_size, aux)
    draft = Eagle3Draft(cfg)
    sel = select_vocab(prep.token_counts, cfg.draft_vocab_size, prep.predicted_mass)
    draft.set_vocab(sel)
    if recipe.draft.init_lm_head_from_target:
        with torch.no_grad():
            draft.lm_head.weight.copy_(head_rows(target, draft.draft_to_target).float())
    return draft


def load_init_draft(target: nn.Module, dc: DraftConfig, aux: tuple[int, ...]) -> Eagle3Draft:
    """The published draft ``draft.init_from`` names, checked against the target and the recipe's ``draft``
    section ``dc`` (its head, vocabulary and aux layers)."""
    from draft_align.publish import load_draft
    from draft_align.publish.compat import check_compatible
    from draft_align.publish.versions import resolve_draft_dir

    src = resolve_draft_dir(Path(dc.init_from))
    draft, manifest = load_draft(src)
    check_compatible(manifest, target.config, None)
    if tuple(draft.cfg.aux_layer_ids) != tuple(aux):
        raise WarmstartError(
            f"draft.init_from {src} reads aux layers {draft.cfg.aux_layer_ids}, the recipe {aux}"
        )
    is_mtp = draft.shares_target_head
    if draft.kind != dc.head:
        raise WarmstartError(
            f"draft.init_from {src} is a {draft.kind} draft, the recipe asks for draft.head={dc.head}"
        )
    if not is_mtp and draft.cfg.draft_vocab_size != dc.draft_vocab_size:
        raise WarmstartError(
            f"draft.init_from {src} has a {draft.cfg.draft_vocab_size}-token vocab, the recipe asks for "
            f"{dc.draft_vocab_size}: set draft.draft_vocab_size={draft.cfg.draft_vocab_size}"
        )
    log.info("starting from draft %s (version %s)", src, manifest.get("draft_version"))
    return draft


def planned_steps(tc: TrainConfig, lengths: list[int]) -> int:
    """Optimizer steps ``train.epochs`` give over records of these ``lengths`` (``train.max_steps`` caps)."""
    per_epoch = len(make_batches(lengths, tc.batch_tokens, torch.Generator().manual_seed(0)))
    planned = tc.epochs * per_epoch
    return planned if tc.max_steps is None else min(planned, tc.max_steps)


def start_trainer(recipe: WarmstartRecipe, prep: Prepared, draft: Eagle3Draft, planned: int) -> DraftTrainer:
    """The draft's trainer: LoRA adapters first when the recipe adapts, the objective section's optimizer and
    loss, resumed exactly from ``run_dir/trainer`` when a checkpoint is there."""
    objective = recipe.train.objective
    lora = recipe.draft.lora if recipe.draft.adapt == "lora" else None
    if lora is not None:  # adapters over the frozen draft, with their own optimizer settings
        from draft_align.heads.lora import apply_lora, is_lora, lora_settings

        if not is_lora(draft):
            apply_lora(draft, lora_settings(lora), seed=recipe.seed)
    optim = OptimSettings.from_section(objective, total_steps=max(1, planned), adapters=lora)
    loss = LossSettings.from_section(
        objective, step_decay(objective.step_decay, recipe.draft.head), recipe.draft.train_lm_head
    )
    dev = torch.device(recipe.device)
    draft.to(dev)
    trainer = DraftTrainer(
        draft,
        frozen_embedding(prep.target).to(dev),
        head_rows(prep.target, draft.draft_to_target.to(dev)).to(dev),
        optim,
        loss,
    )
    ckpt = recipe.run_dir / "trainer"
    if checkpoint_exists(ckpt):
        trainer.load(ckpt)
        # the checkpoint's vocab map came with its weights: the soft targets must use the same rows
        trainer.rows = head_rows(prep.target, draft.draft_to_target)
        if recipe.train.time_budget_s is None and trainer.progress.total_steps != max(1, planned):
            # a rerun with other epochs/max_steps: the cosine ends where the recipe now says
            log.info("schedule length %d → %d (recipe changed)", trainer.progress.total_steps, planned)
            trainer.set_total_steps(planned)
        pr = trainer.progress
        log.info(
            "resumed from %s at step %d (epoch %d, batch %d)", ckpt, pr.step, pr.epoch, pr.batch_in_epoch
        )
    return trainer


def _nonfinite(e: NonFiniteLossError, in_a_row: int, limit: int) -> None:
    """A non-finite loss, logged; the ``limit``-th in a row stops the run."""
    log.warning("%s (%d in a row)", e, in_a_row)
    if in_a_row >= limit:
        raise WarmstartError(
            f"{in_a_row} consecutive non-finite losses (last: {e}); stopping without "
            f"writing a checkpoint. Lower train.objective.lr or check the captured data."
        ) from e


def _show(
    m: dict[str, Any], trainer: DraftTrainer, dt: float, sink: Sinks | None, bar: Any, log_every: int
) -> None:
    """A trained step's metrics (with its time and throughput) to the sinks every ``log_every`` steps, and to
    the progress bar."""
    pr = trainer.progress
    m.update(
        step_seconds=dt,
        targets_per_s=m["targets"] / dt,
        epoch=pr.epoch,
        tokens_seen=pr.tokens_seen,
        targets_seen=pr.targets_seen,
    )
    if sink is not None and (pr.step % log_every == 0 or pr.step == 1):
        sink.log(m, pr.step)
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m['acc_0']:.2f}", tps=f"{m['targets_per_s']:.0f}")


def train(
    recipe: WarmstartRecipe,
    prep: Prepared,
    draft: Eagle3Draft,
    sink: Sinks | None = None,
    eval_hook: Any = None,
) -> DraftTrainer:
    """The training loop: epochs of length-bucketed batches, exact resume from ``run_dir/trainer``."""
    tc = recipe.train
    gen = torch.Generator().manual_seed(recipe.seed)
    lengths = [len(r) for r in prep.records]
    planned = planned_steps(tc, lengths)
    trainer = start_trainer(recipe, prep, draft, planned)
    ckpt = recipe.run_dir / "trainer"
    pr = trainer.progress
    bar = None
    if recipe.logging.progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=planned, initial=pr.step, desc="train", unit="step", dynamic_ncols=True)
    consecutive_bad = 0
    t_start = time.time() - pr.seconds
    stop = False
    while pr.epoch < tc.epochs and not stop:
        # the epoch's order depends only on (seed, epoch): a resumed run sees the same batches
        gen.manual_seed(recipe.seed * 1000 + pr.epoch)
        order = make_batches(lengths, tc.batch_tokens, gen)
        while pr.batch_in_epoch < len(order):
            out_of_time = tc.time_budget_s is not None and time.time() - t_start >= tc.time_budget_s
            if pr.step >= planned or out_of_time:
                stop = True
                break
            batch = collate([prep.records[i] for i in order[pr.batch_in_epoch]], tc.objective.ttt_steps)
            t0 = time.time()
            try:
                m = trainer.train_step(batch)
                consecutive_bad = 0
            except NonFiniteLossError as e:
                consecutive_bad += 1
                _nonfinite(e, consecutive_bad, tc.max_consecutive_nonfinite)
                pr.batch_in_epoch += 1
                continue
            dt = time.time() - t0
            pr.batch_in_epoch += 1
            pr.seconds = time.time() - t_start
            if tc.time_budget_s is not None and pr.step >= 3:
                # adapt the schedule so the cosine ends when the budget does
                est = int(tc.time_budget_s / (pr.seconds / pr.step))
                trainer.set_total_steps(min(planned, max(pr.step + 1, est)))
            _show(m, trainer, dt, sink, bar, recipe.logging.log_every)
            if pr.step % tc.checkpoint_every == 0:
                trainer.save(ckpt)
            if eval_hook is not None:
                t_hook = time.time()
                eval_hook(trainer)
                t_start += time.time() - t_hook  # evaluation does not count against the budget
        else:
            pr.epoch += 1
            pr.batch_in_epoch = 0
    if bar is not None:
        bar.close()
    if pr.step == 0 and pr.skipped_nonfinite:
        raise WarmstartError(
            f"all {pr.skipped_nonfinite} training steps had a non-finite loss; nothing was trained and no "
            f"checkpoint is written. Lower train.objective.lr or check the captured data."
        )
    trainer.save(ckpt)
    return trainer


def evaluate_draft(recipe: WarmstartRecipe, prep: Prepared, draft: Eagle3Draft) -> list[dict[str, Any]]:
    """Acceptance on held-out prompts for every (mode, temperature) of the recipe; T=0 once."""
    from draft_align.engines.reference.reference_eval import evaluate

    ec = recipe.eval
    prompts = heldout_prompts(prep, ec.prompts, recipe.data.max_prompt_tokens)
    draft.eval()
    results = []
    for temp in ec.temperatures:
        modes = ["greedy"] if temp == 0 else [m for m in ec.modes if m != "greedy"]
        for mode in modes:
            r = evaluate(
                prep.target,
                prep.tokenizer,
                draft,
                prompts,
                k=ec.k,
                mode=mode,
                temperature=temp,
                max_new_tokens=ec.max_new_tokens,
                seed=ec.seed,
            )
            results.append(r)
            log.info(
                "eval %s T=%.1f: est %.3f measured %.3f",
                mode,
                temp,
                r["acceptance_length_est"],
                r["acceptance_length_measured"],
            )
    return results


def vocab_report(prep: Prepared, draft: Eagle3Draft, sequences: int = 16) -> dict[str, float]:
    """Target mass outside the draft vocab and the out-of-vocab argmax rate, on held-out responses."""
    from draft_align.monitor.evaluate import eos_ids

    prompts = heldout_prompts(prep, sequences, 256)
    eos = eos_ids(prep.target, prep.tokenizer)
    pad = prep.tokenizer.pad_token_id if prep.tokenizer.pad_token_id is not None else min(eos)
    resp = generate_responses(
        prep.target,
        prompts,
        max_new_tokens=96,
        temperature=0.0,
        eos_ids=eos,
        pad_id=pad,
        batch_size=len(prompts),
        seed=0,
    )
    inv = draft.t2d
    lost, oov, n = 0.0, 0, 0
    with torch.no_grad():
        for p, r in zip(prompts, resp, strict=True):
            ids = torch.cat((p, r)).unsqueeze(0).to(inv.device)
            logits = prep.target(ids).logits[0, len(p) - 1 : -1].float()
            probs = torch.softmax(logits, -1)
            lost += float(probs[:, ~inv].sum())
            oov += int((~inv[logits.argmax(-1)]).sum())
            n += logits.shape[0]
    return {
        "vocab_lost_mass": lost / max(1, n),
        "vocab_oov_argmax_rate": oov / max(1, n),
        "vocab_eval_tokens": n,
    }


def run(recipe: WarmstartRecipe) -> dict[str, Any]:
    """The whole warm-start; returns a summary (also written to run_dir/summary.json).

    Draft initialisation draws from torch's global RNG seeded with ``recipe.seed`` inside a forked RNG state, so
    the caller's RNG is left as it was; the thread count (``train.num_threads``) is the caller's to set (the CLI
    does).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        return _run(recipe)


def run_in_process(recipe: WarmstartRecipe) -> dict[str, Any]:
    """:func:`run` for a launcher that needs the draft before its own job goes on (``draft-align cotrain``,
    ``draft-align ray start``, TRL's session: ``sidecar/launch.py``'s ``starting_draft(..., warm_start=...)``): the
    recipe's ``train.num_threads`` torch threads for the warm-start, the launcher's own count restored after."""
    n_threads = torch.get_num_threads()
    if recipe.train.num_threads:
        torch.set_num_threads(recipe.train.num_threads)
    try:
        return run(recipe)
    finally:
        torch.set_num_threads(n_threads)


def _run(recipe: WarmstartRecipe) -> dict[str, Any]:
    from draft_align.publish.compat import tokenizer_fingerprint
    from draft_align.publish.versions import publish_version, resolve_draft_dir

    run_dir = recipe.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.json").write_text(json.dumps(recipe_to_dict(recipe), indent=2))
    t0 = time.time()
    prep = prepare(recipe)
    aux = tuple(prep.stats["aux_layer_ids"])
    draft = build_draft(prep.target, recipe, aux, prep)
    sink = open_sinks(run_dir, recipe.logging, recipe.run, recipe_to_dict(recipe))
    try:
        trainer = train(recipe, prep, draft, sink)
        pr = trainer.progress
        train_stats = {
            "steps": pr.step,
            "train_seconds": pr.seconds,
            "tokens_seen": pr.tokens_seen,
            "targets_seen": pr.targets_seen,
            "targets_per_s": pr.targets_seen / max(pr.seconds, 1e-9),
            "token_steps_per_s": pr.targets_seen * recipe.train.objective.ttt_steps / max(pr.seconds, 1e-9),
            "skipped_nonfinite": pr.skipped_nonfinite,
        }
        vocab = vocab_report(prep, draft)
        results = evaluate_draft(recipe, prep, draft) if recipe.eval.enabled else []
        metrics = {**prep.stats, **train_stats, **vocab}
        for r in results:
            tag = f"{r['verify_mode']}_T{r['temperature']:g}"
            metrics[f"al_est_{tag}"] = r["acceptance_length_est"]
            metrics[f"al_measured_{tag}"] = r["acceptance_length_measured"]
        sink.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, trainer.progress.step)
        delta_base = None
        if recipe.draft.adapt == "lora" and recipe.draft.init_from:  # the adapters alone, over their base
            delta_base = resolve_draft_dir(Path(recipe.draft.init_from))
        out = publish_version(
            run_dir,
            draft,
            target_config=prep.target.config,
            target_name=prep.target_name,
            tokenizer_fingerprint=tokenizer_fingerprint(prep.tokenizer),
            metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            policy_version=0,
            delta_base=delta_base,
        ).path
    finally:
        sink.close()
    summary = {
        "run_dir": str(run_dir),
        "draft": str(out),
        "metrics": metrics,
        "eval": results,
        "wall_seconds": time.time() - t0,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
