"""The RL side's parts built from a co-training recipe, as ``sidecar/build.py`` builds the sidecar's: the sender
the Tap offers to, the Tap on the policy's log-prob pass, the draft source and the rollout engine (with its probe
guard and the vLLM-CPU environment it needs).  Plain functions, each the one place its part is built, each taking
the recipe sections it reads (``wire``, ``tap``, ``rl.engine``, ``rl.guard``, ``target``) and the run's own
values (its folder, name and seed): the GRPO job (``cotrain.py``), TRL's session and verl's worker and driver
call them with what their framework owns (the policy model, the device, the rank, the sidecar's endpoints)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from draft_align.engines.rollout_types import DraftVersion
from draft_align.rl.draft_guard import counter_guard
from draft_align.rl.drafts import DraftSource, Notifications
from draft_align.tap.hf import HFPolicyTap
from draft_align.tap.protocol import TapSink

if TYPE_CHECKING:
    from draft_align.config.sections import (
        PushConfig,
        RLEngineConfig,
        RLGuardConfig,
        TapConfig,
        TargetConfig,
        WireConfig,
    )
    from draft_align.engines.vllm.refresher import ProbeGuard
    from draft_align.wire.channel import Subscriber
    from draft_align.wire.sender import TapSender

log = logging.getLogger(__name__)


def tap_sender(wire: WireConfig, endpoints: str | list[str], key: bytes) -> TapSender:
    """The Tap's non-blocking sender to the sidecar's ``endpoints`` (one per sidecar rank), signing with ``key``;
    its queue and message limits from ``wire``."""
    from draft_align.wire import channel

    return channel.TapSender(
        endpoints,
        key,
        queue_messages=wire.queue_messages,
        queue_bytes=wire.queue_mb << 20,
        allow_remote=wire.allow_remote,
        max_message_bytes=wire.max_message_mb << 20,
        send_timeout_s=wire.send_timeout_s,
    )


def policy_tap(
    tap: TapConfig,
    wire: WireConfig,
    model: nn.Module,
    start: Path,
    sink: TapSink,
    *,
    rank: int,
    run_id: str,
    seed: int,
) -> HFPolicyTap:
    """The Tap on ``model`` (the policy's HF model) capturing the layers the starting draft ``start`` reads (its
    tap spec), offering to ``sink``: the ``tap`` section's budgets (its messages sized for ``wire``:
    :func:`message_tokens`), the run's name and seed, this data-parallel ``rank``."""
    from draft_align.publish.tap_spec import read_tap_spec

    aux = read_tap_spec(start).aux_layer_ids
    return HFPolicyTap(
        model,
        aux,
        sink,
        run_id=run_id,
        tokens_per_step=tap.tokens_per_step,
        max_tokens_per_message=message_tokens(tap, wire, int(model.config.hidden_size), len(aux)),
        send_final=tap.send_final,
        topk=tap.topk,
        rank=rank,
        seed=seed,
    )


