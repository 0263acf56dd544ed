"""The Llama decoder-block pieces both draft heads are built from (EAGLE-3's midlayer, MTP's blocks):
RMSNorm, RoPE, grouped-query attention over a shared key set plus a draft chain's own keys, SwiGLU MLP
and the per-sequence KV cache."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LayerWidths(Protocol):
    """The widths of a decoder layer's weights (every draft config has them)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class BlockShape(LayerWidths, Protocol):
    """The shape fields a decoder block reads (``Eagle3Config`` and ``MTPConfig`` both have them): the
    widths and the RoPE."""

    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def rope_parameters(self) -> dict[str, Any]: ...


def default_rope() -> dict[str, Any]:
    """The RoPE of a draft config that names none: the default type at θ = 10000."""
    return {"rope_type": "default", "rope_theta": 10000.0}


def target_rope(target_config: Any) -> dict[str, Any]:
    """The target's RoPE as a transformers-5 ``rope_parameters`` dict; from transformers-4 fields
    (``rope_theta`` and ``rope_scaling``) when it has none; the default type at θ = 10000 when it has neither."""
    rp = getattr(target_config, "rope_parameters", None)
    if rp:
        return dict(rp)
    scaling = dict(getattr(target_config, "rope_scaling", None) or {})
    out: dict[str, Any] = {
        "rope_type": scaling.pop("rope_type", scaling.pop("type", "default")),
        "rope_theta": float(getattr(target_config, "rope_theta", 10000.0)),
    }
    out.update(scaling)
    return out


def block_shape_from_target(target_config: Any) -> dict[str, Any]:
    """The :class:`BlockShape` fields (and rms_norm_eps) of one decoder layer of ``target_config`` (an HF
    ``PretrainedConfig``): head_dim defaults to H / heads, kv heads to heads, RoPE as :func:`target_rope`."""
    tc = target_config
    heads = int(tc.num_attention_heads)
    rope = target_rope(tc)
    return dict(
        hidden_size=int(tc.hidden_size),
        intermediate_size=int(tc.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // heads),
        vocab_size=int(tc.vocab_size),
        max_position_embeddings=int(tc.max_position_embeddings),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)),
        rope_parameters=dict(rope),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] → weight · x / sqrt(mean(x²) + eps), as HF Llama computes it: normalised in
    fp32, cast back to x's dtype, then scaled (the result has the promoted dtype of weight and x)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """y = w · x / sqrt(mean(x²) + eps) (:func:`rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """RoPE with the target's parameters (any HF rope_type, via transformers' init functions)."""

    def __init__(self, cfg: BlockShape) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        lc = LlamaConfig(
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=dict(cfg.rope_parameters),
        )
        self.inner = LlamaRotaryEmbedding(lc)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, M] → cos, sin [B, M, head_dim]
        return self.inner(x, positions)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x [B, heads, M, d] with cos/sin [B, M, d]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    """Grouped-query attention whose q/k/v read ``in_features`` (EAGLE-3: the 2·H concatenation of
    embedding and hidden; a plain Llama block, as in MTP: H) and whose o_proj writes H."""

    def __init__(self, cfg: BlockShape, in_features: int) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(in_features, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, M, in_features] → rotated queries [B, h, M, d]."""
        b, m, _ = x.shape
        return rotate(self.q_proj(x).view(b, m, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, M, in_features] → rotated keys [B, kv, M, d], values [B, kv, M, d]."""
        b, m, _ = x.shape
        k = self.k_proj(x).view(b, m, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, m, self.n_kv, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """M new rows of one sequence, x [1, M, in_features]: their K/V appended to ``cache``, each attending
        causally among the new rows and to every row cached before → [1, M, h·d]."""
        q = self.q(x, cos, sin)
        k, v = self.kv(x, cos, sin)
        past = cache.length
        cache.append(k, v)
        return attend(q, cache.k, cache.v, PrefixMask.appended(past, x.shape[1], x.device), [], [])


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)), x [..., H] → [..., H]."""

    def __init__(self, cfg: BlockShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [B, T] → x[t+1] at every t [B, T], the last one clamped (such steps are masked out)."""
    return torch.cat((input_ids[:, 1:], input_ids[:, -1:]), dim=1)


def chain_tokens(input_ids: torch.Tensor, starts: torch.Tensor, j: int) -> torch.Tensor:
    """The token that draft step j of each chain reads, x[s+1+j] (clamped at the row's end) → [B, M]."""
    return torch.gather(input_ids, 1, (starts + 1 + j).clamp(max=input_ids.shape[1] - 1))


