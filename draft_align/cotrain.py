"""Co-training launcher: the RL job in this process, the sidecar as a separate process.

``run_cotrain`` resolves the starting draft (running the warm-start recipe here when it has not been published
yet: ``sidecar/launch.py``'s ``starting_draft`` with ``warmstart.run_in_process``), writes the resolved recipe
into the run folder, starts ``draft-align sidecar`` on it as a child process (``sidecar.host: ray``: as an actor
or gang on a Ray cluster, docs/ray.md), then runs the GRPO job with its Tap sending over ZeroMQ.  The RL job never waits for the sidecar: sends are non-blocking and drafts
are picked up between steps from the sidecar's ``DraftPublished`` notifications (``latest`` as the fallback).
At the end the job sends a final step report, gives the sidecar ``sidecar_exit_timeout_s`` to publish and exit,
and writes the report.  Process-level settings (torch threads, the vLLM-CPU environment) are made here, not in
the library.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from draft_align.config import RESOLVED_RECIPE, CotrainRecipe
from draft_align.rl.build import (
    close_link,
    draft_notifications,
    draft_source,
    policy_tap,
    set_engine_env,
    start_rollout_engine,
    tap_sender,
)
from draft_align.sidecar.launch import starting_draft
from draft_align.sidecar.process import spawn_sidecar, stop_sidecar, wait_ready

if TYPE_CHECKING:
    from draft_align.rl.drafts import Notifications

log = logging.getLogger(__name__)


def write_resolved(recipe: CotrainRecipe) -> Path:
    """The recipe as resolved (defaults, file, overrides) in the run folder: the sidecar reads this one."""
    from draft_align.config import save_recipe

    return save_recipe(recipe, recipe.run_dir / RESOLVED_RECIPE)


def save_prompts(run_dir: Path, convs: list[Any]) -> Path:
    """The RL job's prompts (their turns up to the first answer) as ``<run>/rl/prompts.jsonl``: a chat source
    ``draft-align warmstart`` self-distils an in-domain draft from (``advise`` prints the command)."""
    from draft_align.data import Conversation
    from draft_align.monitor.advise import PROMPTS_FILE

    path = run_dir / PROMPTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        for c in convs:
            f.write(Conversation(tuple(c.prompt)).to_bytes() + b"\n")
    os.replace(tmp, path)
    return path


def build_job(
    recipe: CotrainRecipe,
    start: Path,
    sink: Any,
    tap_sink: Any,
    *,
    notifications: Notifications | None = None,
) -> Any:
    """The GRPO job of ``recipe`` with its Tap offering to ``tap_sink`` and step reports to ``sink``;
    ``notifications``: the sidecar's DraftPublished subscriber (None: the job polls ``latest``)."""
    from draft_align import assets, data
    from draft_align.conventions import float_dtype
    from draft_align.data import tasks
    from draft_align.monitor.evaluate import eos_ids
    from draft_align.rl.grpo import GRPOJob
    from draft_align.rl.policy import Policy
    from draft_align.rl.prompts import build_prompts, make_kl_sequences, select_prompts

    rl, task = recipe.rl, recipe.rl.task
    target, tok = assets.load_target(recipe.target.model, float_dtype(recipe.target.dtype), recipe.device)
    policy = Policy.from_config(target, rl.policy.lora, seed=recipe.seed)
    drafts = draft_source(
        rl.guard, recipe.run_dir, start, run_id=recipe.run, device=recipe.device, notifications=notifications
    )
    tap = None
    if recipe.tap.enabled:
        tap = policy_tap(
            recipe.tap,
            recipe.wire,
            policy.hf_model,
            start,
            tap_sink,
            rank=0,
            run_id=recipe.run,
            seed=recipe.seed,
        )
    convs = data.load_conversations(recipe.data.source)
    train_convs, held = data.split_heldout(convs, recipe.data.heldout, recipe.data.split_seed)
    n_prompts = max(task.prompts_per_step * rl.steps * 4, 64)  # a pool the steps sample from
    prompts, kept = select_prompts(tok, train_convs[task.first_prompt :], n_prompts, task.max_prompt_tokens)
    answers = None
    if tasks.is_task_source(recipe.data.source):  # a verifiable task: each prompt's checked answer
        by_question = tasks.answers_by_question(tasks.task_problems(recipe.data.source))
        train_q = [tasks.question_of(train_convs[task.first_prompt + i]) for i in kept]
        tasks.check_disjoint(train_q, [tasks.question_of(c) for c in held])
        answers = [by_question[q] for q in train_q]
    save_prompts(recipe.run_dir, [train_convs[task.first_prompt + i] for i in kept])
    eos = eos_ids(target, tok)
    kl_prompts = build_prompts(tok, held, rl.policy.kl_prompts, task.max_prompt_tokens)
    kl_sequences = make_kl_sequences(policy, kl_prompts, task.max_new_tokens, eos, recipe.seed)
    extra = None
    if hasattr(tap_sink, "stats"):

        def extra() -> dict[str, Any]:
            stats = tap_sink.stats()
            # every message the sender did not deliver, whatever the reason: the live table's `drops`
            dropped = sum(v for k, v in stats.items() if k.startswith("dropped_"))
            return {**{f"wire_{k}": v for k, v in stats.items()}, "wire_dropped": dropped}

    engine = start_rollout_engine(
        rl.engine,
        rl.guard,
        recipe.target,
        drafts.frozen_version,
        kl_prompts,
        run_dir=recipe.run_dir,
        seed=recipe.seed,
        key_file=recipe.wire.key_file,
        push=recipe.push,
    )
    return GRPOJob(
        rl,
        policy,
        tok,
        prompts,
        kl_sequences,
        drafts,
        tap,
        sink,
        recipe.run_dir,
        eos,
        seed=recipe.seed,
        run_id=recipe.run,
        extra_metrics=extra,
        engine=engine,
        answers=answers,
    )


