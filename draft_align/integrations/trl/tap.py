"""The Tap on TRL's own log-prob pass (``GRPOTrainer._get_per_token_logps_and_entropies``).

Which pass is tapped (:func:`tapped_pass`), once per generation batch, as TRL 1.16 runs them:

- ``old``: when TRL computes "old" log-probs (vLLM importance-sampling correction on, or gradient
  accumulation not a multiple of ``steps_per_generation × num_iterations``), its first no-grad call inside
  ``_generate_and_score_completions`` — never the reference pass that follows it (``ref_model``, or the
  policy with its adapter disabled);
- ``train``: otherwise the training forward of ``_compute_loss`` during the first of the ``num_iterations``
  passes over each generation batch (``_step mod generate_every < steps_per_generation``).

The hooks are attached only for the duration of that call, so a gradient-checkpointing recompute (in the
backward, after the call returned) never fires them.  Each chunk TRL runs is submitted from a forward hook on
the model TRL calls, with the ``input_ids``/``attention_mask`` it really got; ``loss_mask`` is the completion
mask (the valid tokens of the last ``logits_to_keep`` columns).  Policy version and step = ``state.global_step``.

TRL's fused LM head never builds logits.  At temperature 1 with a tap built with ``topk=0`` (nothing reads the
policy's top-k at T > 0: only greedy T = 0 estimates do) the statistics come from TRL's own output: its
``log_probs`` are the policy's next-token log-probs, and ``logit_lse`` follows from one lm_head row per position
(:func:`~draft_align.tap.logit_stats.logprob_stats`), so the Tap adds no [L, V] product to TRL's pass.
Otherwise (TRL's log-probs are tempered, or top-k is asked for) they come from the captured final state ×
lm_head (``submit(logits=None)``).  Either way the head is gathered under ZeRO-3 with TRL's own
``maybe_gather_lm_head_ctx``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from draft_align.tap.hf import HFPolicyTap

log = logging.getLogger(__name__)

TappedPass = Literal["old", "train"]


class TRLTapError(ValueError):
    """A TRL configuration the Tap cannot follow."""


def tapped_pass(trainer: Any) -> TappedPass:
    """Which of TRL's log-prob passes sees every generated sequence exactly once (module docstring)."""
    args = trainer.args
    generate_every = args.steps_per_generation * trainer.num_iterations
    if args.gradient_accumulation_steps % generate_every != 0 or (
        trainer.use_vllm and trainer.vllm_importance_sampling_correction
    ):
        return "old"
    return "train"


def policy_model(trainer: Any) -> nn.Module:
    """The HF model TRL's policy forward runs (unwrapped from DDP/DeepSpeed, and from peft's PeftModel)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    try:
        from peft import PeftModel
    except ImportError:
        return model
    return model.get_base_model() if isinstance(model, PeftModel) else model


def adapters_disabled(model: nn.Module) -> bool:
    """True while a peft model's adapters are disabled (TRL's reference pass on the policy itself)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            return bool(m.disable_adapters)
    return False


