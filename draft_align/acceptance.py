"""Acceptance math of chain speculative decoding (docs/acceptance.md): pure tensor functions.

One neutral home, low in the house (it imports only ``conventions``): the engines' counters, the reference
decoder, the RL job's draft guard and monitoring's estimators all count and average acceptance with it.

Per-position acceptance probability α of one draft token, by how the engine verifies (temperature T):

- ``greedy``        α = 1[d2t(argmax q) == argmax p]          (argmax verification; T is ignored)
- ``greedy_draft``  α = p_T(d2t(argmax q))                    (the draft proposes argmax q; vLLM/SGLang)
- ``probabilistic`` α = Σ_x min(p_T(x), q_T(x)) = 1 − TV       (the draft samples from q_T)

with p_T = softmax(p / T), q_T = softmax(q / T) scattered onto the target vocabulary; at T = 0 every mode
is the greedy one.  With k drafts per round the mean acceptance length (bonus token included) is
1 + Σ_{i<k} Π_{j≤i} α_j.  Two ways to average it over a sequence:

- *all starts*: the product per chain start, averaged over every start (overstates an engine);
- *round walk*: rounds start at the last prompt token and jump ahead by accepted + 1 tokens, as an
  engine does; across sequences it is a ratio of sums (Σ accepted / Σ rounds), like engine counters.

By position in the response (:data:`RESPONSE_POSITION_EDGES`): the all-starts length of the chains whose first
drafted token lies in each bucket of response positions (row s of a table drafts response token s + 1 first),
so a long response shows where acceptance holds and where it falls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from draft_align.conventions import VERIFY_MODES, VerifyMode

#: buckets of response positions (0-based token index in the response) the estimate is split by: [0, 32),
#: [32, 64), [64, 128), [128, ∞)
RESPONSE_POSITION_EDGES: tuple[int, ...] = (0, 32, 64, 128)


def _buckets(edges: Sequence[int]) -> list[tuple[int, int | None]]:
    """[(lo, hi)] of consecutive edges, the last open-ended (hi None)."""
    return [(lo, edges[i + 1] if i + 1 < len(edges) else None) for i, lo in enumerate(edges)]


def check_mode(mode: str) -> None:
    """Raise ValueError unless ``mode`` is a VerifyMode."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"unknown verify mode {mode!r}; expected one of {VERIFY_MODES}")


def verifies_by_argmax(mode: VerifyMode, temperature: float) -> bool:
    """True where verification is deterministic: ``greedy`` mode, or any mode at T = 0."""
    check_mode(mode)
    return mode == "greedy" or temperature <= 0.0