class Pusher:
    """``draft-align push`` run by the launcher in a thread (``rl.engine.kind: server``): the job's server plus
    ``push.servers``, the sidecar's notifications (``latest`` as the fallback)."""

    def __init__(self, loop: Any, notify: Any) -> None:
        import threading

        self.loop, self.notify = loop, notify
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=loop.run, args=(self.stop,), name="draft-align-push", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60.0)
        self.loop.close()
        self.notify.close()


def start_pusher(recipe: CotrainRecipe, key: bytes, servers: list[str]) -> Pusher:
    from draft_align.push.loop import build_push_loop

    notify = draft_notifications(recipe.wire, recipe.run_dir, key)
    loop = build_push_loop(
        recipe.run_dir, recipe.push, key, key_file=recipe.wire.key_file, notifications=notify, servers=servers
    )
    return Pusher(loop, notify)


def keep_previous_run(run_dir: Path) -> None:
    """An RL run starts from the initial policy: a previous run's logs, drafts and policies in ``run_dir`` are
    moved aside (``<run_dir>.<time>``), never overwritten."""
    from draft_align.sidecar.layout import SIDECAR_DIR

    if (run_dir / "rl").exists() or (run_dir / SIDECAR_DIR).exists():
        aside = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(run_dir, aside)
        log.info("a previous run of %s was moved to %s", run_dir, aside)