def _lm_head_gather(lm_head: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """TRL's own ZeRO-3 gather of the lm_head (a null context without ZeRO-3)."""
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    return maybe_gather_lm_head_ctx(lm_head.weight, lm_head.bias)


class TRLTap:
    """Installs ``tap`` (an :class:`~draft_align.tap.hf.HFPolicyTap` on :func:`policy_model`) on
    ``trainer``'s log-prob pass; see the module docstring.  ``head_sync(version)`` is called once per policy
    version before its first submit.  ``seconds``: time spent inside the Tap (hooks and submit) since the
    last :meth:`take_seconds`.  ``uses_trl_logprobs``: the statistics come from TRL's own log-probs."""

    def __init__(self, trainer: Any, tap: HFPolicyTap, head_sync: Callable[[int], bool]) -> None:
        self.trainer = trainer
        self.tap = tap
        self.head_sync = head_sync
        self.model = policy_model(trainer)
        self.uses_trl_logprobs = float(trainer.temperature) == 1.0 and tap.topk == 0
        self.mode: TappedPass = tapped_pass(trainer)
        self.synced_version: int | None = None
        self.in_generation = False
        self.generation_calls = 0
        self.tapped_calls = 0
        self.seconds = 0.0
        self._logits_to_keep = 0
        self._orig_logps = trainer._get_per_token_logps_and_entropies
        self._orig_generate = trainer._generate_and_score_completions
        trainer._get_per_token_logps_and_entropies = self._logps
        trainer._generate_and_score_completions = self._generate_and_score

    def uninstall(self) -> None:
        """Give TRL its own methods back."""
        self.trainer._get_per_token_logps_and_entropies = self._orig_logps
        self.trainer._generate_and_score_completions = self._orig_generate

    @property
    def version(self) -> int:
        return int(self.trainer.state.global_step)

    def take_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s

    # ----------------------------------------------------------------- which call
    def _generate_and_score(self, inputs: Any) -> Any:
        self.in_generation, self.generation_calls = True, 0
        try:
            return self._orig_generate(inputs)
        finally:
            self.in_generation = False

    def _wanted(self, model: Any) -> bool:
        t = self.trainer
        if not t.model.training or model is t.ref_model or adapters_disabled(self.model):
            return False
        if self.mode == "old":
            return self.in_generation and self.generation_calls == 1  # TRL's first call is the old pass
        if self.in_generation:
            return False  # the reference pass (train mode has no old pass)
        generate_every = t.args.steps_per_generation * t.num_iterations
        return t._step % generate_every < t.args.steps_per_generation  # the first of num_iterations passes

    def _logps(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if self.in_generation:
            self.generation_calls += 1
        if not self._wanted(model):
            return self._orig_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        t0 = time.perf_counter()
        version = self.version
        if self.synced_version != version:
            with _lm_head_gather(_parts(self.model)[3]):
                self.head_sync(version)
            self.synced_version = version
        self._logits_to_keep = int(logits_to_keep)
        self.tapped_calls += 1
        self.seconds += time.perf_counter() - t0
        with self._capturing(model):
            return self._orig_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    @contextlib.contextmanager
    def _capturing(self, model: nn.Module) -> Iterator[None]:
        t0 = time.perf_counter()
        with self.tap.capturing():
            handle = model.register_forward_hook(self._after_forward, with_kwargs=True)
            self.seconds += time.perf_counter() - t0
            try:
                yield
            finally:
                handle.remove()

    # ----------------------------------------------------------------- one chunk
    def _after_forward(
        self, _mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        t0 = time.perf_counter()
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        attention_mask = kwargs.get("attention_mask")
        if input_ids is None or attention_mask is None:
            raise TRLTapError(
                "TRL's forward passed no input_ids/attention_mask: the Tap cannot follow this layout "
                "(padding-free or embeddings input)"
            )
        width = int(input_ids.shape[1])
        completion = torch.arange(width, device=attention_mask.device) >= width - self._logits_to_keep
        loss_mask = attention_mask.bool() & completion
        next_logprob = _next_logprob(out, input_ids.shape) if self.uses_trl_logprobs else None
        _, _, _, lm_head = _parts(self.model)
        with torch.no_grad(), _lm_head_gather(lm_head):
            self.tap.submit(
                input_ids=input_ids,
                attention_mask=attention_mask,
                loss_mask=loss_mask,
                logits=None,
                policy_version=self.version,
                step=self.version,
                temperature=float(self.trainer.temperature),
                next_logprob=next_logprob,
            )
        self.seconds += time.perf_counter() - t0


def _next_logprob(out: Any, shape: torch.Size) -> torch.Tensor:
    """TRL's fused-head output (``FusedCausalLMOutput``: ``log_probs`` [B, T−1], position t scoring token t+1)
    as the Tap's ``next_logprob`` [B, T] (the last column 0)."""
    from trl.trainer.utils import FusedCausalLMOutput

    if not isinstance(out, FusedCausalLMOutput) or out.log_probs is None:
        raise TRLTapError(
            f"TRL's log-prob forward returned {type(out).__name__}, not its fused head's "
            "FusedCausalLMOutput with log_probs: set tap.topk > 0 to compute the statistics from "
            "the lm_head instead"
        )
    lp = out.log_probs.detach()
    if tuple(lp.shape) != (shape[0], shape[1] - 1):
        raise TRLTapError(
            f"TRL's log_probs are {tuple(lp.shape)}, expected [B, T−1] = {(shape[0], shape[1] - 1)} "
            "(a prompt-learning PEFT method adds virtual tokens the Tap cannot follow)"
        )
    return torch.nn.functional.pad(lp, (0, 1))


def _parts(model: nn.Module) -> tuple[Any, Any, Any, Any]:
    from draft_align.hf.parts import decoder_parts

    return decoder_parts(model)
