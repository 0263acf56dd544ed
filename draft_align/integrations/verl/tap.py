"""The Tap on verl's old-log-prob pass (``ActorRolloutRefWorker.compute_log_prob`` as ``_compute_old_log_prob``
calls it), through the training engine's ``forward_step``.

Which call is tapped (:func:`is_old_log_prob_pass`): the driver's old-log-prob pass sets ``calculate_entropy``
and no ``no_lora_adapter``; the reference pass through the actor (LoRA: ``no_lora_adapter=True``) and the
reference worker's ``compute_ref_log_prob`` are never tapped, nor the training forward of ``update_actor`` or a
gradient-checkpointing recompute in its backward (the engine's ``forward_step`` is wrapped only for the
duration of the tapped call).

Each micro-batch verl's engine runs (``forward_step(micro_batch, …)``) is submitted right after its forward,
from the micro-batch's own tensors: ``input_ids`` nested [B, j] (its offsets are the sequence boundaries),
the prompt and response lengths and ``response_mask`` (the loss mask of the response part; padded from
``RayPPOTrainer``, nested from verl's TransferQueue trainer: :func:`sequence_loss_masks`), ``temperature``
(one, or one per sample).
With ``use_remove_padding`` (verl's default) the model ran on one packed row [1, N] with position ids and no
attention mask: :meth:`~draft_align.tap.hf.HFPolicyTap.submit_packed`; without it, on the right-padded [B, T]
batch: :meth:`~draft_align.tap.hf.HFPolicyTap.submit`.  Logits are never taken from verl (its engine divides
them by the temperature, and fused kernels give none): the kept rows' statistics come from the captured
final state × lm_head (``logits=None``, gathered once per micro-batch on every rank under FSDP2).

The policy version is verl's ``global_steps`` as the worker's ``update_weights(global_steps)`` receives it
(:meth:`VerlTap.set_version`): the old-log-prob pass of step s runs on the policy synced at the end of step s−1.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from draft_align.config import CotrainRecipe
from draft_align.tap.hf import HFPolicyTap


class VerlTapError(ValueError):
    """A verl batch or engine layout the Tap cannot follow."""


def _get(data: Any, key: str, default: Any = None) -> Any:
    """A TensorDict entry unwrapped as verl's own ``tensordict_utils.get`` does (NonTensorData → its value)."""
    from verl.utils import tensordict_utils as tu

    return tu.get(data, key, default)


def is_old_log_prob_pass(data: Any) -> bool:
    """Whether the TensorDict a ``compute_log_prob`` call got is the driver's old-log-prob pass (module
    docstring): ``calculate_entropy`` true, ``compute_loss`` false, no ``no_lora_adapter``."""
    if _get(data, "no_lora_adapter", False):
        return False
    return bool(_get(data, "calculate_entropy", False)) and not bool(_get(data, "compute_loss", True))