def message_tokens(tap: TapConfig, wire: WireConfig, hidden: int, n_aux: int) -> int:
    """``tap.max_tokens_per_message``, lowered to what fits the receiver's ``wire.max_message_mb`` at this
    policy's width (at H = 4,096 the default 16,384 tokens would be 537 MB: every message refused); logs a
    warning when one step's budget does not fit the send queue (``wire.queue_mb``, ``wire.queue_messages``): the
    tap offers a step's sample at once, and what the queue cannot hold is dropped."""
    from draft_align.wire.packing import tapped_token_bytes, tokens_that_fit

    per_token = tapped_token_bytes(hidden, n_aux, final=tap.send_final, topk=tap.topk)
    fit = tokens_that_fit(wire.max_message_mb << 20, per_token)
    if fit < tap.max_tokens_per_message:
        log.info(
            "tap: messages of at most %d tokens (%d B per token; tap.max_tokens_per_message %d would pass "
            "wire.max_message_mb %d)",
            fit,
            per_token,
            tap.max_tokens_per_message,
            wire.max_message_mb,
        )
    step_mb = tap.tokens_per_step * per_token / 2**20
    if step_mb > wire.queue_mb:
        log.warning(
            "tap.tokens_per_step %d is %.0f MiB a step at %d B per token, more than wire.queue_mb %d: the rest "
            "of each step's sample is dropped at the send queue; raise wire.queue_mb to %d",
            tap.tokens_per_step,
            step_mb,
            per_token,
            wire.queue_mb,
            int(step_mb * 1.1) + 1,
        )
    per_message = min(tap.max_tokens_per_message, fit)
    messages = -(-tap.tokens_per_step // per_message)
    if messages > wire.queue_messages:
        log.warning(
            "tap.tokens_per_step %d is %d messages of at most %d tokens, more than wire.queue_messages %d: the "
            "rest of each step's sample is dropped at the send queue; raise wire.queue_messages to %d",
            tap.tokens_per_step,
            messages,
            per_message,
            wire.queue_messages,
            messages,
        )
    return per_message


def close_link(
    sender: TapSender | None,
    drafts: DraftSource | None,
    notifications: Any,
    *,
    final: tuple[str, int, int] | None = None,
) -> None:
    """The RL side's link to its sidecar closed in the one safe order (the GRPO job, TRL and verl all end this
    way): the final StepReport (``final``: run id, step, policy version; None after a failure) and ``sender``,
    whose close waits at most 5 s whatever the sidecar does; the draft source, whose verifier thread reads the
    notifications; then ``notifications`` (a DraftPublished subscriber; Ray's registry has nothing to close)."""
    from draft_align.wire.messages import StepReport

    if sender is not None:
        if final is not None:
            sender.offer(StepReport.final(*final))
            time.sleep(0.5)  # let the background thread hand the last messages to ZeroMQ
        sender.close(timeout_s=5.0)
    if drafts is not None:
        drafts.close()
    if notifications is not None and hasattr(notifications, "close"):
        notifications.close()


def draft_notifications(wire: WireConfig, run_dir: Path, key: bytes) -> Subscriber:
    """The sidecar's DraftPublished notifications for run ``run_dir`` (``wire.notify_endpoint``, else the run
    folder's socket), verified with ``key``: what :func:`draft_source` and ``draft-align push`` follow."""
    from draft_align.wire import channel

    endpoint = channel.notify_endpoint(run_dir, wire.notify_endpoint)
    return channel.Subscriber(endpoint, key, allow_remote=wire.allow_remote)


def draft_source(
    guard: RLGuardConfig,
    run_dir: Path,
    start: Path,
    *,
    run_id: str,
    device: str | torch.device = "cpu",
    notifications: Notifications | None = None,
) -> DraftSource:
    """The RL job's drafts: ``start`` frozen, the newest version published in ``run_dir`` (the run ``run_id``'s
    folder) adapted (``notifications``: the sidecar's DraftPublished subscriber; None: ``latest`` is polled), new
    versions hashed, loaded and checked off the job's thread, judged by ``guard`` (``rl.guard``) on the step's
    counters."""
    return DraftSource(
        run_dir,
        start,
        device=device,
        notifications=notifications,
        background=True,  # new versions are hashed, loaded and checked off the job's thread
        guard=counter_guard(guard),
        run_id=run_id,
    )


def set_engine_env(engine: RLEngineConfig) -> None:
    """The vLLM-CPU environment of the process that starts the rollout engine (only where vLLM may start:
    ``rl.engine.kind`` is not reference); the launcher calls it before any engine starts."""
    from draft_align.engines.vllm.start import set_cpu_env, vllm_available

    if engine.kind != "reference" and vllm_available():
        set_cpu_env(engine.kv_cache_gb)


def probe_guard(guard: RLGuardConfig, probe_prompts: list[torch.Tensor]) -> ProbeGuard | None:
    """The probe set on the first ``rl.guard.probe_prompts`` of ``probe_prompts`` (the engine's load-time guard
    under ``rl.guard.kind: probe``, and what ``rl.engine.verify_mode: auto`` measures on), or None when
    ``rl.guard.probe_prompts`` is 0."""
    from draft_align.engines.vllm.refresher import ProbeGuard

    if guard.probe_prompts == 0:
        return None
    if not probe_prompts:
        raise ValueError("rl.guard.probe_prompts > 0 but there are no probe prompts")
    probes = tuple({"prompt_token_ids": p.tolist()} for p in probe_prompts[: guard.probe_prompts])
    return ProbeGuard(probes, max_tokens=guard.probe_tokens, min_ratio=guard.min_ratio)


def start_rollout_engine(
    engine: RLEngineConfig,
    guard: RLGuardConfig,
    target: TargetConfig,
    frozen: DraftVersion | None,
    probe_prompts: list[torch.Tensor],
    *,
    run_dir: Path,
    seed: int,
    key_file: str | None,
    push: PushConfig,
) -> Any:
    """The vLLM rollout engine ``engine`` (``rl.engine``) asks for on ``target``, or None for the reference
    decoder.

    ``frozen``: the verified starting draft.  ``kind: auto``: vLLM when it is importable and starts on the
    target; a start failure is logged as an error and the job continues on the reference decoder.  ``vllm``: a
    failure raises.  ``server``: :func:`start_server_rollouts` (``push``: its API key and timeout).  With
    ``rl.guard.kind: probe`` the probe guard (:func:`probe_guard`) decodes the first ``rl.guard.probe_prompts``
    held-out prompts at T = 0 before and after each newly offered draft; otherwise its prompts serve
    ``rl.engine.verify_mode: auto`` only.  ``run_dir``, ``seed``, ``key_file``: the run's folder, seed and
    ``wire.key_file``.  The launcher sets the vLLM-CPU environment first (:func:`set_engine_env`).
    """
    from draft_align.engines.vllm import start as vllm_start

    kind = engine.kind
    if kind == "server":
        return start_server_rollouts(engine, target, frozen, run_dir=run_dir, key_file=key_file, push=push)
    if kind == "reference" or (kind == "auto" and not vllm_start.vllm_available()):
        if kind == "auto":
            log.warning(
                "rl.engine.kind auto: vLLM is not installed; rollouts use the reference decoder (batch 1)"
            )
        return None
    from draft_align.engines.vllm.drafters import drafter_for

    if frozen is not None and not drafter_for(frozen.manifest).serves:
        if kind == "vllm":
            raise ValueError(
                "rl.engine.kind=vllm: the vLLM adapter serves EAGLE-3 and native MTP drafts; a Llama-block "
                "MTP draft needs rl.engine.kind=reference (or auto)"
            )
        log.warning(
            "rl.engine.kind auto: the starting draft is a Llama-block MTP head; rollouts use the reference "
            "decoder"
        )
        return None
    from draft_align.engines.vllm import vllm_rollouts

    try:
        probes = probe_guard(guard, probe_prompts)
        return vllm_rollouts.VLLMRollouts(
            target.model,
            frozen,
            k=engine.spec_k,
            verify_mode=engine.verify_mode,
            dtype=target.dtype,
            max_model_len=engine.max_model_len,
            seed=seed,
            guard=probes,
            enforce_eager=True,
            verify_recheck_every=engine.verify_recheck_every,
            guard_on_load=guard.kind == "probe",
            run_dir=run_dir,
            key_file=key_file,
            use_tqdm_on_load=False,  # no progress bars between the table's rows
        )
    except (vllm_start.EngineError, ValueError) as e:
        if kind == "vllm":
            raise
        log.error(
            "rl.engine.kind auto: vLLM could not serve %s (%s); rollouts use the reference decoder",
            target.model,
            e,
        )
        return None


def start_server_rollouts(
    engine: RLEngineConfig,
    target: TargetConfig,
    frozen: DraftVersion | None,
    *,
    run_dir: Path,
    key_file: str | None,
    push: PushConfig,
) -> Any:
    """``rl.engine.kind: server``: :class:`~draft_align.engines.vllm.server_rollouts.ServerRollouts` on
    ``rl.engine.server_url``, or on a vLLM server started here on 127.0.0.1 with the frozen draft (stopped with
    the engine).  Drafts reach it through ``draft-align push`` (the co-training launcher runs one beside it);
    ``push``: the servers' API key variable and the HTTP timeout."""
    import os

    from draft_align.assets import resolve_model
    from draft_align.conventions import float_dtype
    from draft_align.engines.vllm.serve import ServerProcess, free_port, server_command
    from draft_align.engines.vllm.server_client import VLLMServer
    from draft_align.engines.vllm.server_rollouts import ServerRollouts
    from draft_align.wire.keys import resolve_key

    api_key = os.environ.get(push.api_key_env) or None
    process = None
    model = resolve_model(target.model)
    if engine.server_url is None:
        if frozen is None:
            raise ValueError("rl.engine.kind=server starts its server on the starting draft: there is none")
        port = free_port()
        argv = server_command(
            model,
            frozen.path,
            port=port,
            k=engine.spec_k,
            dtype=target.dtype,
            max_model_len=engine.max_model_len,
            extra=[
                "--enforce-eager",
                "--logprobs-mode",
                "processed_logprobs",
                "--disable-uvicorn-access-log",
            ],
        )
        log_file = run_dir / "logs" / "vllm_server.log"
        process = ServerProcess(argv, port=port, log=log_file, env={"OMP_NUM_THREADS": "1"}).start()
        try:
            process.wait_ready()
        except Exception:
            process.stop()
            raise
        url = process.url
    else:
        url = engine.server_url
    server = VLLMServer(url, api_key=api_key, timeout_s=push.timeout_s)
    if process is None:  # the user's server: the name it serves the model under
        model = (server.served_models() or [model])[0]
    key = resolve_key(key_file, run_dir, create=True)
    return ServerRollouts(
        server,
        model,
        run_dir,
        key,
        k=engine.spec_k,
        dtype=float_dtype(target.dtype),
        asynchronous=engine.server_async,
        process=process,
    )
