"""Acceptance from teacher-forced unrolls: predict what an engine measures without decoding.

For a sequence x[0..T-1] with a prompt of P tokens, one target forward (an :class:`HFTap` captures the
aux states) and one ``draft.unroll`` give, for every chain start s = P−1 .. T−2 and step j < k, the draft
logits q_{s,j} (step 0 at s reads aux[s], embed(x[s+1]) and predicts x[s+2]) and the target logits at
position s+1+j (the distribution of x[s+2+j]); α_{s,j} = acceptance_prob(p, q) (docs/acceptance.md) is
valid iff s+2+j ≤ T−1.

On the target's own samples (rollouts, or the output of a lossless decoder) the round walk of these
α predicts an engine's counters: exactly at T = 0, in expectation at T > 0 (for ``greedy_draft`` and
``probabilistic`` α is the acceptance probability given the context).  One difference remains by
construction: an engine's last round may accept drafts past the end of the output (max tokens, eos),
which the sequence cannot show; those are counted by the engine and not here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from draft_align.acceptance import (
    EstimatePool,
    VerifyMode,
    acceptance_prob,
    check_mode,
)
from draft_align.heads.draft_head import DraftHead
from draft_align.hf.capture import HFTap
from draft_align.hf.parts import decoder_parts


@torch.no_grad()
def _unroll_scores(
    target: nn.Module,
    draft: DraftHead,
    input_ids: torch.Tensor,  # [T]
    prompt_len: int,
    k: int,
    tap: HFTap | None,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(target logits [T, V], draft logits per step [S, Vd] × k, chain starts [S]) of one sequence."""
    ids = input_ids.flatten().long()
    t = ids.numel()
    if not 1 <= prompt_len < t:
        raise ValueError(f"prompt_len {prompt_len} must be in 1..{t - 1} for a sequence of {t} tokens")
    if tap is None:
        with HFTap(target, draft.cfg.aux_layer_ids, capture_final=False) as own:
            return _unroll_scores(target, draft, ids, prompt_len, k, own)
    if tuple(tap.aux_layer_ids) != tuple(draft.cfg.aux_layer_ids):
        raise ValueError(f"tap captures {tap.aux_layer_ids}, the draft reads {draft.cfg.aux_layer_ids}")
    dev = next(target.parameters()).device
    ddtype = next(draft.parameters()).dtype
    ids = ids.to(dev)
    logits = target(input_ids=ids[None]).logits[0]  # [T, V]
    aux = tap.pop().aux.to(ddtype)  # [1, T, n·H]
    starts = torch.arange(prompt_len - 1, t - 1, device=dev)  # [S]
    embed = decoder_parts(target)[0]
    q = draft.unroll(
        aux,
        lambda x: embed(x).to(ddtype),
        ids[None],
        torch.ones(1, t, dtype=torch.bool, device=dev),
        starts[None],
        torch.ones(1, starts.numel(), dtype=torch.bool, device=dev),
        k,
    )
    return logits, [qj[0] for qj in q], starts


def _valid(starts: torch.Tensor, k: int, t: int) -> torch.Tensor:
    # [S, k]: step j of start s predicts x[s+2+j], which must exist
    return (starts.view(-1, 1) + 2 + torch.arange(k, device=starts.device).view(1, -1) <= t - 1).cpu()


def _alpha(
    logits: torch.Tensor,
    q: list[torch.Tensor],
    starts: torch.Tensor,
    d2t: torch.Tensor,
    mode: VerifyMode,
    temperature: float,
) -> torch.Tensor:
    t = logits.shape[0]
    cols = [
        acceptance_prob(logits[(starts + 1 + j).clamp(max=t - 1)], qj, d2t, mode, temperature)
        for j, qj in enumerate(q)
    ]
    return torch.stack(cols, dim=1).cpu()  # [S, k]


