"""EAGLE-3 draft head, matching vLLM's and SGLang's ``LlamaForCausalLMEagle3``.

One Llama decoder layer (REFERENCE.md §1).  Step 0 at position t::

    h   = fc(cat(aux_0[t], aux_1[t], aux_2[t]))          # [H]   (3·H_target → H)
    e   = embed_target(x[t+1])                           # [H]   target's embedding, frozen, not ours
    a   = attn(cat(input_layernorm(e), hidden_norm(h)))  # q/k/v read 2·H
    r   = h + a                                          # residual is h, not e
    out = r + mlp(post_attention_layernorm(r))           # pre-norm output: next step's h
    logits_draft = lm_head(norm(out))                    # [draft_vocab]

Later steps feed ``out`` as ``h`` and the next token's embedding as ``e`` at RoPE position t+j; their
attention sees step-0 keys at 0..t plus earlier steps' keys of the same chain at t+1..t+j-1.

Module names equal the engines' weight names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``), so ``state_dict()`` is already in engine format.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "LlamaForCausalLMEagle3"


class DraftConfigError(ValueError):
    """A draft configuration that no engine would load, or that does not fit its target."""


@dataclass(frozen=True)
class Eagle3Config:
    """Shapes of an EAGLE-3 head; derived sizes are computed in ``__post_init__``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # HF ``hidden_states`` indices of the target, ascending
    target_num_layers: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        ids = tuple(int(i) for i in self.aux_layer_ids)
        object.__setattr__(self, "aux_layer_ids", ids)
        if len(ids) < 1:
            raise DraftConfigError("aux_layer_ids must name at least one target layer")
        check_aux_order(ids)
        if ids[0] < 0 or ids[-1] > self.target_num_layers:
            raise DraftConfigError(
                f"aux_layer_ids {ids} outside the target's hidden_states indices 0..{self.target_num_layers}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise DraftConfigError(
                f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size ({self.vocab_size})"
            )
        if self.hidden_act != "silu":
            raise DraftConfigError(f"hidden_act {self.hidden_act!r}: only silu is supported by the engines")

    @property
    def fc_in_features(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size

    @staticmethod
    def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
        """The engines' default capture points, as HF ``hidden_states`` indices: (2, L//2, L-3)."""
        return (2, num_layers // 2, num_layers - 3)

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        draft_vocab_size: int,
        aux_layer_ids: tuple[int, ...] | None = None,
        **overrides: Any,
    ) -> Eagle3Config:
        """A draft layer shaped like one decoder layer of ``target_config`` (an HF ``PretrainedConfig``)."""
        tc = target_config
        n_layers = int(tc.num_hidden_layers)
        heads = int(tc.num_attention_heads)
        head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)
        rope = getattr(tc, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": float(getattr(tc, "rope_theta", 10000.0)),
        }
        kwargs: dict[str, Any] = dict(
            hidden_size=int(tc.hidden_size),
            intermediate_size=int(tc.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", heads) or heads),
            head_dim=head_dim,
            vocab_size=int(tc.vocab_size),
            draft_vocab_size=min(int(draft_vocab_size), int(tc.vocab_size)),
            target_hidden_size=int(tc.hidden_size),
            aux_layer_ids=tuple(aux_layer_ids or cls.default_aux_layer_ids(n_layers)),
            target_num_layers=n_layers,
            max_position_embeddings=int(tc.max_position_embeddings),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)),
            rope_parameters=dict(rope),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise DraftConfigError(f"unknown Eagle3Config keys: {sorted(unknown)}")
        return cls(**d)


def check_aux_order(ids: tuple[int, ...]) -> None:
    """Raise DraftConfigError unless ``ids`` are distinct and ascending."""
    if len(set(ids)) != len(ids):
        raise DraftConfigError(
            f"aux_layer_ids {list(ids)} are not distinct: vLLM de-duplicates them and the fc width would no "
            f"longer match (the engines' default (2, L//2, L-3) collides for small L; set draft.aux_layer_ids)"
        )
    if list(ids) != sorted(ids):
        raise DraftConfigError(f"aux_layer_ids {list(ids)} must be ascending (engines capture in layer order)")


