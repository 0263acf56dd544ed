"""The policy-side Tap for HF transformers causal LMs: what an RL job calls to ship a token-budgeted sample
of its forward pass to the sidecar (the contract: :mod:`draft_align.tap.protocol`; the sample:
:mod:`draft_align.tap.budget`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

import torch
from torch import nn

from draft_align.hf.capture import HFTap
from draft_align.hf.parts import decoder_parts
from draft_align.tap.base import TapBase, TapOptions
from draft_align.tap.logit_stats import (
    full_tensor,
    head_logit_stats,
    logit_stats,
    logprob_stats,
    pad_stats,
    stats_start,
)
from draft_align.tap.protocol import PolicyTapError, TapSink
from draft_align.tap.shipping import (
    KeptSequence,
    check_head_sync_args,
    check_step_args,
    host_ids,
    host_masks,
    host_tensors,
    row_starts,
)
from draft_align.wire.packing import pack_sequences


def _norm_eps(norm: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, name, None)
        if isinstance(value, int | float) and value > 0:
            return float(value)
    raise PolicyTapError(f"{type(norm).__name__}: final norm has no variance_epsilon/eps attribute")


def _row_temperatures(
    temperature: float | Sequence[float] | torch.Tensor, rows: int, policy_version: int, step: int
) -> list[float]:
    """One checked sampling temperature per row: ``temperature`` is one for all rows or [B] (one per row)."""
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 0:
        temperature = float(temperature)
    if isinstance(temperature, int | float):
        temps = [float(temperature)] * rows
    else:
        temps = [float(t) for t in torch.as_tensor(temperature).detach().reshape(-1).tolist()]
        if len(temps) != rows:
            raise PolicyTapError(
                f"temperature holds {len(temps)} values for {rows} rows: give one, or one per row"
            )
    for t in temps or [1.0]:
        check_step_args(policy_version, step, t)
    return temps


def _as_packed_row(x: Any) -> Any:
    """A packed forward's [N] tensor as its one row [1, N]; anything else as it is (checked by the caller)."""
    return x.reshape(1, -1) if isinstance(x, torch.Tensor) and x.dim() == 1 else x


