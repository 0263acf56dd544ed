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


class BlockShape(Protocol):
    """The shape fields a decoder block reads (``Eagle3Config`` and ``MTPConfig`` both have them)."""

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
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def rope_parameters(self) -> dict[str, Any]: ...


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


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)), x [..., H] → [..., H]."""

    def __init__(self, cfg: BlockShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def attend(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    allow: torch.Tensor,
    diag_k: list[torch.Tensor],
    diag_v: list[torch.Tensor],
) -> torch.Tensor:
    """Attention over a shared key set plus per-query private keys.

    q [B, h, M, d]; k0, v0 [B, kv, T, d]; allow [B, 1, M, T] bool (which shared keys each query sees);
    diag_k[i], diag_v[i] [B, kv, M, d]: key/value i is seen only by the query in the same row m (the
    earlier steps of the same draft chain).  Returns [B, M, h·d].
    """
    b, h, m, d = q.shape
    rep = h // k0.shape[1]
    scale = 1.0 / math.sqrt(d)
    qg = q.view(b, k0.shape[1], rep, m, d)  # group queries by kv head: no K/V copies for GQA
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

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def truncate(self, n: int) -> None:
        self.k = self.k[:, :, :n]
        self.v = self.v[:, :, :n]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = torch.cat((self.k, k), dim=2)
        self.v = torch.cat((self.v, v), dim=2)