def _observed(
    ids: torch.Tensor, q: list[torch.Tensor], starts: torch.Tensor, d2t: torch.Tensor
) -> torch.Tensor:
    t = ids.numel()
    ids = ids.to(starts.device)
    cols = [(d2t[qj.argmax(-1)] == ids[(starts + 2 + j).clamp(max=t - 1)]).float() for j, qj in enumerate(q)]
    return torch.stack(cols, dim=1).cpu()  # [S, k]


def alpha_table(
    target: nn.Module,
    draft: DraftHead,
    input_ids: torch.Tensor,  # [T] prompt followed by response
    prompt_len: int,
    k: int,
    mode: VerifyMode,
    temperature: float,
    tap: HFTap | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-start acceptance probabilities of one sequence: (alpha [S, k] float32, valid [S, k] bool).

    Rows are chain starts s = P−1 .. T−2 (S = T − P); step j of start s is scored against the target
    logits at position s+1+j and is valid iff s+2+j ≤ T−1.  ``tap``: an attached HFTap on ``target``
    capturing the draft's aux layers (one is attached for the call if None).
    """
    check_mode(mode)
    logits, q, starts = _unroll_scores(target, draft, input_ids, prompt_len, k, tap)
    d2t = draft.draft_to_target.to(logits.device)
    return _alpha(logits, q, starts, d2t, mode, temperature), _valid(starts, k, input_ids.numel())


def observed_alpha_table(
    target: nn.Module,
    draft: DraftHead,
    input_ids: torch.Tensor,  # [T] prompt followed by response
    prompt_len: int,
    k: int,
    tap: HFTap | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """α_{s,j} = 1[d2t(argmax q_{s,j}) == x[s+2+j]] ([S, k] float32, valid [S, k] bool), rows as in
    :func:`alpha_table`.

    For a draft that proposes argmax q (``greedy_draft`` at any T, every mode at T = 0) a draft token is
    accepted iff the emitted token equals it (a rejection never emits the rejected token), so the round walk
    of this table reproduces the engine's counters on exactly these outputs.
    """
    logits, q, starts = _unroll_scores(target, draft, input_ids, prompt_len, k, tap)
    d2t = draft.draft_to_target.to(logits.device)
    return _observed(input_ids.flatten().long(), q, starts, d2t), _valid(starts, k, input_ids.numel())


def estimate(
    target: nn.Module,
    draft: DraftHead,
    sequences: list[tuple[torch.Tensor, torch.Tensor]],  # (prompt [P], response [R]) pairs
    k: int,
    mode: VerifyMode,
    temperature: float,
) -> dict[str, Any]:
    """Estimated acceptance of ``draft`` on target samples, no decoding.

    ``acceptance_length_est``: round walk per sequence, pooled as Σ accepted / Σ rounds (what predicts
    an engine's counters); ``acceptance_length_all_starts``: Π α averaged over every chain start of every
    sequence (an overestimate, docs/acceptance.md).  ``per_position_*`` are the r_i; ``num_tokens`` counts
    response tokens.  ``acceptance_length_observed`` walks :func:`observed_alpha_table`: the counters
    an argmax-proposing draft's engine reports on exactly these outputs (None for ``probabilistic`` at
    T > 0, whose draft samples).  Sequences with an empty response are skipped.
    """
    check_mode(mode)
    pool = EstimatePool(k)
    num_tokens = 0
    with HFTap(target, draft.cfg.aux_layer_ids, capture_final=False) as tap:
        for prompt, response in sequences:
            prompt = prompt.flatten()
            response = response.flatten()
            num_tokens += response.numel()
            if response.numel() == 0:
                continue
            ids = torch.cat((prompt, response.to(prompt.device)))
            logits, q, starts = _unroll_scores(target, draft, ids, prompt.numel(), k, tap)
            d2t = draft.draft_to_target.to(logits.device)
            pool.add(
                _alpha(logits, q, starts, d2t, mode, temperature),
                _observed(ids, q, starts, d2t),
                _valid(starts, k, ids.numel()),
            )
    return {**pool.result(mode, temperature), "num_tokens": num_tokens, "num_sequences": len(sequences)}