ENGINE_NUM_AUX = 3  # vLLM and SGLang hard-code fc's input as 3·target_hidden_size


def check_engine_aux_ids(ids: tuple[int, ...], num_layers: int) -> None:
    """Raise DraftConfigError unless engines can capture ``ids``: exactly 3 distinct ascending HF
    ``hidden_states`` indices in 1..L−1 (index 0 has no residual yet in vLLM; index L is post-norm)."""
    ids = tuple(int(i) for i in ids)
    check_aux_order(ids)
    if len(ids) != ENGINE_NUM_AUX:
        raise DraftConfigError(
            f"aux_layer_ids {list(ids)}: vLLM and SGLang read exactly {ENGINE_NUM_AUX} aux layers "
            f"(fc input = 3·target_hidden_size)"
        )
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise DraftConfigError(
            f"aux_layer_ids {list(ids)} out of range for a {num_layers}-layer target: engines can capture "
            f"HF hidden_states indices 1..{num_layers - 1} only (got {bad})"
        )


class RMSNorm(nn.Module):
    """y = w · x / sqrt(mean(x²) + eps), computed in fp32 like HF Llama."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """RoPE with the target's parameters (any HF rope_type, via transformers' init functions)."""

    def __init__(self, cfg: Eagle3Config) -> None:
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
    """Grouped-query attention whose q/k/v read the 2·H concatenation of embedding and hidden."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, M, 2H] → rotated queries [B, h, M, d]."""
        b, m, _ = x.shape
        return rotate(self.q_proj(x).view(b, m, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, M, 2H] → rotated keys [B, kv, M, d], values [B, kv, M, d]."""
        b, m, _ = x.shape
        k = self.k_proj(x).view(b, m, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, m, self.n_kv, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The single EAGLE-3 decoder layer (``norm_before_residual: false``)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # [B, M, H] x2 → [B, M, 2H]; the embedding half comes first, as in both engines
        return torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        # attn_out [B, M, h·d] → pre-norm output [B, M, H]
        r = hidden + self.self_attn.o_proj(attn_out)
        return r + self.mlp(self.post_attention_layernorm(r))


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


class Eagle3Draft(nn.Module):
    """The EAGLE-3 head.  The token embedding is the target's and is passed in, never owned."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    # ----------------------------------------------------------------- vocabulary
    def set_vocab(self, selected: torch.Tensor) -> None:
        """selected [draft_vocab] target ids (distinct): d2t[i] = selected[i] − i, t2d = membership mask."""
        from draft_align.heads.vocab import d2t_t2d

        d2t, t2d = d2t_t2d(selected, self.cfg.vocab_size)
        if d2t.numel() != self.cfg.draft_vocab_size:
            raise DraftConfigError(f"{d2t.numel()} selected ids for draft_vocab_size {self.cfg.draft_vocab_size}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """Exactly the tensors an engine loads (rotary caches excluded)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}

    # ----------------------------------------------------------------- training: TTT unroll
    def unroll(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        """Like :meth:`unroll_hidden`, returning draft logits [B, M, draft_vocab] per step."""
        return [self.lm_head(x) for x in self.unroll_hidden(*args, **kwargs)]

    def unroll_hidden(
        self,
        aux: torch.Tensor,
        embed: nn.Module,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        starts: torch.Tensor,
        starts_valid: torch.Tensor,
        steps: int,
    ) -> list[torch.Tensor]:
        """Training-time-test unroll; returns draft logits per step.

        aux [B, T, n_aux·H_t] target aux states; input_ids [B, T]; valid [B, T] bool (not padding);
        starts [B, M] chain-start positions s whose steps are computed (sorted per row);
        starts_valid [B, M] bool.  Step j of chain s reads the embedding of x[s+1+j] (clamped at the end
        of the row; such steps must be masked out by the caller) at RoPE position s+j and predicts
        x[s+2+j].  Step 0 runs at every position (its keys are every later step's context); the
        lm_head's input exists only on the M chain starts.  Returns ``steps`` tensors [B, M, H]: the
        normed hidden states that ``lm_head`` maps to logits (the loss may apply it in its own way).
        """
        b, t = input_ids.shape
        dev = input_ids.device
        layer = self.midlayer
        attn = layer.self_attn
        pos_all = torch.arange(t, device=dev).expand(b, t)
        next_ids = torch.cat((input_ids[:, 1:], input_ids[:, -1:]), dim=1)  # x[t+1], last clamped
        h0 = self.fc(aux)  # [B, T, H]
        cos, sin = self.rotary(h0, pos_all)
        x0 = layer.attn_input(embed(next_ids), h0)
        k0, v0 = attn.kv(x0, cos, sin)
        # Only keys/values are needed at every position; queries and everything after attention run
        # on the chain starts alone (prompt positions that start no chain cost just fc + qkv).
        m = starts.shape[1]
        causal = torch.arange(t, device=dev).view(1, 1, t) <= starts.unsqueeze(-1)  # [B, M, T]
        allow = (causal & valid.unsqueeze(1) & starts_valid.unsqueeze(-1)).unsqueeze(1)  # [B, 1, M, T]
        allow = allow | ~starts_valid.view(b, 1, m, 1)  # padded rows see everything: no all -inf rows
        pick = starts.unsqueeze(-1)
        xs = torch.gather(x0, 1, pick.expand(b, m, x0.shape[-1]))  # [B, M, 2H]
        cs, sn = (torch.gather(c, 1, pick.expand(b, m, c.shape[-1])) for c in (cos, sin))
        q = attn.q(xs, cs, sn)
        hid = torch.gather(h0, 1, pick.expand(b, m, h0.shape[-1]))  # [B, M, H]
        hid = layer.finish(hid, attend(q, k0, v0, allow, [], []))
        logits = [self.norm(hid)]
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        for j in range(1, steps):
            tok_pos = (starts + 1 + j).clamp(max=t - 1)
            tok = torch.gather(input_ids, 1, tok_pos)  # [B, M]
            cos, sin = self.rotary(hid, starts + j)
            x = layer.attn_input(embed(tok), hid)
            q = attn.q(x, cos, sin)
            k, v = attn.kv(x, cos, sin)
            diag_k.append(k)
            diag_v.append(v)
            out = attend(q, k0, v0, allow, diag_k, diag_v)
            hid = layer.finish(hid, out)
            logits.append(self.norm(hid))
        return logits

    # ----------------------------------------------------------------- inference: KV-cached
    def new_cache(self) -> KVCache:
        a = self.midlayer.self_attn
        p = next(self.parameters())
        empty = torch.zeros(1, a.n_kv, 0, a.head_dim, dtype=p.dtype, device=p.device)
        return KVCache(empty, empty.clone())

    @torch.no_grad()
    def step(
        self,
        cache: KVCache,
        hidden: torch.Tensor,
        emb: torch.Tensor,
        positions: torch.Tensor,
        from_target: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the layer on M new rows of one sequence, appending their K/V to ``cache``.

        hidden [M, n_aux·H_t] (``from_target``: target aux states, fc applied) or [M, H] (the draft's own
        pre-norm output); emb [M, H] embeddings of the next tokens; positions [M] RoPE positions.
        The new rows attend causally among themselves and to everything already cached.
        Returns (draft logits [M, draft_vocab], pre-norm hidden [M, H]).
        """
        h = self.fc(hidden) if from_target else hidden
        h = h.unsqueeze(0)
        m = h.shape[1]
        cos, sin = self.rotary(h, positions.unsqueeze(0))
        x = self.midlayer.attn_input(emb.unsqueeze(0), h)
        q = self.midlayer.self_attn.q(x, cos, sin)
        k, v = self.midlayer.self_attn.kv(x, cos, sin)
        past = cache.length
        cache.append(k, v)
        allow = torch.ones(m, past + m, dtype=torch.bool, device=h.device)
        allow[:, past:] = torch.ones(m, m, dtype=torch.bool, device=h.device).tril()
        out = attend(q, cache.k, cache.v, allow.view(1, 1, m, past + m), [], [])
        hid = self.midlayer.finish(h, out)
        return self.lm_head(self.norm(hid))[0], hid[0]
