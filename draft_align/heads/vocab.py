"""Draft vocabulary: which target tokens the draft's lm_head can propose (docs/formats.md §2)."""

from __future__ import annotations

import torch


def d2t_t2d(selected: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """selected [N] distinct target ids in draft order → (d2t [N] int64, t2d [vocab] bool).

    ``target_id = draft_id + d2t[draft_id]``; ``t2d[target_id]`` is True where the draft can propose it.
    """
    selected = selected.to(torch.long).flatten()
    if selected.numel() == 0:
        raise ValueError("empty draft vocabulary")
    if selected.min() < 0 or selected.max() >= vocab_size:
        raise ValueError(f"draft vocab ids outside the target vocab 0..{vocab_size - 1}")
    if torch.unique(selected).numel() != selected.numel():
        raise ValueError("draft vocab ids are not distinct")
    d2t = selected - torch.arange(selected.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def check_d2t(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise ValueError unless d2t maps draft ids to distinct in-range target ids that t2d marks."""
    if d2t.dtype != torch.long or d2t.dim() != 1:
        raise ValueError(f"d2t must be int64 [draft_vocab], got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"t2d must be bool [vocab], got {t2d.dtype} {tuple(t2d.shape)}")
    target = d2t + torch.arange(d2t.numel())
    if target.min() < 0 or target.max() >= t2d.numel():
        raise ValueError("d2t maps draft ids outside the target vocabulary")
    if torch.unique(target).numel() != target.numel():
        raise ValueError("d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[target].all()):
        raise ValueError("t2d does not mark exactly the target ids that d2t selects")


def select_vocab(
    token_counts: torch.Tensor,
    draft_vocab_size: int,
    fill_scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick ``draft_vocab_size`` target ids: every seen token by count, then a deliberate fill.

    token_counts [vocab] counts of loss-masked training tokens.  Seen tokens come first in descending
    count.  When fewer distinct tokens were seen than slots, the remainder is filled by ``fill_scores``
    [vocab] (e.g. the target's predicted probability mass summed over the data) in descending order, and
    then by low token id (BPE merges: low ids are the frequent, short tokens), never in the arbitrary
    order of a tie at zero count.  Returns [draft_vocab_size] ids sorted ascending, so d2t is non-negative and
    non-decreasing.
    """
    vocab = token_counts.numel()
    n = min(draft_vocab_size, vocab)
    counts = token_counts.to(torch.float64)
    seen = torch.nonzero(counts > 0).flatten()
    seen = seen[torch.argsort(counts[seen], descending=True, stable=True)]
    chosen = seen[:n]
    if chosen.numel() < n:
        taken = torch.zeros(vocab, dtype=torch.bool)
        taken[chosen] = True
        order = torch.arange(vocab)
        if fill_scores is not None:
            fs = fill_scores.to(torch.float64).clone()
            fs[taken] = float("-inf")
            scored = torch.argsort(fs, descending=True, stable=True)
            scored = scored[fs[scored] > 0]
            chosen = torch.cat((chosen, scored[: n - chosen.numel()]))
            taken[chosen] = True
        rest = order[~taken]
        chosen = torch.cat((chosen, rest[: n - chosen.numel()]))
    return torch.sort(chosen).values


def draft_logits(final: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Target logits restricted to the draft vocab: final [..., H] @ rows[draft_vocab, H]ᵀ → [..., draft_vocab].

    ``log_softmax`` of this is the target distribution renormalised over the draft vocab (docs/acceptance.md).
    """
    return torch.matmul(final.to(rows.dtype), rows.t())
