"""Policy-side Tap: what an RL job calls to ship a token-budgeted sample of its forward pass to the sidecar.

The RL job wraps the forward passes it already runs (log-prob or training pass) in ``capturing()`` and
hands each micro-batch's logits to ``submit()``; ``end_step()`` packs what was kept into ``TapBatch``
messages and offers them to a non-blocking sink; ``head_sync()`` ships the final norm and lm_head rows
once per policy version.  No extra forward pass, no blocking send, drops are counted.

Sampling (per RL step, streaming, no step total known in advance): every sequence gets a key
u ~ U(0, 1); the step keeps the longest run of sequences in ascending key order whose token total fits
``tokens_per_step`` — a bottom-k sketch with a token budget (:class:`TokenBudgetSketch`).  Every
ordering of the step's sequences is equally likely, so equal-length sequences are kept with equal
probability; a longer sequence is kept less often than a shorter one (it is more often the one that
overflows the budget).
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from draft_align.hf.capture import HFTap, TapError
from draft_align.hf.parts import decoder_parts
from draft_align.wire.messages import HeadSync, WireError, pack_sequences

logger = logging.getLogger(__name__)


class PolicyTapError(TapError):
    """Bad input to a policy tap (shapes, masks, vocab, call order)."""


@runtime_checkable
class TapSink(Protocol):
    """Where finished messages go (the ZeroMQ ``TapSender``; a list in tests)."""

    def offer(self, message: Any) -> bool:
        """Queue ``message`` without blocking; False when it was refused (queue full, peer gone)."""
        ...


@runtime_checkable
class PolicyTap(Protocol):
    """What an RL job calls, whatever its framework (HF transformers here, Megatron elsewhere)."""

    def head_sync(self, policy_version: int, draft_to_target: torch.Tensor) -> bool:
        """Offer a HeadSync (final norm, lm_head rows of the draft vocab); True when the sink took it."""
        ...

    def capturing(self) -> contextlib.AbstractContextManager[Any]:
        """Hooks attached only inside; the RL job runs its own forward passes within."""
        ...

    def submit(
        self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
        logits: torch.Tensor, policy_version: int, step: int, temperature: float,
    ) -> None:
        """Offer the micro-batch whose forward just ran to this step's sample."""
        ...

    def end_step(self) -> int:
        """Pack and offer the step's sample; returns tokens the sink accepted."""
        ...

    def stats(self) -> dict[str, int]:
        """Running counters since construction."""
        ...