def sequence_loss_masks(micro_batch: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The micro-batch's sequence lengths [B] and each sequence's loss mask [L_b] (bool): its prompt tokens 0,
    then ``response_mask`` over its response tokens.  Both of verl's layouts (as ``no_padding_2_padding``
    reads them): the trainer's padded ``prompts`` [B, P] with ``attention_mask`` [B, P + R] and ``response_mask``
    [B, R]; or, from verl's TransferQueue trainer (``trainer.use_v1``), nested ``prompts``/``responses``/
    ``response_mask`` of one unpadded row per sample."""
    input_ids = micro_batch["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        raise VerlTapError(
            "verl's micro-batch input_ids are not nested (the no-padding layout verl's engine workers use): "
            "the Tap follows verl's engine workers only"
        )
    lengths = input_ids.offsets().diff().to("cpu")
    prompts, response_mask = micro_batch["prompts"], micro_batch["response_mask"]
    if getattr(prompts, "is_nested", False):
        prompt_lens = prompts.offsets().diff().to("cpu")
        response_lens = micro_batch["responses"].offsets().diff().to("cpu")
        rows = [m.to("cpu").bool() for m in response_mask.unbind()]
    else:
        attention_mask = micro_batch["attention_mask"].to("cpu").bool()
        prompt_lens = attention_mask[:, : int(prompts.shape[1])].sum(dim=1)
        response_lens = attention_mask[:, int(prompts.shape[1]) :].sum(dim=1)
        rows = list(response_mask.to("cpu").bool().unbind())
    if not torch.equal(prompt_lens + response_lens, lengths):
        raise VerlTapError(
            "verl's prompt and response lengths disagree with the nested input_ids' lengths: the batch is not "
            "one verl's trainer built"
        )
    masks = []
    for b in range(int(lengths.numel())):
        p, r = int(prompt_lens[b]), int(response_lens[b])
        masks.append(torch.cat([torch.zeros(p, dtype=torch.bool), rows[b][:r]]))
    return lengths, masks


def submit_micro_batch(tap: HFPolicyTap, micro_batch: Any, version: int) -> None:
    """Submit one verl micro-batch whose forward just ran inside ``tap.capturing()`` (module docstring)."""
    input_ids = micro_batch["input_ids"]
    lengths, masks = sequence_loss_masks(micro_batch)
    temperature = _get(micro_batch, "temperature", 1.0)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.detach().to("cpu", torch.float32).reshape(-1)
    if _get(micro_batch, "use_remove_padding", True):
        tap.submit_packed(
            input_ids=input_ids.values().unsqueeze(0),
            cu_seqlens=input_ids.offsets(),
            loss_mask=torch.cat(masks).unsqueeze(0),
            logits=None,
            policy_version=version,
            step=version,
            temperature=temperature,
        )
        return
    bsz, width = int(lengths.numel()), int(lengths.max())
    pad = int(_get(micro_batch, "pad_token_id", 0))
    ids = torch.nested.to_padded_tensor(input_ids, padding=pad, output_size=(bsz, width))
    valid = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    loss = torch.zeros(bsz, width, dtype=torch.bool)
    loss[valid] = torch.cat(masks)
    tap.submit(
        input_ids=ids,
        attention_mask=valid,
        loss_mask=loss,
        logits=None,
        policy_version=version,
        step=version,
        temperature=temperature,
    )


class VerlTap:
    """``tap`` (an :class:`~draft_align.tap.hf.HFPolicyTap` on the HF model the engine runs: ``engine.module``
    under FSDP2) on ``engine``'s old-log-prob pass.  ``head_sync(version)`` is called once per policy version
    before its first submit.  The worker calls :meth:`set_version` from ``update_weights(global_steps)`` and runs
    each ``compute_log_prob`` inside :meth:`log_prob_call`; ``seconds`` is the time spent inside the Tap."""

    def __init__(self, engine: Any, tap: HFPolicyTap, head_sync: Callable[[int], bool]) -> None:
        if int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1) > 1:
            raise VerlTapError(
                "ulysses_sequence_parallel_size > 1: the Tap does not gather Ulysses slices yet; "
                "set actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"
            )
        self.engine = engine
        self.tap = tap
        self.head_sync = head_sync
        self.version = 0
        self.synced_version: int | None = None
        self.tapped_calls = 0
        self.skipped_calls = 0
        self.micro_batches = 0
        self.last_accepted = 0
        self.seconds = 0.0

    def set_version(self, global_steps: int | None) -> None:
        """verl's ``global_steps`` as ``update_weights`` received it: the policy version from then on."""
        if global_steps is not None:
            self.version = int(global_steps)

    @contextlib.contextmanager
    def log_prob_call(self, data: Any) -> Iterator[bool]:
        """Around one ``compute_log_prob(data)``: taps it when it is the old-log-prob pass (yields True),
        then ships the step's sample; any other pass runs untouched (yields False)."""
        if not is_old_log_prob_pass(data):
            self.skipped_calls += 1
            yield False
            return
        t0 = time.perf_counter()
        if self.synced_version != self.version:
            self.head_sync(self.version)
            self.synced_version = self.version
        engine = self.engine
        original = engine.forward_step
        version = self.version

        def forward_step(micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
            out = original(micro_batch, loss_function=loss_function, forward_only=forward_only)
            t1 = time.perf_counter()
            with torch.no_grad():
                submit_micro_batch(self.tap, micro_batch, version)
            self.micro_batches += 1
            self.seconds += time.perf_counter() - t1
            return out

        self.tapped_calls += 1
        with self.tap.capturing():
            engine.forward_step = forward_step  # the instance attribute the engine's batch loop calls
            self.seconds += time.perf_counter() - t0
            try:
                yield True
            finally:
                del engine.forward_step  # back to the class's method
        t0 = time.perf_counter()
        self.last_accepted = self.tap.end_step()
        self.seconds += time.perf_counter() - t0


def worker_tap(engine: Any, recipe: CotrainRecipe, endpoints: list[str], rank: int) -> VerlTap:
    """The Tap of one actor rank: an :class:`~draft_align.tap.hf.HFPolicyTap` on ``engine.module`` (the HF model;
    under FSDP2 sharded in place) sending to the sidecar's ``endpoints`` with the run's wire key, tapping the
    layers the starting draft reads and syncing the rows of its vocabulary."""
    from draft_align.publish.tap_spec import read_tap_spec
    from draft_align.rl.build import policy_tap, tap_sender
    from draft_align.sidecar.launch import starting_draft
    from draft_align.wire import channel

    start = starting_draft(recipe)
    spec = read_tap_spec(start)
    key = channel.resolve_key(recipe.wire.key_file, recipe.run_dir, create=False)
    sender = tap_sender(recipe.wire, endpoints, key)
    hf = policy_tap(
        recipe.tap, recipe.wire, engine.module, start, sender, rank=rank, run_id=recipe.run, seed=recipe.seed
    )
    return VerlTap(engine, hf, lambda version: hf.head_sync(version, spec.draft_to_target))