class HFPolicyTap(TapBase):
    """:class:`~draft_align.tap.protocol.PolicyTap` for HF transformers causal LMs (Llama/Qwen/Mistral
    layout, or the inner model of a peft ``PeftModel``: ``peft_model.base_model.model``).

    The keyword options besides ``rank`` (the messages' ``source_rank``; with ``seed`` it seeds the sample) are
    every tap's: :class:`~draft_align.tap.base.TapOptions`.
    ``aux_layer_ids`` are HF ``hidden_states`` indices (see :class:`~draft_align.hf.capture.HFTap`).
    Per RL step at most ``tokens_per_step`` tokens are kept, as whole sequences sampled uniformly
    (:class:`~draft_align.tap.budget.TokenBudgetSketch`); they are shipped in TapBatches of
    ≤ ``max_tokens_per_message`` tokens, so a sequence longer than min(tokens_per_step,
    max_tokens_per_message) is never kept (``too_long``).
    Rows with fewer than 2 valid tokens (``too_short``) or no response token (``no_response``) are
    skipped: the draft has nothing to learn from them.

    ``logits`` given to :meth:`submit` must be the policy's raw logits (temperature 1, not divided by
    the sampling temperature): next_logprob, logit_lse and top-k are defined at temperature 1.  Where the
    job's pass never materialises logits (a fused LM head that computes log-probs only), ``logits=None``:
    the statistics of the kept rows are computed from the captured final state × the model's lm_head.
    Where that pass did compute the policy's log-prob of each next token at temperature 1 (TRL's fused head), pass
    it as ``next_logprob`` with ``logits=None`` and a tap built with ``topk=0``: ``logit_lse`` then follows from
    one lm_head row per position (:func:`~draft_align.tap.logit_stats.logprob_stats`), no [L, V] product.
    Either way they are computed only from the position before each kept row's first response token on
    (the only positions the sidecar scores against them) and sent as 0 before it, with the TapBatch's
    ``stats_from`` saying where they start (docs/wire.md).

    Under FSDP2 (``fully_shard``: the lm_head weight is a sharded DTensor) every rank must call
    :meth:`submit` for every micro-batch, and :meth:`head_sync` for every policy version: the head gather is
    collective.  With ``logits=None`` each submit gathers the head exactly once on every rank, whether or not
    that rank keeps a sequence of the micro-batch (ranks keep different numbers: each draws its own sample,
    and rows without a response are never kept), so the ranks' collectives always match.
    """

    _WHO = "tap"

    def __init__(
        self,
        model: nn.Module,
        aux_layer_ids: Sequence[int],
        sink: TapSink,
        *,
        rank: int = 0,
        **options: Unpack[TapOptions],
    ) -> None:
        super().__init__(sink, **options)
        if int(rank) < 0:
            raise PolicyTapError(f"rank must be ≥ 0, got {rank}")
        _, _, norm, lm_head = decoder_parts(model)
        self.model = model
        self.rank = int(rank)
        self._tap = HFTap(
            model, tuple(aux_layer_ids), capture_final=True
        )  # a reference; copied only when kept
        self.aux_layer_ids = self._tap.aux_layer_ids
        self.hidden_size = int(norm.weight.shape[0])
        self.vocab_size = int(lm_head.weight.shape[0])
        self._start(self._tap, self.rank)

    # -- capture (capturing(): TapBase's) --------------------------------------------------------------

    def submit(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        logits: torch.Tensor | None,
        policy_version: int,
        step: int,
        temperature: float | Sequence[float] | torch.Tensor,
        next_logprob: torch.Tensor | None = None,
    ) -> None:
        """Offer the micro-batch whose forward just ran inside ``capturing()`` to this step's sample.

        input_ids, attention_mask, loss_mask [B, T]: row b's valid tokens (attention_mask 1) are one
        contiguous block — right-padded, or a left-padded prompt followed by a right-padded response —;
        loss_mask marks response tokens, never padding.  logits [B, T, V], or None: computed for the kept
        rows only from the captured final state × lm_head (see the class docstring).  next_logprob [B, T]
        (only with logits None and topk 0): the policy's log-prob at temperature 1 of token t+1 at position t,
        read from the position before each row's first response token to its last-but-one valid token.
        temperature: the sampling temperature of every row, or one per row ([B]).
        """
        cap, shape, valid, response = self._take(input_ids, attention_mask, loss_mask)
        temps = _row_temperatures(temperature, shape[0], policy_version, step)
        self._check_outputs(shape, logits, next_logprob)
        if tuple(cap.aux.shape[:2]) != shape:
            raise PolicyTapError(
                f"captured forward was on a [{cap.aux.shape[0]}, {cap.aux.shape[1]}] batch, submit got {shape}:"
                " submit() must follow the forward pass of the same batch"
            )
        ids_host = host_ids(input_ids, valid, response, self.vocab_size, padding="block")

        def row(x: torch.Tensor, b: int, sl: slice) -> torch.Tensor:
            return x[b, sl]

        self._admit(
            cap,
            input_ids,
            ids_host,
            valid,
            response,
            row_starts(valid),
            logits,
            next_logprob,
            temps,
            int(policy_version),
            int(step),
            row,
        )

    def submit_packed(
        self,
        *,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | Sequence[int],
        loss_mask: torch.Tensor,
        logits: torch.Tensor | None,
        policy_version: int,
        step: int,
        temperature: float | Sequence[float] | torch.Tensor,
        next_logprob: torch.Tensor | None = None,
    ) -> None:
        """:meth:`submit` for a packed forward: the model ran on one row of B sequences laid end to end
        (padding-free; attention kept within each sequence by its position ids or cu_seqlens).

        input_ids [1, N] (or [N]); cu_seqlens [B + 1] int, 0 = cu_seqlens[0] < … < cu_seqlens[B] = N: sequence b
        is tokens cu_seqlens[b]:cu_seqlens[b+1]; loss_mask [1, N] (or [N]): response tokens; logits [1, N, V]
        or None; next_logprob [1, N] (or [N]) as in :meth:`submit`.  The captured pass may be longer than N (a
        packed row padded at its end, e.g. to a bucket length): the tail is ignored.
        """
        cap = self._capture.take()
        ids = _as_packed_row(input_ids)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or int(ids.shape[0]) != 1:
            raise PolicyTapError(
                f"packed input_ids must be [1, N] or [N], got {tuple(getattr(ids, 'shape', ()))}"
            )
        n = int(ids.shape[1])
        cu = torch.as_tensor(cu_seqlens).detach().to("cpu", torch.int64).reshape(-1)
        if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] <= cu[:-1]).any()):
            raise PolicyTapError(
                f"cu_seqlens must rise strictly from 0 to N = {n} (one boundary per sequence), got {cu.tolist()}"
            )
        lengths = cu.diff()
        bsz, width = int(lengths.numel()), int(lengths.max())
        _, _, flat_response = host_masks(ids, torch.ones_like(ids), _as_packed_row(loss_mask))
        # the packed row as right-padded [B, width] host masks (the sample and the checks see rows)
        valid = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        response = torch.zeros(bsz, width, dtype=torch.bool)
        response[valid] = flat_response[0]
        flat_ids = ids.detach().to("cpu", torch.int64)[0]
        ids_rows = torch.zeros(bsz, width, dtype=torch.int64)
        ids_rows[valid] = flat_ids
        temps = _row_temperatures(temperature, bsz, policy_version, step)
        nl = _as_packed_row(next_logprob)
        self._check_outputs((1, n), logits, nl)
        if int(cap.aux.shape[0]) != 1 or int(cap.aux.shape[1]) < n:
            raise PolicyTapError(
                f"captured forward was on a [{cap.aux.shape[0]}, {cap.aux.shape[1]}] batch, submit_packed got "
                f"[1, {n}]: submit_packed() must follow the packed forward pass of the same batch"
            )
        ids_host = host_ids(ids_rows, valid, response, self.vocab_size, padding="right")
        offsets = cu.tolist()
        device_ids = ids.to(cap.final.device if cap.final is not None else cap.aux.device)

        def row(x: torch.Tensor, b: int, sl: slice) -> torch.Tensor:
            o = offsets[b]
            return x[0, o + sl.start : o + sl.stop]

        self._admit(
            cap,
            device_ids,
            ids_host,
            valid,
            response,
            [0] * bsz,
            logits,
            nl,
            temps,
            int(policy_version),
            int(step),
            row,
        )

    def _check_outputs(
        self,
        shape: tuple[int, int],
        logits: torch.Tensor | None,
        next_logprob: torch.Tensor | None,
    ) -> None:
        """``logits`` [*shape, V] and ``next_logprob`` [*shape], each when given (shape: the forward's [B, T])."""
        if next_logprob is not None:
            if logits is not None or self.topk:
                raise PolicyTapError(
                    "next_logprob replaces the head pass only with logits=None and a tap built "
                    f"with topk=0 (it gives no top-k); got logits={logits is not None}, "
                    f"topk={self.topk}"
                )
            if not isinstance(next_logprob, torch.Tensor) or tuple(next_logprob.shape) != shape:
                raise PolicyTapError(
                    f"next_logprob must be [B, T] = {shape}, got {tuple(getattr(next_logprob, 'shape', ()))}"
                )
        if logits is not None:
            if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != shape:
                raise PolicyTapError(
                    f"logits must be [B, T, V] with [B, T] = {shape}, got {tuple(getattr(logits, 'shape', ()))}"
                )
            if int(logits.shape[2]) != self.vocab_size:
                raise PolicyTapError(f"logits vocab {logits.shape[2]} ≠ model vocab {self.vocab_size}")

    def _admit(
        self,
        cap: Any,
        input_ids: torch.Tensor,
        ids_host: torch.Tensor,
        valid: torch.Tensor,
        response: torch.Tensor,
        starts: list[int],
        logits: torch.Tensor | None,
        next_logprob: torch.Tensor | None,
        temps: list[float],
        policy_version: int,
        step: int,
        row: Any,
    ) -> None:
        """Draw this micro-batch's rows into the step's sample and copy the kept ones off the forward pass.
        ``valid``/``response``/``ids_host`` [B, T'] on the host; ``row(x, b, sl)``: row b's positions ``sl``
        of a device tensor laid out as the forward ran (padded [B, T, …] or packed [1, N, …])."""
        # on every rank, before the sample is drawn: the gather is collective, and ranks keep different rows
        head = self._gathered_head() if logits is None else None
        lengths, kept = self._sample.admit(valid, response)
        ready = None
        for b, h in kept:
            n, s0 = lengths[b], starts[b]
            rows = slice(s0, s0 + n)
            sf = stats_start(response[b, rows])
            scored = slice(s0 + sf, s0 + n)  # the rows whose statistics are computed (class docstring)
            ids_scored = row(input_ids, b, scored)
            if head is None:
                stats = logit_stats(row(logits, b, scored).detach(), ids_scored, self.topk)
            elif next_logprob is not None:
                stats = logprob_stats(
                    row(cap.final, b, scored),
                    head[0],
                    head[1],
                    ids_scored,
                    row(next_logprob, b, scored).detach(),
                )
            else:
                stats = head_logit_stats(row(cap.final, b, scored), head[0], head[1], ids_scored, self.topk)
            final = row(cap.final, b, rows) if self.send_final else None
            tensors = host_tensors(
                ids_host[b, rows], response[b, rows], row(cap.aux, b, rows), final, pad_stats(stats, sf)
            )
            seq = KeptSequence(step, policy_version, temps[b], n, tensors, stats_from=sf)
            if cap.aux.device.type == "cuda":
                if ready is None:
                    ready = torch.cuda.Event()
                seq.ready = ready
            self._sample.keep(h, seq)
        if ready is not None:
            ready.record(torch.cuda.current_stream(cap.aux.device))  # the stream the copies were queued on

    def _gathered_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lm_head weight [V, H] and bias [V] (or None), whole: under FSDP2 (DTensor shards) one all-gather
        each, which every rank must reach (see the class docstring); otherwise the parameters as they are."""
        _, _, _, lm_head = decoder_parts(self.model)
        weight = full_tensor(lm_head.weight.detach())
        bias = None if lm_head.bias is None else full_tensor(lm_head.bias.detach())
        return weight, bias

    # -- shipping (end_step(): TapBase's) -------------------------------------------------------------

    def _message(self, seqs: list[KeptSequence]) -> Any:
        """One TapBatch of ``seqs`` (see :meth:`~draft_align.tap.base.TapBase._message`)."""
        header = self._header(seqs[0], self.rank, "post" if self.send_final else None)
        return pack_sequences([s.tensors for s in seqs], header, stats_from=[s.stats_from for s in seqs])

    def head_sync(self, policy_version: int, draft_to_target: torch.Tensor) -> bool:
        """Offer HeadSync for ``policy_version``: final norm weight [H] (float32), its eps, and the
        lm_head rows [Vd, H] (bfloat16) of the draft vocabulary ``draft_to_target`` [Vd]."""
        d2t = check_head_sync_args(policy_version, draft_to_target, self.vocab_size)
        _, _, norm, lm_head = decoder_parts(self.model)
        if hasattr(lm_head, "base_layer"):
            raise PolicyTapError("lm_head is adapter-wrapped: its .weight would miss the adapter's update")
        if getattr(norm, "weight", None) is None:
            raise PolicyTapError(f"{type(norm).__name__}: final norm has no weight")
        weight = full_tensor(lm_head.weight.detach())
        return self._offer_head_sync(
            policy_version,
            _norm_eps(norm),
            full_tensor(norm.weight.detach()),  # under FSDP2 a sharded DTensor too
            d2t,
            weight[d2t.to(weight.device)],  # the rows of the draft vocabulary: a copy (gather)
        )