def run_cotrain(
    recipe: CotrainRecipe,
    start: str | None = None,
    *,
    sidecar: bool = True,
    sidecar_exit_timeout_s: float = 120.0,
    sidecar_ready_timeout_s: float = 180.0,
    out: Any = None,
) -> dict[str, Any]:
    """Run the co-training job; returns {"report": summary, "sidecar_rc": …}."""
    from draft_align import warmstart
    from draft_align.monitor.advise_text import add_to_report
    from draft_align.monitor.live import MONITOR_LOG, LiveTable
    from draft_align.monitor.report import write_report
    from draft_align.wire import channel

    out = out or sys.stdout
    torch.set_num_threads(recipe.rl.num_threads)
    run_dir = recipe.run_dir
    keep_previous_run(run_dir)
    start_path = starting_draft(recipe, start, warm_start=warmstart.run_in_process)
    resolved = write_resolved(recipe)
    key = channel.resolve_key(recipe.wire.key_file, run_dir, create=True)
    endpoint = channel.tap_endpoint(run_dir, recipe.wire.endpoint)
    proc = None
    on_ray = None  # sidecar.host=ray: the sidecar is an actor (gang) on the recipe's Ray cluster
    endpoints = None
    if sidecar and recipe.sidecar.host == "ray":
        from draft_align.integrations.ray.client import RaySidecar

        on_ray = RaySidecar.start(recipe, start_path, resolved)
        endpoints = on_ray.ready()  # bounded (ray.ready_timeout_s); None: the job runs on, its taps dropped
    elif sidecar:
        proc = spawn_sidecar(resolved, start_path, run_dir / "sidecar.log", ranks=recipe.sidecar.ranks)
    if endpoints is None:
        # the configured endpoints; a Ray sidecar that did not come up: its run folder's socket, which nothing
        # binds, so every tap is dropped and counted while the job runs on
        endpoints = channel.tap_endpoints(endpoint, recipe.sidecar.ranks if on_ray is None else 1)
    sender = tap_sender(recipe.wire, endpoints, key)
    notify: Any = None
    if on_ray is not None:  # notifications through the run's registry (never blocking; `latest` as fallback)
        notify = on_ray.notifications()
    elif sidecar:  # the sidecar's DraftPublished notifications; the job falls back to `latest` without them
        notify = draft_notifications(recipe.wire, run_dir, key)
    set_engine_env(recipe.rl.engine)  # the RL process's vLLM-CPU environment, before any engine starts
    rc = None
    table = None
    job = None
    pusher = None
    final = None
    try:
        job = build_job(recipe, start_path, sender, sender, notifications=notify)
        if recipe.rl.engine.kind == "server":  # draft-align push beside the rollout server, in its own thread
            pusher = start_pusher(recipe, key, [job.engine.server.url])
        if proc is not None:
            wait_ready(proc, run_dir, sidecar_ready_timeout_s)
        job.wait_for_first_draft()
        # a step's row is printed once the sidecar has written its own row of that step (never waited for)
        alive = (lambda: proc is not None and proc.poll() is None) if on_ray is None else on_ray.alive
        table = LiveTable(run_dir / MONITOR_LOG, out, sidecar_alive=alive).start()
        for _ in range(recipe.rl.steps):
            table.add(job.step())
        job.finish()
        job.engine.shutdown()
        final = (recipe.run, job.step_index, job.policy.version)  # the sidecar's cue to end its run
    finally:
        if pusher is not None:
            pusher.close()
        if job is not None and recipe.rl.engine.kind == "server":
            job.engine.shutdown()  # stops the server the job started, also after a failure (idempotent)
        close_link(sender, job.drafts if job is not None else None, notify, final=final)
        if proc is not None:
            rc = stop_sidecar(proc, sidecar_exit_timeout_s)
        if on_ray is not None:  # it ends after the final report (a detached one stays for the next job)
            on_ray.wait(sidecar_exit_timeout_s)
            status = on_ray.stop(30.0, kill=recipe.ray.lifetime != "detached")
            rc = 0 if status is not None and status.get("error") is None else 1
        if table is not None:
            table.close()
    report = write_report(run_dir)
    add_to_report(run_dir)  # the advice section (draft-align advise) at the end of report.md
    (run_dir / "cotrain_summary.json").write_text(
        json.dumps({"report": report, "sidecar_rc": rc}, default=str)
    )
    return {"report": report, "sidecar_rc": rc}
