"""What the policy taps share between capture and the sink: the capture session, the step's sample,
host copies of kept rows, message chunks and their shipping, HeadSync checks (the per-token logit statistics
are :mod:`draft_align.tap.logit_stats`).  The framework adapters (:mod:`draft_align.tap.hf`,
:mod:`draft_align.tap.megatron`) add only how their model is hooked and how its tensors are laid out.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import torch

from draft_align.conventions import temperature_ok, temperature_rule
from draft_align.hf.capture import TapError
from draft_align.tap.budget import MIN_SEQUENCE_TOKENS, TokenBudgetSketch, check_budgets
from draft_align.tap.protocol import PolicyTapError, TapSink
from draft_align.wire.messages import HeadSync
from draft_align.wire.schema import WireError

logger = logging.getLogger(__name__)

#: How a policy tap's rows are padded (see :func:`host_ids`).
Padding = Literal["right", "block"]

C = TypeVar("C")
C_co = TypeVar("C_co", covariant=True)


class Hooks(Protocol[C_co]):
    """Forward hooks on a policy model (:class:`~draft_align.hf.capture.HFTap`,
    :class:`~draft_align.tap.megatron_hooks.MegatronTap`)."""

    def attach(self) -> Any: ...

    def detach(self) -> None: ...

    def pop(self) -> C_co:
        """A captured forward pass; raises TapError when none is there."""
        ...


class CaptureSession(Generic[C]):
    """The capture half of the :class:`~draft_align.tap.protocol.PolicyTap` contract: hooks attached only
    inside :meth:`capturing` (not reentrant), and one captured forward pass taken by each ``submit()``."""

    def __init__(self, hooks: Hooks[C]) -> None:
        self.hooks = hooks
        self.active = False

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Attach the hooks for the forward passes run inside; they are removed on exit."""
        if self.active:
            raise PolicyTapError("capturing() is already active (not reentrant)")
        self.hooks.attach()
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.hooks.detach()

    def take(self) -> C:
        """The capture of the forward pass ``submit()`` follows; PolicyTapError outside :meth:`capturing`
        or when no forward pass ran."""
        if not self.active:
            raise PolicyTapError(
                "submit() must be called inside `with tap.capturing():`, after the forward pass"
            )
        try:
            return self.hooks.pop()
        except TapError as e:
            raise PolicyTapError(
                "submit() without a captured forward pass: run the model on this batch inside capturing() first"
            ) from e


@dataclass
class KeptSequence:
    """One kept sequence, already copied off the forward pass into host memory.

    ``tensors`` uses the wire names: input_ids [L] int64, loss_mask [L] bool, aux_hidden [L, n_aux·H] bf16,
    final_hidden [L, H] bf16 (post-norm, when sent), next_logprob [L] f32, logit_lse [L] f32,
    topk_ids [L, K] int64 and topk_logprobs [L, K] f32 (when K ≥ 1).  The statistics are defined from
    position ``stats_from`` on and 0 before it (the wire's ``stats_from``).
    """

    step: int
    policy_version: int
    temperature: float
    n_tokens: int
    tensors: dict[str, torch.Tensor]
    ready: Any = None  # torch.cuda.Event recorded after the non-blocking device→host copies
    stats_from: int = 0


@dataclass
class TapCounters:
    """A policy tap's running counters since construction."""

    tokens_seen: int = 0
    sequences_seen: int = 0
    tokens_kept: int = 0
    sequences_kept: int = 0
    tokens_offered: int = 0
    messages_offered: int = 0
    messages_dropped: int = 0
    messages_invalid: int = 0
    tokens_dropped: int = 0
    too_short: int = 0
    no_response: int = 0
    head_syncs: int = 0
    head_syncs_dropped: int = 0

    def as_dict(self, too_long: int) -> dict[str, int]:
        """The counters as :meth:`PolicyTap.stats` reports them (``too_long`` from the budget sketch)."""
        return {
            "tokens_seen": self.tokens_seen,
            "sequences_seen": self.sequences_seen,
            "tokens_kept": self.tokens_kept,
            "sequences_kept": self.sequences_kept,
            "tokens_offered": self.tokens_offered,
            "messages_offered": self.messages_offered,
            "messages_dropped": self.messages_dropped,
            "messages_invalid": self.messages_invalid,
            "tokens_dropped": self.tokens_dropped,
            "too_long": too_long,
            "too_short": self.too_short,
            "no_response": self.no_response,
            "head_syncs": self.head_syncs,
            "head_syncs_dropped": self.head_syncs_dropped,
        }