def generator_for(seed: int, rank: int) -> torch.Generator:
    """CPU generator seeded from (seed, rank): ranks of one job draw independent keys, reproducibly."""
    digest = hashlib.sha256(f"draft_align.policy_tap:{int(seed)}:{int(rank)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class TokenBudgetSketch:
    """Streaming uniform sample of whole sequences under a token budget (one RL step).

    Keys u_i ~ U(0, 1).  After any prefix of the stream the kept set is
    ``{i : Σ_{j: u_j ≤ u_i} n_j ≤ budget}`` over the sequences seen so far (too-long ones excluded):
    the smallest keys whose token total fits.  Online: insert, evict largest keys while over budget, and
    remember the smallest evicted key τ — a later sequence with u ≥ τ can never be in the prefix.
    The result does not depend on how the stream is split into calls.
    """

    def __init__(self, budget: int, generator: torch.Generator, max_seq_tokens: int | None = None) -> None:
        if int(budget) < 1:
            raise PolicyTapError(f"token budget must be ≥ 1, got {budget}")
        self.budget = int(budget)
        self.max_seq_tokens = self.budget if max_seq_tokens is None else min(self.budget, int(max_seq_tokens))
        self.generator = generator
        self.too_long = 0  # sequences longer than max_seq_tokens, over the sketch's lifetime
        self._next_handle = 0
        self.reset()

    def reset(self) -> list[int]:
        """Start a new step; returns the handles kept in the step that ends, in admission order."""
        kept = sorted(h for _, h in getattr(self, "_heap", []))
        self._heap: list[tuple[float, int]] = []  # (−key, handle): max-heap on key
        self._tokens: dict[int, int] = {}
        self.tokens = 0
        self.threshold = 1.0  # τ: smallest evicted key of this step
        return kept

    def kept(self) -> list[int]:
        """Handles kept so far this step, in admission order."""
        return sorted(h for _, h in self._heap)

    def add(self, n_tokens: Sequence[int], keys: Sequence[float] | None = None) -> tuple[list[int | None], list[int]]:
        """Offer sequences of ``n_tokens`` each (keys drawn from the generator unless given).

        Returns (one handle per sequence, None where it is not kept after this call; handles of earlier
        sequences evicted by this call).
        """
        n = len(n_tokens)
        if keys is None:
            keys = torch.rand(n, generator=self.generator, dtype=torch.float64).tolist()
        elif len(keys) != n:
            raise PolicyTapError(f"{len(keys)} keys for {n} sequences")
        handles: list[int | None] = [None] * n
        for i, (length, u) in enumerate(zip(n_tokens, keys, strict=True)):
            length = int(length)
            if length > self.max_seq_tokens:
                self.too_long += 1
                continue
            if u >= self.threshold:
                continue
            h = self._next_handle
            self._next_handle += 1
            heapq.heappush(self._heap, (-float(u), h))
            self._tokens[h] = length
            self.tokens += length
            handles[i] = h
        evicted: list[int] = []
        while self.tokens > self.budget:
            neg_u, h = heapq.heappop(self._heap)
            self.threshold = -neg_u
            self.tokens -= self._tokens.pop(h)
            evicted.append(h)
        gone = set(evicted)
        fresh = {h for h in handles if h is not None}
        return [None if h in gone else h for h in handles], [h for h in evicted if h not in fresh]


@dataclass
class KeptSequence:
    """One kept sequence, already copied off the forward pass into host memory.

    ``tensors`` uses the wire names: input_ids [L] int64, loss_mask [L] bool, aux_hidden [L, n_aux·H] bf16,
    final_hidden [L, H] bf16 (post-norm, when sent), next_logprob [L] f32, logit_lse [L] f32,
    topk_ids [L, K] int64 and topk_logprobs [L, K] f32 (when K ≥ 1).
    """

    step: int
    policy_version: int
    temperature: float
    n_tokens: int
    tensors: dict[str, torch.Tensor]
    ready: Any = None  # torch.cuda.Event recorded after the non-blocking device→host copies


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
            "tokens_seen": self.tokens_seen, "sequences_seen": self.sequences_seen,
            "tokens_kept": self.tokens_kept, "sequences_kept": self.sequences_kept,
            "tokens_offered": self.tokens_offered, "messages_offered": self.messages_offered,
            "messages_dropped": self.messages_dropped, "messages_invalid": self.messages_invalid,
            "tokens_dropped": self.tokens_dropped, "too_long": too_long, "too_short": self.too_short,
            "no_response": self.no_response, "head_syncs": self.head_syncs,
            "head_syncs_dropped": self.head_syncs_dropped,
        }


