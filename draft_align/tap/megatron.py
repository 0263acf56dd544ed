"""Policy-side Tap for megatron-core ``GPTModel`` policies (the backend NeMo RL uses).

The same contract as :class:`~draft_align.tap.hf.HFPolicyTap` (``capturing()`` → the RL job's own
forward passes → ``submit()`` per micro-batch → ``end_step()``; ``head_sync()`` per policy version), with
HF ``hidden_states`` indexing kept exactly (:mod:`draft_align.tap.megatron_hooks`).  Megatron activations
are sequence-first [s, b, h]; they are turned into the packed per-sequence layout of a TapBatch.

Parallelism (process groups and ranks are passed in, or read once by :meth:`MegatronPolicyTap.from_parallel_state`):

- tensor parallel: every TP rank runs the same calls; only TP rank 0 copies to the host and sends.  With
  sequence parallelism the hooked activations are sequence shards [s/tp, b, h]: ``submit()`` all-gathers
  the kept rows over the TP group, so it (and ``head_sync()``, which gathers vocab-parallel lm_head rows)
  is collective over that group.
- pipeline parallel: each stage hooks only the layers it owns and sends a :class:`TapPart` per batch
  (the last stage adds the final hidden state and the log-prob statistics); the sidecar joins the stages
  (:mod:`draft_align.wire.join`).  All stages draw the same token-budget sample (seeded by the data-parallel
  rank, from the same masks), so their batch ids line up.  Captures are queued first-in first-out, so a
  pipeline schedule may run every micro-batch's forward before the first ``submit()``.

megatron-core is imported only by :meth:`MegatronPolicyTap.from_parallel_state`: the model is used through its
module attributes (``embedding``, ``decoder.layers[i].layer_number``, ``decoder.final_layernorm``,
``output_layer``, ``config``).  Tap a forward pass without activation recompute (the log-prob pass): a
recomputed layer fires its hook again (counted as ``capture_broken``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

import torch
import torch.distributed as dist
from torch import nn

from draft_align.tap.base import TapBase, TapOptions
from draft_align.tap.logit_stats import logit_stats, stat_buffers
from draft_align.tap.megatron_hooks import MegatronTap, gpt_parts
from draft_align.tap.protocol import PolicyTapError, TapSink
from draft_align.tap.shipping import (
    KeptSequence,
    check_head_sync_args,
    check_step_args,
    host_ids,
    host_tensors,
)
from draft_align.wire.codec import validate
from draft_align.wire.messages import BatchHeader, TapPart
from draft_align.wire.packing import pack_sequences


def _gather_sequence(x: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """All-gather sequence shards [s/tp, b, h] of the tensor-parallel group into [s, b, h]."""
    if world == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * world, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def vocab_parallel_logit_stats(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    topk: int,
    *,
    vocab_size: int,
    group: Any,
    tp_rank: int,
    tp_size: int,
    max_elements: int = 1 << 26,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`~draft_align.tap.logit_stats.logit_stats` from vocab-parallel logits, collectively over the TP
    group: rank r holds logits [L, Vl] of global ids r·Vl … (r+1)·Vl − 1 (megatron's equal split of the padded
    vocab); ids ≥ ``vocab_size`` (padding) are ignored.  lse = m + log Σ_r Σ exp(x − m) with m the global
    max; the next token's logit comes from the rank that owns it; top-k is the top-k of the ranks' top-k."""
    length, local = logits.shape
    start = tp_rank * local
    dev = logits.device
    nxt, lse, k_ids, k_lp = stat_buffers(length, topk, dev)
    ids = input_ids.to(device=dev, dtype=torch.int64)
    pad = torch.arange(start, start + local, device=dev) >= vocab_size  # [Vl]
    rows = max(1, max_elements // max(local, 1))
    for s in range(0, length, rows):
        e = min(length, s + rows)
        lg = logits[s:e].float().masked_fill(pad, -torch.inf)  # [c, Vl]
        m = lg.max(dim=-1).values  # [c]
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = torch.exp(lg - m[:, None]).sum(dim=-1)  # [c]
        dist.all_reduce(z, group=group)
        z = m + z.log()
        lse[s:e] = z
        tgt = torch.full((e - s,), -1, dtype=torch.int64, device=dev)  # next token of positions s..e−1
        last = min(e, length - 1)
        tgt[: last - s] = ids[s + 1 : last + 1]
        mine = (tgt >= start) & (tgt < start + local)
        val = torch.zeros(e - s, dtype=torch.float32, device=dev)
        val[mine] = lg[mine].gather(1, (tgt[mine] - start)[:, None]).squeeze(1)
        dist.all_reduce(val, group=group)
        nxt[s:last] = val[: last - s] - z[: last - s]
        if topk:
            kk = min(topk, local)
            vals, idx = lg.topk(kk, dim=-1)  # [c, kk]
            all_vals = vals.new_empty((tp_size * (e - s), kk))  # rank-major [tp·c, kk]
            all_ids = idx.new_empty((tp_size * (e - s), kk))
            dist.all_gather_into_tensor(all_vals, vals.contiguous(), group=group)
            dist.all_gather_into_tensor(all_ids, (idx + start).contiguous(), group=group)
            cand_v = all_vals.view(tp_size, e - s, kk).permute(1, 0, 2).reshape(e - s, -1)  # [c, tp·kk]
            cand_i = all_ids.view(tp_size, e - s, kk).permute(1, 0, 2).reshape(e - s, -1)
            top_v, pos = cand_v.topk(topk, dim=-1)
            k_lp[s:e] = top_v - z[:, None]
            k_ids[s:e] = cand_i.gather(1, pos)
    return nxt, lse, k_ids, k_lp


class MegatronPolicyTap(TapBase):
    """:class:`~draft_align.tap.protocol.PolicyTap` for megatron-core GPTModel policies.

    Arguments beyond every tap's (:class:`~draft_align.tap.base.TapOptions`): ``tp_group`` (None when
    TP = 1), ``pp_rank``/``pp_size`` (pipeline stage), ``dp_rank`` (the pipeline's id: seeds the sample and is
    the messages' ``source_rank``), ``sequence_parallel`` (default: ``model.config.sequence_parallel``),
    ``vocab_size`` (the tokenizer's vocabulary, default the model's possibly padded one: logits and lm_head
    rows beyond it are ignored).

    ``submit()`` takes the same right-padded [B, T] masks as the HF tap; ``logits`` [B, T, V] (full vocab,
    temperature 1) are needed only on the last pipeline stage's TP rank 0 and may be None elsewhere.  With
    ``vocab_parallel_logits`` every TP rank of the last stage passes its shard [B, T, V_padded/tp] instead
    (megatron's ``parallel_output``), and the statistics are computed collectively over the TP group.
    """

    _WHO = "megatron tap"

    def __init__(
        self,
        model: nn.Module,
        aux_layer_ids: Sequence[int],
        sink: TapSink,
        *,
        tp_group: Any = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        dp_rank: int = 0,
        sequence_parallel: bool | None = None,
        vocab_size: int | None = None,
        vocab_parallel_logits: bool = False,
        **options: Unpack[TapOptions],
    ) -> None:
        super().__init__(sink, **options)
        if not 0 <= int(pp_rank) < int(pp_size) or int(dp_rank) < 0:
            raise PolicyTapError(
                f"need 0 ≤ pp_rank < pp_size and dp_rank ≥ 0, got {pp_rank}, {pp_size}, {dp_rank}"
            )
        parts = gpt_parts(model)
        self.model = model
        self.pp_rank, self.pp_size, self.dp_rank = int(pp_rank), int(pp_size), int(dp_rank)
        self.is_last = self.pp_rank == self.pp_size - 1
        if self.is_last and parts.final_norm is None:
            raise PolicyTapError(
                "the last pipeline stage has no decoder.final_layernorm (post_process=False?)"
            )
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self.sends = self.tp_rank == 0
        sp = (
            getattr(parts.config, "sequence_parallel", False)
            if sequence_parallel is None
            else sequence_parallel
        )
        self.sequence_parallel = bool(sp) and self.tp_size > 1
        self.vocab_parallel_logits = bool(vocab_parallel_logits) and self.tp_size > 1
        self._tap = MegatronTap(model, aux_layer_ids, capture_final=self.send_final and self.is_last)
        self.aux_layer_ids = self._tap.aux_layer_ids
        self.layer_ids = self._tap.owned
        if self.pp_size == 1 and self.layer_ids != self.aux_layer_ids:
            missing = sorted(set(self.aux_layer_ids) - set(self.layer_ids))
            raise PolicyTapError(f"aux layers {missing} are not in this model (no pipeline parallelism)")
        self.hidden_size = int(parts.config.hidden_size)
        model_vocab = int(parts.vocab_size)
        self.vocab_size = int(vocab_size) if vocab_size is not None else model_vocab
        if not 1 <= self.vocab_size <= model_vocab:
            raise PolicyTapError(f"vocab_size {self.vocab_size} outside 1..{model_vocab} (the model's vocab)")
        # one generator per pipeline: every TP rank and stage of it keeps the same sequences
        self._start(self._tap, self.dp_rank)

    @classmethod
    def from_parallel_state(
        cls, model: nn.Module, aux_layer_ids: Sequence[int], sink: TapSink, **kwargs: Any
    ) -> MegatronPolicyTap:
        """Read the TP group and PP/DP ranks from ``megatron.core.parallel_state`` (initialised by the job)."""
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        return cls(
            model,
            aux_layer_ids,
            sink,
            tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            **kwargs,
        )

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
        temperature: float,
    ) -> None:
        """Offer the oldest captured micro-batch to this step's sample (collective over the TP group under
        sequence parallelism).  input_ids, attention_mask, loss_mask [B, T] right-padded; logits [B, T, V]
        on the last stage's TP rank 0 (ignored elsewhere)."""
        (aux, final), shape, valid, response = self._take(input_ids, attention_mask, loss_mask)
        check_step_args(policy_version, step, temperature)
        # vocab-parallel logits: every TP rank of the last stage holds a shard and takes part in the statistics
        need_logits = self.is_last and (self.sends or self.vocab_parallel_logits)
        width = self.vocab_size if not self.vocab_parallel_logits else -(-self.vocab_size // self.tp_size)
        if need_logits and (
            not isinstance(logits, torch.Tensor)
            or logits.dim() != 3
            or tuple(logits.shape[:2]) != shape
            or int(logits.shape[2]) < width
        ):
            raise PolicyTapError(
                f"logits must be [B, T, V ≥ {width}] with [B, T] = {shape} on the last stage "
                f"({'vocab-parallel shard' if self.vocab_parallel_logits else 'full vocab'}), "
                f"got {getattr(logits, 'shape', logits)}"
            )
        seq_len = shape[1] // self.tp_size if self.sequence_parallel else shape[1]
        for x in [*aux, *([final] if final is not None else [])]:
            if tuple(x.shape[:2]) != (seq_len, shape[0]):
                raise PolicyTapError(
                    f"captured forward was [s, b] = {list(x.shape[:2])}, submit expects "
                    f"{[seq_len, shape[0]]}: submit() must follow the forward of the same batch"
                )
        ids_host = host_ids(input_ids, valid, response, self.vocab_size)

        lengths, kept = self._sample.admit(valid, response)
        # the collectives below are over the TP group, whose ranks all keep the same rows (the same batch and
        # the same dp_rank-seeded sample), so returning here never leaves a TP peer waiting
        if not kept:
            return
        # [s(/tp), b, h] → the kept rows, sequence gathered under SP → [b_kept, s, ·]; one collective for all
        cols = [x[:, [b for b, _ in kept]] for x in [*aux, *([final] if final is not None else [])]]
        if cols and self.sequence_parallel:
            widths = [c.shape[-1] for c in cols]
            full = _gather_sequence(torch.cat(cols, dim=-1), self.tp_group, self.tp_size)
            cols = list(torch.split(full, widths, dim=-1))
        stats = []
        if need_logits:
            for b, _ in kept:
                n = lengths[b]
                if self.vocab_parallel_logits:
                    stats.append(
                        vocab_parallel_logit_stats(
                            logits[b, :n].detach(),
                            input_ids[b, :n],
                            self.topk,
                            vocab_size=self.vocab_size,
                            group=self.tp_group,
                            tp_rank=self.tp_rank,
                            tp_size=self.tp_size,
                        )
                    )
                else:
                    stats.append(
                        logit_stats(logits[b, :n, : self.vocab_size].detach(), input_ids[b, :n], self.topk)
                    )
        if not self.sends:
            for b, h in kept:  # only the sample's bookkeeping: batch ids must advance as on TP rank 0
                self._sample.keep(
                    h, KeptSequence(int(step), int(policy_version), float(temperature), lengths[b], {})
                )
            return
        states = [c.transpose(0, 1) for c in cols]  # [b_kept, s, ·]
        aux_states = states[: len(aux)]
        final_states = states[len(aux)] if final is not None else None
        for j, (b, h) in enumerate(kept):
            n = lengths[b]
            aux_hidden = (
                torch.cat([a[j, :n] for a in aux_states], dim=-1)
                if aux_states
                else torch.empty(n, 0, dtype=torch.bfloat16)
            )
            final_hidden = final_states[j, :n] if final_states is not None else None
            tensors = host_tensors(
                ids_host[b, :n], response[b, :n], aux_hidden, final_hidden, stats[j] if stats else None
            )
            self._sample.keep(h, KeptSequence(int(step), int(policy_version), float(temperature), n, tensors))
        if any(t.device.type == "cuda" for t in states):
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(states[0].device))
            for _, h in kept:
                self._sample.pending[h].ready = ready

    # -- shipping --------------------------------------------------------------------------------------
    def end_step(self) -> int:
        """Pack the step's kept sequences (≤ max_tokens_per_message tokens per message) and offer them:
        TapBatches without pipeline parallelism, TapParts with it.  Ranks that do not send (TP rank ≠ 0)
        only advance their batch ids.  Returns the tokens of messages the sink accepted."""
        if self.sends:
            return super().end_step()
        # on every rank and stage alike, so the stages' ids line up
        self._batch_id += len(self._sample.end_step(self.max_tokens_per_message))
        return 0

    def _message(self, seqs: list[KeptSequence]) -> Any:
        """A TapBatch (no pipeline parallelism) or this stage's TapPart of ``seqs``; raises WireError."""
        final_norm = "post" if "final_hidden" in seqs[0].tensors else None
        header = self._header(seqs[0], self.dp_rank, final_norm)
        if self.pp_size > 1:
            return self._part(seqs, header)
        return pack_sequences([s.tensors for s in seqs], header)

    def _part(self, seqs: list[KeptSequence], header: BatchHeader) -> TapPart:
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor([s.n_tokens for s in seqs], dtype=torch.int64).cumsum(0)
        cat = {name: torch.cat([s.tensors[name] for s in seqs]) for name in seqs[0].tensors}
        part = TapPart(
            **header.fields(),
            stage=self.pp_rank,
            num_stages=self.pp_size,
            layer_ids=self.layer_ids,
            cu_seqlens=cu,
            **cat,
        )
        validate(part)
        return part

    # -- head ------------------------------------------------------------------------------------------
    def head_sync(self, policy_version: int, draft_to_target: torch.Tensor) -> bool:
        """Offer HeadSync (final norm weight [H] f32, eps, output-layer rows [Vd, H] bf16 of the draft vocab)
        from the last stage's TP rank 0; collective over the TP group of the last stage (the rows are
        vocab-parallel).  Other stages do nothing.  True when the sink took it."""
        d2t = check_head_sync_args(policy_version, draft_to_target, self.vocab_size)
        if not self.is_last:
            return False
        parts = gpt_parts(self.model)
        cfg = parts.config
        if getattr(cfg, "normalization", "RMSNorm") != "RMSNorm":
            raise PolicyTapError(
                f"final norm is {cfg.normalization}: the sidecar's soft targets assume RMSNorm"
            )
        weight = parts.output_weight.detach()  # [V_padded/tp, H], rows [tp_rank·n, (tp_rank+1)·n)
        n_local = int(weight.shape[0])
        start = self.tp_rank * n_local
        idx = d2t.to(weight.device)
        mine = (idx >= start) & (idx < start + n_local)
        rows = torch.zeros(int(d2t.numel()), int(weight.shape[1]), dtype=torch.float32, device=weight.device)
        rows[mine] = weight[idx[mine] - start].float()
        if self.tp_size > 1:
            dist.all_reduce(rows, group=self.tp_group)  # each row is non-zero on exactly one rank
        if not self.sends:
            return False
        norm_w = parts.final_norm.weight.detach().float()
        if getattr(cfg, "layernorm_zero_centered_gamma", False):
            norm_w = norm_w + 1.0  # megatron stores γ − 1
        return self._offer_head_sync(policy_version, cfg.layernorm_epsilon, norm_w, d2t, rows)

    def stats(self) -> dict[str, int]:
        """Counters since construction (as HFPolicyTap's, plus ``capture_broken``)."""
        return {**super().stats(), "capture_broken": self._tap.broken}