def draft_probs_on_target(
    q_probs: torch.Tensor, draft_to_target: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Scatter draft-vocab probabilities onto the target vocab: q_probs [N, Vd] → [N, V] (zero off-vocab).

    draft_to_target [Vd]: distinct target id of each draft id.
    """
    out = q_probs.new_zeros(*q_probs.shape[:-1], vocab_size)
    out[..., draft_to_target.to(q_probs.device)] = q_probs
    return out


def acceptance_prob(
    p_logits: torch.Tensor,  # [N, V] target logits
    q_logits: torch.Tensor,  # [N, Vd] draft logits
    draft_to_target: torch.Tensor,  # [Vd] target id of each draft id
    mode: VerifyMode,
    temperature: float,
) -> torch.Tensor:
    """Per-row acceptance probability α [N] (float32) of one draft token; formulas in the module docstring."""
    p = p_logits.float()
    q = q_logits.float()
    d2t = draft_to_target.to(p.device)
    if verifies_by_argmax(mode, temperature):
        return (d2t[q.argmax(-1)] == p.argmax(-1)).float()
    p_t = torch.softmax(p / temperature, dim=-1)
    if mode == "greedy_draft":
        return p_t.gather(-1, d2t[q.argmax(-1)].unsqueeze(-1)).squeeze(-1)
    q_t = draft_probs_on_target(torch.softmax(q / temperature, dim=-1), d2t, p.shape[-1])
    return torch.minimum(p_t, q_t).sum(-1)


@dataclass
class AcceptanceTally:
    """Engine-style acceptance counters (vLLM's ``num_drafts`` and ``num_accepted_tokens_per_pos``).

    ``rounds`` counts verification rounds; ``accepted_per_pos[i]`` counts rounds whose first i+1 drafts
    were all accepted.  Floats so that expected counts (the round-walk estimate) fit too.  Mean acceptance
    length = 1 + Σ_i accepted_per_pos[i] / rounds; r_i = accepted_per_pos[i] / rounds.  Both are NaN while
    ``rounds`` is 0.
    """

    rounds: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)  # [k]

    @classmethod
    def empty(cls, k: int) -> AcceptanceTally:
        return cls(0.0, [0.0] * k)

    @property
    def k(self) -> int:
        return len(self.accepted_per_pos)

    @property
    def num_accepted(self) -> float:
        """Total accepted draft tokens (the engine's ``num_accepted_tokens``)."""
        return float(sum(self.accepted_per_pos))

    def add(self, num_accepted: int) -> None:
        """Record one round in which the first ``num_accepted`` (0..k) drafts were accepted."""
        if not 0 <= num_accepted <= self.k:
            raise ValueError(f"num_accepted {num_accepted} outside 0..{self.k}")
        self.rounds += 1.0
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1.0

    def merge(self, other: AcceptanceTally) -> AcceptanceTally:
        """Add ``other``'s counts to this tally (in place); returns self."""
        if other.k != self.k:
            raise ValueError(f"cannot merge tallies with k={self.k} and k={other.k}")
        self.rounds += other.rounds
        self.accepted_per_pos = [
            a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos, strict=True)
        ]
        return self

    def mean_length(self) -> float:
        return 1.0 + self.num_accepted / self.rounds if self.rounds > 0 else math.nan

    def per_position(self) -> list[float]:
        return [a / self.rounds if self.rounds > 0 else math.nan for a in self.accepted_per_pos]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "accepted_per_pos": list(self.accepted_per_pos),
            "num_accepted": self.num_accepted,
            "mean_length": self.mean_length(),
            "per_position": self.per_position(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AcceptanceTally:
        return cls(float(d["rounds"]), [float(a) for a in d["accepted_per_pos"]])

    @classmethod
    def make_dummy(cls) -> AcceptanceTally:
        """Four rounds of k = 3 with 0, 1, 3, 2 accepted: mean length 2.5, r = [0.75, 0.5, 0.25]."""
        t = cls.empty(3)
        for n in (0, 1, 3, 2):
            t.add(n)
        return t


def length_stderr(rounds: float, per_position: Sequence[float]) -> float:
    """Standard error of a measured mean acceptance length, from its rounds and per-position rates alone.

    A round accepts A ∈ 0..k drafts with P(A ≥ i+1) = r_i, so E[A] = Σ_i r_i, E[A²] = Σ_i (2i+1)·r_i
    (A² = Σ_{i<A} (2i+1)) and se = √((E[A²] − E[A]²) / rounds).  Rounds are taken as independent: rounds of
    one rollout share its prompt and policy, so with few rollouts the true noise is larger.  NaN with fewer
    than two rounds or a non-finite rate.
    """
    if not rounds >= 2 or not all(math.isfinite(r) for r in per_position):
        return math.nan
    mean = sum(per_position)
    second = sum((2 * i + 1) * r for i, r in enumerate(per_position))
    return math.sqrt(max(second - mean * mean, 0.0) / rounds)


def _check_table(alpha: torch.Tensor, valid: torch.Tensor) -> None:
    if alpha.dim() != 2 or alpha.shape != valid.shape:
        raise ValueError(f"alpha {tuple(alpha.shape)} and valid {tuple(valid.shape)} must both be [S, k]")


def all_starts_sums(alpha: torch.Tensor, valid: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(number of chain starts, Σ_starts Π_{j≤i} α_j for each i [k] float64).

    alpha [S, k], valid [S, k] bool; invalid steps count as rejected (α = 0).  A row whose step 0 is
    invalid lies past the end of the sequence (no token left to draft) and is not a chain start.
    """
    _check_table(alpha, valid)
    a = alpha.double() * valid
    rows = valid[:, 0] if valid.shape[1] else valid.new_zeros(valid.shape[0])
    return int(rows.sum()), a.cumprod(dim=1)[rows].sum(dim=0)


def acceptance_length_all_starts(alpha: torch.Tensor, valid: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Average over every chain start: (1 + Σ_i r_i, r [k]) with r_i = mean_starts Π_{j≤i} α_j.

    alpha [S, k], valid [S, k] bool (see :func:`all_starts_sums`).  NaN with no chain start.
    """
    n, sums = all_starts_sums(alpha, valid)
    if n == 0:
        return math.nan, torch.full_like(sums, math.nan)
    per = sums / n
    return 1.0 + float(per.sum()), per


def round_walk_tally(alpha: torch.Tensor, valid: torch.Tensor) -> AcceptanceTally:
    """Expected engine counters of ONE sequence, walking rounds the way an engine does.

    alpha [S, k], valid [S, k] bool: row 0 is the chain start at the last prompt token, row s the start
    s tokens later; invalid steps count as rejected.  A round at row s with n accepted drafts moves to
    row s + n + 1; landing on a row ≥ S or one whose step 0 is invalid ends the sequence.  With
    a_j = α_j·valid_j and P(n|s) = Π_{j<n} a_j (1 − a_n) for n < k, Π_{j<k} a_j for n = k::

        R(s)   = 1 + Σ_n P(n|s) R(s+n+1)                    expected rounds from row s
        A_i(s) = Π_{j≤i} a_j + Σ_n P(n|s) A_i(s+n+1)        expected rounds with ≥ i+1 accepted

    computed backwards over rows; returns rounds = R(0), accepted_per_pos = A(0).  For α ∈ {0, 1} this is
    the exact round walk.
    """
    _check_table(alpha, valid)
    s_rows, k = alpha.shape
    a = (alpha.double() * valid).tolist()
    starts = valid[:, 0].tolist() if k else [False] * s_rows
    size = s_rows + k + 2
    rounds = [0.0] * size
    acc = [[0.0] * k for _ in range(size)]
    for s in reversed(range(s_rows)):
        if not starts[s]:
            continue
        row = a[s]
        r_s = 1.0
        a_s = [0.0] * k
        prefix = 1.0  # Π_{j<n} a_j
        for n in range(k + 1):
            p_n = prefix * (1.0 - row[n]) if n < k else prefix
            if p_n > 0.0:
                nxt = s + n + 1
                r_s += p_n * rounds[nxt]
                for i in range(k):
                    a_s[i] += p_n * acc[nxt][i]
            if n < k:
                prefix *= row[n]
                a_s[n] += prefix
        rounds[s] = r_s
        acc[s] = a_s
    return AcceptanceTally(rounds[0], acc[0])


def acceptance_length_round_walk(alpha: torch.Tensor, valid: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Round-walk acceptance of one sequence: (1 + Σ_i A_i(0)/R(0), A(0)/R(0) [k]); see :func:`round_walk_tally`."""
    tally = round_walk_tally(alpha, valid)
    return tally.mean_length(), torch.tensor(tally.per_position(), dtype=torch.float64)


class EstimatePool:
    """Per-sequence α tables pooled into the estimators' report (see :func:`draft_align.monitor.estimator.estimate`).

    ``add`` takes one sequence's α [S, k], the observed-acceptance table [S, k] and validity [S, k]; its engine
    round walk is pooled as Σ accepted / Σ rounds, the all-starts average over every valid chain start.
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.tally = AcceptanceTally.empty(k)
        self.observed = AcceptanceTally.empty(k)
        self.sums = torch.zeros(k, dtype=torch.float64)
        self.n_starts = 0
        edges = RESPONSE_POSITION_EDGES
        self.by_position = [(lo, hi, 0, torch.zeros(k, dtype=torch.float64)) for lo, hi in _buckets(edges)]

    def add(self, alpha: torch.Tensor, observed: torch.Tensor, valid: torch.Tensor) -> AcceptanceTally:
        """Pool one sequence (row s: the chain start whose first draft is response token s + 1); returns its own
        round-walk tally."""
        one = round_walk_tally(alpha, valid)
        self.tally.merge(one)
        self.observed.merge(round_walk_tally(observed, valid))
        n, s = all_starts_sums(alpha, valid)
        self.n_starts += n
        self.sums += s
        for i, (lo, hi, count, sums) in enumerate(self.by_position):
            first, last = max(lo - 1, 0), (hi - 1 if hi is not None else alpha.shape[0])
            if first < alpha.shape[0]:
                bn, bs = all_starts_sums(alpha[first:last], valid[first:last])
                self.by_position[i] = (lo, hi, count + bn, sums + bs)
        return one

    def result(self, mode: VerifyMode, temperature: float) -> dict[str, Any]:
        k = self.k
        per_all = (self.sums / self.n_starts).tolist() if self.n_starts else [math.nan] * k
        argmax_draft = mode != "probabilistic" or temperature <= 0
        return {
            "acceptance_length_est": self.tally.mean_length(),
            "acceptance_length_all_starts": 1.0 + sum(per_all) if self.n_starts else math.nan,
            "acceptance_length_observed": self.observed.mean_length() if argmax_draft else None,
            "per_position_est": self.tally.per_position(),
            "per_position_all_starts": per_all,
            "per_position_observed": self.observed.per_position() if argmax_draft else None,
            "by_response_position": [
                {"from": lo, "to": hi, "starts": n, "length": 1.0 + float(s.sum()) / n if n else None}
                for lo, hi, n, s in self.by_position
            ],
            "rounds_est": self.tally.rounds,
            "num_starts": self.n_starts,
            "k": k,
            "verify_mode": mode,
            "temperature": float(temperature),
        }