def logit_stats(
    logits: torch.Tensor, input_ids: torch.Tensor, topk: int, max_elements: int = 1 << 26
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-token policy statistics of one sequence, at temperature 1, in float32.

    logits [L, V], input_ids [L] →
      next_logprob [L]: log_softmax(logits[t])[x_{t+1}], 0 at t = L−1
      logit_lse [L]:    logsumexp(logits[t])
      topk_ids [L, K], topk_logprobs [L, K] (None when topk = 0): the K most likely next tokens
    Works in chunks of ≤ ``max_elements`` logits so a long sequence never materialises [L, V] in float32.
    """
    length, vocab = logits.shape
    dev = logits.device
    nxt = torch.zeros(length, dtype=torch.float32, device=dev)
    lse = torch.empty(length, dtype=torch.float32, device=dev)
    k_ids = torch.empty(length, topk, dtype=torch.int64, device=dev) if topk else None
    k_lp = torch.empty(length, topk, dtype=torch.float32, device=dev) if topk else None
    ids = input_ids.to(device=dev, dtype=torch.int64)
    rows = max(1, max_elements // max(vocab, 1))
    for s in range(0, length, rows):
        e = min(length, s + rows)
        lg = logits[s:e].float()  # [c, V]
        z = torch.logsumexp(lg, dim=-1)  # [c]
        lse[s:e] = z
        last = min(e, length - 1)  # positions s..last−1 have a next token
        if last > s:
            tgt = ids[s + 1 : last + 1, None]  # [c', 1]
            nxt[s:last] = lg[: last - s].gather(1, tgt).squeeze(1) - z[: last - s]
        if topk:
            vals, idx = lg.topk(topk, dim=-1)
            k_lp[s:e] = vals - z[:, None]
            k_ids[s:e] = idx
    return nxt, lse, k_ids, k_lp


def to_host(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous host copy of ``x`` in ``dtype`` (non-blocking into pinned memory from CUDA)."""
    x = x.detach()
    if x.device.type == "cuda":
        out = torch.empty(tuple(x.shape), dtype=dtype, pin_memory=True)
        out.copy_(x.to(dtype), non_blocking=True)
        return out
    # an explicit copy: a slice of the batch would otherwise keep the whole batch's storage alive
    return x.to(device="cpu", dtype=dtype, copy=True).contiguous()


def _norm_eps(norm: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, name, None)
        if isinstance(value, int | float) and value > 0:
            return float(value)
    raise PolicyTapError(f"{type(norm).__name__}: final norm has no variance_epsilon/eps attribute")


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
    """The constructor arguments every policy tap shares."""
    if not isinstance(run_id, str) or not run_id:
        raise PolicyTapError("run_id must be a non-empty string")
    if not hasattr(sink, "offer"):
        raise PolicyTapError(f"sink {type(sink).__name__} has no offer(message) -> bool")
    if int(max_tokens_per_message) < 2:
        raise PolicyTapError(f"max_tokens_per_message must be ≥ 2, got {max_tokens_per_message}")
    if int(tokens_per_step) < 2:
        raise PolicyTapError(f"tokens_per_step must be ≥ 2, got {tokens_per_step}")


def check_step_args(policy_version: int, step: int, temperature: float) -> None:
    """``submit()``'s scalar arguments: all ≥ 0."""
    if int(policy_version) < 0 or int(step) < 0:
        raise PolicyTapError(f"policy_version and step must be ≥ 0, got {policy_version}, {step}")
    if not float(temperature) >= 0.0:
        raise PolicyTapError(f"temperature must be ≥ 0, got {temperature}")


def host_masks(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor]:
    """Check input_ids [B, T] (integer) and return ((B, T), attention_mask, loss_mask as bool [B, T] on the host)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise PolicyTapError(f"input_ids must be a [B, T] tensor, got {getattr(input_ids, 'shape', input_ids)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise PolicyTapError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    shape = (int(input_ids.shape[0]), int(input_ids.shape[1]))
    return shape, as_binary("attention_mask", attention_mask, shape), as_binary("loss_mask", loss_mask, shape)


def host_ids(input_ids: torch.Tensor, valid: torch.Tensor, response: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """input_ids [B, T] as int64 on the host, after checking the masks [B, T] (right-padded, loss only on
    valid tokens) and that valid ids are in 0..vocab_size−1."""
    if valid.shape[1] > 1 and bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise PolicyTapError("attention_mask must be right-padded (each row's valid tokens a prefix)")
    if bool((response & ~valid).any()):
        raise PolicyTapError("loss_mask marks padding positions (attention_mask == 0)")
    ids_host = input_ids.detach().to("cpu").to(torch.int64)
    if bool(((ids_host < 0) | (ids_host >= vocab_size))[valid].any()):
        raise PolicyTapError(f"input_ids outside 0..{vocab_size - 1} at valid positions")
    return ids_host


def eligible_rows(valid: torch.Tensor, response: torch.Tensor, counters: TapCounters) -> tuple[list[int], list[int]]:
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
        if n < 2:
            counters.too_short += 1
        elif not has_response[b]:
            counters.no_response += 1
        else:
            rows.append(b)
    return lengths, rows


def host_tensors(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden: torch.Tensor, final_hidden: torch.Tensor | None,
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


def step_chunks(
    sketch: TokenBudgetSketch, pending: dict[int, KeptSequence], counters: TapCounters, max_tokens: int
) -> list[list[KeptSequence]]:
    """End the step: take its kept sequences off ``pending`` (waiting for their host copies), count them,
    and split them into message chunks of ≤ ``max_tokens`` tokens with one (policy version, step,
    temperature) each."""
    kept = [pending.pop(h) for h in sketch.reset()]
    pending.clear()
    for ev in {id(s.ready): s.ready for s in kept if s.ready is not None}.values():
        ev.synchronize()
    counters.sequences_kept += len(kept)
    counters.tokens_kept += sum(s.n_tokens for s in kept)
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


def ship(
    chunks: Sequence[list[KeptSequence]], build: Callable[[list[KeptSequence]], Any], sink: TapSink,
    counters: TapCounters, who: str,
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
        raise PolicyTapError(f"draft_to_target must be a non-empty 1-D integer tensor, got {d2t.dtype} "
                             f"{tuple(d2t.shape)}")
    d2t = d2t.detach().to("cpu", torch.int64)
    if bool(((d2t < 0) | (d2t >= vocab_size)).any()):
        raise PolicyTapError(f"draft_to_target ids outside 0..{vocab_size - 1}")
    if int(d2t.unique().numel()) != int(d2t.numel()):
        raise PolicyTapError("draft_to_target ids must be distinct")
    return d2t


def offer_head_sync(sink: TapSink, message: HeadSync, counters: TapCounters, who: str) -> bool:
    """Offer ``message`` to ``sink`` and count it; True when the sink took it."""
    ok = bool(sink.offer(message))
    if ok:
        counters.head_syncs += 1
    else:
        counters.head_syncs_dropped += 1
        logger.warning("%s: sink refused HeadSync for policy version %d", who, message.policy_version)
    return ok


class HFPolicyTap:
    """:class:`PolicyTap` for HF transformers causal LMs (Llama/Qwen/Mistral layout, or the inner model
    of a peft ``PeftModel``: ``peft_model.base_model.model``).

    ``aux_layer_ids`` are HF ``hidden_states`` indices (see :class:`~draft_align.hf.capture.HFTap`).
    Per RL step at most ``tokens_per_step`` tokens are kept, as whole sequences sampled uniformly
    (:class:`TokenBudgetSketch`); they are shipped in TapBatches of ≤ ``max_tokens_per_message`` tokens,
    so a sequence longer than min(tokens_per_step, max_tokens_per_message) is never kept (``too_long``).
    Rows with fewer than 2 valid tokens (``too_short``) or no response token (``no_response``) are
    skipped: the draft has nothing to learn from them.

    ``logits`` given to :meth:`submit` must be the policy's raw logits (temperature 1, not divided by
    the sampling temperature): next_logprob, logit_lse and top-k are defined at temperature 1.
    """

    def __init__(
        self,
        model: nn.Module,
        aux_layer_ids: Sequence[int],
        sink: TapSink,
        *,
        run_id: str,
        tokens_per_step: int,
        max_tokens_per_message: int = 16384,
        send_final: bool = True,
        topk: int = 1,
        rank: int = 0,
        seed: int = 0,
    ) -> None:
        check_tap_args(run_id, sink, tokens_per_step, max_tokens_per_message)
        if int(rank) < 0:
            raise PolicyTapError(f"rank must be ≥ 0, got {rank}")
        _, _, norm, lm_head = decoder_parts(model)
        self.model = model
        self.sink = sink
        self.run_id = run_id
        self.send_final = bool(send_final)
        self.rank = int(rank)
        self.max_tokens_per_message = int(max_tokens_per_message)
        self._tap = HFTap(model, tuple(aux_layer_ids), capture_final=self.send_final)
        self.aux_layer_ids = self._tap.aux_layer_ids
        self.hidden_size = int(norm.weight.shape[0])
        self.vocab_size = int(lm_head.weight.shape[0])
        if not 0 <= int(topk) <= self.vocab_size:
            raise PolicyTapError(f"topk must be in 0..{self.vocab_size}, got {topk}")
        self.topk = int(topk)
        self._sketch = TokenBudgetSketch(
            int(tokens_per_step), generator_for(seed, rank), max_seq_tokens=self.max_tokens_per_message
        )
        self._pending: dict[int, KeptSequence] = {}  # handle → kept sequence of the current step
        self._capturing = False
        self._batch_id = 0
        self._c = TapCounters()

    # -- capture ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def capturing(self) -> Iterator[HFPolicyTap]:
        """Attach the hooks for the forward passes run inside; they are removed on exit."""
        if self._capturing:
            raise PolicyTapError("capturing() is already active (not reentrant)")
        self._tap.attach()
        self._capturing = True
        try:
            yield self
        finally:
            self._capturing = False
            self._tap.detach()

    def submit(
        self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
        logits: torch.Tensor, policy_version: int, step: int, temperature: float,
    ) -> None:
        """Offer the micro-batch whose forward just ran inside ``capturing()`` to this step's sample.

        input_ids, attention_mask, loss_mask [B, T] (right-padded: row b's valid tokens are the prefix
        where attention_mask is 1; loss_mask marks response tokens, never padding); logits [B, T, V].
        """
        if not self._capturing:
            raise PolicyTapError("submit() must be called inside `with tap.capturing():`, after the forward pass")
        try:
            cap = self._tap.pop()
        except TapError as e:
            raise PolicyTapError(
                "submit() without a captured forward pass: run the model on this batch inside capturing() first"
            ) from e
        check_step_args(policy_version, step, temperature)
        shape, valid, response = host_masks(input_ids, attention_mask, loss_mask)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != shape:
            raise PolicyTapError(f"logits must be [B, T, V] with [B, T] = {shape}, got {tuple(logits.shape)}")
        if int(logits.shape[2]) != self.vocab_size:
            raise PolicyTapError(f"logits vocab {logits.shape[2]} ≠ model vocab {self.vocab_size}")
        if tuple(cap.aux.shape[:2]) != shape:
            raise PolicyTapError(
                f"captured forward was on a [{cap.aux.shape[0]}, {cap.aux.shape[1]}] batch, submit got {shape}:"
                " submit() must follow the forward pass of the same batch"
            )
        ids_host = host_ids(input_ids, valid, response, self.vocab_size)

        lengths, rows = eligible_rows(valid, response, self._c)
        handles, evicted = self._sketch.add([lengths[b] for b in rows])
        for h in evicted:
            del self._pending[h]  # released: its host copies are freed
        ready = None
        for b, h in zip(rows, handles, strict=True):
            if h is None:
                continue
            n = lengths[b]
            stats = logit_stats(logits[b, :n].detach(), input_ids[b, :n], self.topk)
            final = cap.final[b, :n] if self.send_final else None
            tensors = host_tensors(ids_host[b, :n], response[b, :n], cap.aux[b, :n], final, stats)
            self._pending[h] = KeptSequence(int(step), int(policy_version), float(temperature), n, tensors)
            if cap.aux.device.type == "cuda":
                if ready is None:
                    ready = torch.cuda.Event()
                self._pending[h].ready = ready
        if ready is not None:
            ready.record(torch.cuda.current_stream(cap.aux.device))  # the stream the copies were queued on

    # -- shipping --------------------------------------------------------------------------------------

    def end_step(self) -> int:
        """Pack the step's kept sequences into TapBatches (≤ max_tokens_per_message tokens each), offer
        them to the sink and start a new step.  Returns the tokens of messages the sink accepted."""
        chunks = step_chunks(self._sketch, self._pending, self._c, self.max_tokens_per_message)
        return ship(chunks, self._tap_batch, self.sink, self._c, "tap")

    def _tap_batch(self, seqs: list[KeptSequence]) -> Any:
        """One TapBatch of ``seqs`` (same policy version, step and temperature), validated as the wire
        encoder would; raises WireError (e.g. NaN logits gave NaN log-probs)."""
        head = seqs[0]
        batch_id = self._batch_id
        self._batch_id += 1  # also for a message that is refused or invalid: gaps in batch_id show losses
        return pack_sequences(
            [s.tensors for s in seqs], run_id=self.run_id, policy_version=head.policy_version,
            source_rank=self.rank, batch_id=batch_id, step=head.step, aux_layer_ids=self.aux_layer_ids,
            hidden_size=self.hidden_size, vocab_size=self.vocab_size,
            final_norm="post" if self.send_final else None, temperature=head.temperature,
        )

    def head_sync(self, policy_version: int, draft_to_target: torch.Tensor) -> bool:
        """Offer HeadSync for ``policy_version``: final norm weight [H] (float32), its eps, and the
        lm_head rows [Vd, H] (bfloat16) of the draft vocabulary ``draft_to_target`` [Vd]."""
        d2t = check_head_sync_args(policy_version, draft_to_target, self.vocab_size)
        _, _, norm, lm_head = decoder_parts(self.model)
        if hasattr(lm_head, "base_layer"):
            raise PolicyTapError("lm_head is adapter-wrapped: its .weight would miss the adapter's update")
        if getattr(norm, "weight", None) is None:
            raise PolicyTapError(f"{type(norm).__name__}: final norm has no weight")
        weight = lm_head.weight.detach()
        rows = weight[d2t.to(weight.device)].to(torch.bfloat16).to("cpu").contiguous()  # a copy (gather)
        message = HeadSync(
            run_id=self.run_id, policy_version=int(policy_version), hidden_size=self.hidden_size,
            vocab_size=self.vocab_size, norm_eps=_norm_eps(norm),
            norm_weight=norm.weight.detach().to("cpu", torch.float32).clone(), draft_to_target=d2t.clone(),
            rows=rows,
        )
        return offer_head_sync(self.sink, message, self._c, "tap")

    def stats(self) -> dict[str, int]:
        """Counters since construction (too_long from the budget sketch)."""
        return self._c.as_dict(self._sketch.too_long)