def at_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, F] at positions idx [B, M] → [B, M, F]."""
    return torch.gather(x, 1, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


ATTN_BLOCK_BYTES = 16 * 2**20  # fp32 scores of one query block at most (attend's default)


@dataclass(frozen=True)
class PrefixMask:
    """Which shared keys each query sees, without an [M, T] tensor: query m of row b sees key j iff
    j ≤ last[b, m] and key_valid[b, j], or every key when query_valid[b, m] is False (padding queries:
    no all −inf row).  :meth:`rows` builds the bool block of a range of queries when it is needed."""

    last: torch.Tensor  # [B, M] int64: the last shared key each query sees
    key_valid: torch.Tensor | None = None  # [B, T] bool: None = every key exists
    query_valid: torch.Tensor | None = None  # [B, M] bool: None = every query is real

    @classmethod
    def chains(cls, starts: torch.Tensor, starts_valid: torch.Tensor, valid: torch.Tensor) -> PrefixMask:
        """TTT chains: the chain starting at s (starts [B, M], starts_valid [B, M]) sees the row's valid
        (valid [B, T]) positions 0..s."""
        return cls(starts, valid, starts_valid)

    @classmethod
    def appended(cls, past: int, m: int, device: torch.device) -> PrefixMask:
        """m new rows appended after ``past`` cached ones: new row i sees 0..past+i (causal among the new)."""
        return cls(torch.arange(past, past + m, device=device).unsqueeze(0))

    def rows(self, lo: int, hi: int, t: int) -> torch.Tensor:
        """The bool mask [B, 1, hi−lo, t] of queries lo..hi−1 over t shared keys."""
        allow = torch.arange(t, device=self.last.device).view(1, 1, t) <= self.last[:, lo:hi].unsqueeze(-1)
        if self.key_valid is not None:
            allow = allow & self.key_valid.unsqueeze(1)
        if self.query_valid is not None:
            allow = allow | ~self.query_valid[:, lo:hi].unsqueeze(-1)
        return allow.unsqueeze(1)


def attend(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    mask: PrefixMask,
    diag_k: list[torch.Tensor],
    diag_v: list[torch.Tensor],
    block_bytes: int | None = None,
) -> torch.Tensor:
    """Attention over a shared key set plus per-query private keys, in query blocks.

    q [B, h, M, d]; k0, v0 [B, kv, T, d]; ``mask`` which shared keys each query sees;
    diag_k[i], diag_v[i] [B, kv, M, d]: key/value i is seen only by the query in the same row m (the
    earlier steps of the same draft chain).  Returns [B, M, h·d].

    Queries run in blocks of c = ⌊block_bytes / (4·B·h·(T + len(diag_k)))⌋ rows (``block_bytes`` None:
    :data:`ATTN_BLOCK_BYTES`), so the fp32 scores never exceed ``block_bytes`` per block.  Under autograd
    each block is checkpointed (its scores are recomputed in backward rather than kept), so memory is
    linear in T: O(B·M·h·d) saved, one block's scores alive at a time.
    When all M queries fit one block this is a single plain computation (nothing recomputed).
    """
    b, h, m, _ = q.shape
    t = k0.shape[2]
    per_query = 4 * b * h * (t + len(diag_k))
    c = max(1, (block_bytes or ATTN_BLOCK_BYTES) // max(1, per_query))
    if c >= m:
        return _attend_rows(q, k0, v0, mask.rows(0, m, t), diag_k, diag_v)
    recompute = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k0, v0, *diag_k, *diag_v))
    outs = []
    for lo in range(0, m, c):
        hi = min(m, lo + c)
        args = (
            q[:, :, lo:hi],
            k0,
            v0,
            mask,
            lo,
            hi,
            [x[:, :, lo:hi] for x in diag_k],
            [x[:, :, lo:hi] for x in diag_v],
        )
        if recompute:
            from torch.utils.checkpoint import checkpoint

            outs.append(checkpoint(_attend_block, *args, use_reentrant=False))
        else:
            outs.append(_attend_block(*args))
    return torch.cat(outs, dim=1)


def _attend_block(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    mask: PrefixMask,
    lo: int,
    hi: int,
    diag_k: list[torch.Tensor],
    diag_v: list[torch.Tensor],
) -> torch.Tensor:
    return _attend_rows(q, k0, v0, mask.rows(lo, hi, k0.shape[2]), diag_k, diag_v)


def _attend_rows(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    allow: torch.Tensor,
    diag_k: list[torch.Tensor],
    diag_v: list[torch.Tensor],
) -> torch.Tensor:
    """:func:`attend` of one query block with its bool mask allow [B, 1, M, T]; fp32 softmax."""
    b, h, m, d = q.shape
    rep = h // k0.shape[1]
    scale = 1.0 / math.sqrt(d)
    qg = q.reshape(b, k0.shape[1], rep, m, d)  # group queries by kv head: no K/V copies for GQA
    s0 = torch.matmul(qg, k0.unsqueeze(2).transpose(-1, -2)).float() * scale  # [B, kv, rep, M, T]
    s0 = s0.masked_fill(~allow.unsqueeze(2), float("-inf"))
    parts = [s0]
    for kd in diag_k:
        parts.append(((qg * kd.unsqueeze(2)).sum(-1).float() * scale).unsqueeze(-1))  # [B, kv, rep, M, 1]
    p = torch.cat(parts, dim=-1).softmax(dim=-1).to(q.dtype)
    t = k0.shape[2]
    out = torch.matmul(p[..., :t], v0.unsqueeze(2))  # [B, kv, rep, M, d]
    for i, vd in enumerate(diag_v):
        out = out + p[..., t + i : t + i + 1] * vd.unsqueeze(2)
    return out.reshape(b, h, m, d).transpose(1, 2).reshape(b, m, h * d)


@dataclass
class KVCache:
    """Draft KV cache for one sequence: rows in insertion order with their RoPE positions."""

    k: torch.Tensor  # [1, kv, L, d]
    v: torch.Tensor  # [1, kv, L, d]

    @classmethod
    def empty(cls, attn: Attention, like: torch.Tensor) -> KVCache:
        """No rows yet, for ``attn``'s keys, in ``like``'s dtype and device (the head's parameters)."""
        empty = torch.zeros(1, attn.n_kv, 0, attn.head_dim, dtype=like.dtype, device=like.device)
        return cls(empty, empty.clone())

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def truncate(self, n: int) -> None:
        self.k = self.k[:, :, :n]
        self.v = self.v[:, :, :n]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = torch.cat((self.k, k), dim=2)
        self.v = torch.cat((self.v, v), dim=2)