def to_host(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous host copy of ``x`` in ``dtype`` (non-blocking into pinned memory from CUDA)."""
    x = x.detach()
    if x.device.type == "cuda":
        out = torch.empty(tuple(x.shape), dtype=dtype, pin_memory=True)
        out.copy_(x.to(dtype), non_blocking=True)
        return out
    # an explicit copy: a slice of the batch would otherwise keep the whole batch's storage alive
    return x.to(device="cpu", dtype=dtype, copy=True).contiguous()


def as_binary(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """[B, T] 0/1 mask of any dtype → bool on the host, with a clear error for anything else."""
    if not isinstance(x, torch.Tensor):
        raise PolicyTapError(f"{name} must be a tensor, got {type(x).__name__}")
    if tuple(x.shape) != shape:
        raise PolicyTapError(f"{name} has shape {tuple(x.shape)}, expected {shape} (the shape of input_ids)")
    host = x.detach().to("cpu")
    if host.dtype != torch.bool:
        if not bool(((host == 0) | (host == 1)).all()):
            raise PolicyTapError(f"{name} must hold only 0/1 values")
        host = host != 0
    return host


def check_tap_args(run_id: str, sink: Any, tokens_per_step: int, max_tokens_per_message: int) -> None:
    """The constructor arguments every policy tap shares (budgets: :func:`~draft_align.tap.budget.check_budgets`)."""
    if not isinstance(run_id, str) or not run_id:
        raise PolicyTapError("run_id must be a non-empty string")
    if not hasattr(sink, "offer"):
        raise PolicyTapError(f"sink {type(sink).__name__} has no offer(message) -> bool")
    check_budgets(tokens_per_step, max_tokens_per_message)


def check_topk(topk: int, vocab_size: int) -> int:
    """``topk`` (top-k log-probs per token, 0: none) as an int, refused outside 0..vocab_size."""
    if not 0 <= int(topk) <= vocab_size:
        raise PolicyTapError(f"topk must be in 0..{vocab_size}, got {topk}")
    return int(topk)


def check_step_args(policy_version: int, step: int, temperature: float) -> None:
    """``submit()``'s scalar arguments: versions ≥ 0, a temperature the wire carries
    (conventions.temperature_ok)."""
    if int(policy_version) < 0 or int(step) < 0:
        raise PolicyTapError(f"policy_version and step must be ≥ 0, got {policy_version}, {step}")
    if not temperature_ok(float(temperature)):
        raise PolicyTapError(f"temperature must be {temperature_rule()}, got {temperature}")


def host_masks(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor]:
    """Check input_ids [B, T] (integer) and return ((B, T), attention_mask, loss_mask as bool [B, T] on the host)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise PolicyTapError(
            f"input_ids must be a [B, T] tensor, got {getattr(input_ids, 'shape', input_ids)}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise PolicyTapError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    shape = (int(input_ids.shape[0]), int(input_ids.shape[1]))
    return shape, as_binary("attention_mask", attention_mask, shape), as_binary("loss_mask", loss_mask, shape)


def host_ids(
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    response: torch.Tensor,
    vocab_size: int,
    padding: Padding = "right",
) -> torch.Tensor:
    """input_ids [B, T] as int64 on the host, after checking the masks [B, T] (``padding``: ``right`` — each
    row's valid tokens a prefix —, or ``block`` — one contiguous block, left and/or right padded —; loss only
    on valid tokens) and that valid ids are in 0..vocab_size−1."""
    if padding == "right":
        if valid.shape[1] > 1 and bool((valid[:, 1:] & ~valid[:, :-1]).any()):
            raise PolicyTapError("attention_mask must be right-padded (each row's valid tokens a prefix)")
    elif padding == "block":
        if valid.shape[1] > 1 and bool(((valid[:, 1:] & ~valid[:, :-1]).sum(dim=1) + valid[:, 0] > 1).any()):
            raise PolicyTapError(
                "attention_mask must hold one contiguous block of valid tokens per row "
                "(left- and/or right-padded)"
            )
    else:
        raise PolicyTapError(f"padding {padding!r}: expected 'right' or 'block'")
    if bool((response & ~valid).any()):
        raise PolicyTapError("loss_mask marks padding positions (attention_mask == 0)")
    ids_host = input_ids.detach().to("cpu").to(torch.int64)
    if bool(((ids_host < 0) | (ids_host >= vocab_size))[valid].any()):
        raise PolicyTapError(f"input_ids outside 0..{vocab_size - 1} at valid positions")
    return ids_host


def row_starts(valid: torch.Tensor) -> list[int]:
    """The first valid position of each row of ``valid`` [B, T] bool (0 for an empty row)."""
    return valid.to(torch.int8).argmax(dim=1).tolist()


def eligible_rows(
    valid: torch.Tensor, response: torch.Tensor, counters: TapCounters
) -> tuple[list[int], list[int]]:
    """Count a micro-batch's non-empty rows; returns (valid length per row, the rows worth sampling: ≥ 2
    tokens and at least one response token)."""
    lengths = valid.sum(dim=1).tolist()
    has_response = response.any(dim=1).tolist()
    rows: list[int] = []
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        counters.sequences_seen += 1
        counters.tokens_seen += n
        if n < MIN_SEQUENCE_TOKENS:
            counters.too_short += 1
        elif not has_response[b]:
            counters.no_response += 1
        else:
            rows.append(b)
    return lengths, rows


def host_tensors(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    aux_hidden: torch.Tensor,
    final_hidden: torch.Tensor | None,
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None,
) -> dict[str, torch.Tensor]:
    """One kept sequence's wire tensors (see :class:`KeptSequence`) on the host: input_ids [L] and loss_mask
    [L] (already host, cloned), aux_hidden [L, n_aux·H], final_hidden [L, H] or None, and the
    :func:`logit_stats` of the sequence or None."""
    tensors = {
        "input_ids": input_ids.clone(),
        "loss_mask": loss_mask.clone(),
        "aux_hidden": to_host(aux_hidden, torch.bfloat16),
    }
    if final_hidden is not None:
        tensors["final_hidden"] = to_host(final_hidden, torch.bfloat16)
    if stats is not None:
        nxt, lse, k_ids, k_lp = stats
        tensors["next_logprob"] = to_host(nxt, torch.float32)
        tensors["logit_lse"] = to_host(lse, torch.float32)
        if k_ids is not None and k_lp is not None:
            tensors["topk_ids"] = to_host(k_ids, torch.int64)
            tensors["topk_logprobs"] = to_host(k_lp, torch.float32)
    return tensors


class StepSample:
    """One tap's sample of the current RL step: the budget sketch, the kept sequences' host copies (by
    sketch handle) and the running counters.  Both framework adapters keep their step in one of these."""

    def __init__(self, tokens_per_step: int, generator: torch.Generator, max_seq_tokens: int) -> None:
        self.sketch = TokenBudgetSketch(int(tokens_per_step), generator, max_seq_tokens=max_seq_tokens)
        self.pending: dict[int, KeptSequence] = {}  # handle → kept sequence of the current step
        self.counters = TapCounters()

    def admit(self, valid: torch.Tensor, response: torch.Tensor) -> tuple[list[int], list[tuple[int, int]]]:
        """Count a micro-batch's rows (masks [B, T] bool) and offer the eligible ones to the sketch,
        releasing the earlier sequences it evicts.  Returns (valid length per row, (row, handle) of the
        rows kept for now, in row order); the caller stores each kept row with :meth:`keep`."""
        lengths, rows = eligible_rows(valid, response, self.counters)
        handles, evicted = self.sketch.add([lengths[b] for b in rows])
        for h in evicted:
            self.pending.pop(h, None)  # released: its host copies are freed
        return lengths, [(b, h) for b, h in zip(rows, handles, strict=True) if h is not None]

    def keep(self, handle: int, sequence: KeptSequence) -> None:
        self.pending[handle] = sequence

    def end_step(self, max_tokens: int) -> list[list[KeptSequence]]:
        """End the step: take its kept sequences (waiting for their host copies), count them, and split
        them into message chunks of ≤ ``max_tokens`` tokens with one (policy version, step, temperature)
        each.  The next step starts empty."""
        kept = [self.pending.pop(h) for h in self.sketch.reset()]
        self.pending.clear()
        for ev in {id(s.ready): s.ready for s in kept if s.ready is not None}.values():
            ev.synchronize()
        self.counters.sequences_kept += len(kept)
        self.counters.tokens_kept += sum(s.n_tokens for s in kept)
        groups: dict[tuple[int, int, float], list[KeptSequence]] = {}
        for s in kept:
            groups.setdefault((s.policy_version, s.step, s.temperature), []).append(s)
        chunks: list[list[KeptSequence]] = []
        for group in groups.values():
            chunk: list[KeptSequence] = []
            total = 0
            for s in group:
                if chunk and total + s.n_tokens > max_tokens:
                    chunks.append(chunk)
                    chunk, total = [], 0
                chunk.append(s)
                total += s.n_tokens
            if chunk:
                chunks.append(chunk)
        return chunks

    def stats(self) -> dict[str, int]:
        """The counters as :meth:`~draft_align.tap.protocol.PolicyTap.stats` reports them."""
        return self.counters.as_dict(self.sketch.too_long)


def ship(
    chunks: Sequence[list[KeptSequence]],
    build: Callable[[list[KeptSequence]], Any],
    sink: TapSink,
    counters: TapCounters,
    who: str,
) -> int:
    """Offer ``build(chunk)`` for each chunk to ``sink``; counts what was offered, refused or invalid
    (``build`` raised WireError, e.g. NaN logits gave NaN log-probs: never let that kill the RL job).
    Returns the tokens of messages the sink accepted."""
    offered = dropped = 0
    for chunk in chunks:
        n = sum(s.n_tokens for s in chunk)
        try:
            message = build(chunk)
        except WireError as e:
            logger.error("%s: dropping an invalid message of %d tokens: %s", who, n, e)
            counters.messages_invalid += 1
            counters.tokens_dropped += n
            dropped += n
            continue
        if sink.offer(message):
            counters.messages_offered += 1
            counters.tokens_offered += n
            offered += n
        else:
            counters.messages_dropped += 1
            counters.tokens_dropped += n
            dropped += n
    if dropped:
        logger.warning("%s: dropped %d tokens this step (%d offered)", who, dropped, offered)
    return offered


def check_head_sync_args(policy_version: int, draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``head_sync()``'s arguments checked; returns draft_to_target [Vd] as int64 on the host."""
    if int(policy_version) < 0:
        raise PolicyTapError(f"policy_version must be ≥ 0, got {policy_version}")
    d2t = torch.as_tensor(draft_to_target)
    if d2t.dim() != 1 or d2t.numel() == 0 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise PolicyTapError(
            f"draft_to_target must be a non-empty 1-D integer tensor, got {d2t.dtype} {tuple(d2t.shape)}"
        )
    d2t = d2t.detach().to("cpu", torch.int64)
    if bool(((d2t < 0) | (d2t >= vocab_size)).any()):
        raise PolicyTapError(f"draft_to_target ids outside 0..{vocab_size - 1}")
    if int(d2t.unique().numel()) != int(d2t.numel()):
        raise PolicyTapError("draft_to_target ids must be distinct")
    return d2t


def head_sync_message(
    run_id: str,
    policy_version: int,
    hidden_size: int,
    vocab_size: int,
    norm_eps: float,
    norm_weight: torch.Tensor,
    draft_to_target: torch.Tensor,
    rows: torch.Tensor,
) -> HeadSync:
    """The HeadSync a tap offers, in the wire's dtypes and on the host (copies): the final norm's weight [H]
    as float32 and its eps, ``draft_to_target`` [Vd] (int64, host: :func:`check_head_sync_args`) and the
    lm_head rows [Vd, H] of the draft vocabulary as bfloat16."""
    return HeadSync(
        run_id=run_id,
        policy_version=int(policy_version),
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        norm_eps=float(norm_eps),
        norm_weight=norm_weight.detach().to("cpu", torch.float32).clone(),
        draft_to_target=draft_to_target.clone(),
        rows=rows.to(torch.bfloat16).to("cpu").contiguous(),
    )


def offer_head_sync(sink: TapSink, message: HeadSync, counters: TapCounters, who: str) -> bool:
    """Offer ``message`` to ``sink`` and count it; True when the sink took it."""
    ok = bool(sink.offer(message))
    if ok:
        counters.head_syncs += 1
    else:
        counters.head_syncs_dropped += 1
        logger.warning("%s: sink refused HeadSync for policy version %d", who, message.policy_version)
    return ok
