"""Multi-token-prediction (MTP) draft head, as DeepSeek-V3 and Qwen3-Next ship it (docs/formats.md §3).

One MTP module per depth d = 0..D−1.  Step 0 at position t (same alignment as EAGLE-3: it predicts
x[t+2] and is scored against the target's distribution at t+1)::

    e   = embed_target(x[t+1])                            # [H] target's embedding, frozen, not ours
    x   = eh_proj(cat(enorm(e), hnorm(h_target[t])))      # [H] (2·H → H, no bias)
    r   = x + attn(input_layernorm(x))                    # a plain Llama decoder block
    out = r + mlp(post_attention_layernorm(r))            # pre-norm output
    logits = lm_head(norm(out))                           # target's lm_head: shared, frozen

``h_target`` is the target's final POST-norm hidden state (HF ``hidden_states[L]``, what vLLM hands its
MTP drafter), so the head reads "aux layer" L: every tap, batch and estimator built for EAGLE-3 aux
states carries it unchanged (``cfg.aux_layer_ids == (L,)``).

Later draft steps j = 1..k−1 run module j mod D (vLLM's ``spec_step_idx % num_mtp_layers``) at RoPE
position t+j on the previous step's output hidden and the embedding of the previous draft token.  The
chained hidden is ``out`` in the DeepSeek-V3 layout and ``norm(out)`` in the Qwen3-Next layout (each
engine feeds back what its forward returns); DeepSeek's forward also zeroes the embedding at position 0.
Module 0 holds the committed context (one row per position t, keys at t); a step's attention sees those
keys at 0..t plus the earlier steps of its own chain that ran the same module.  Modules d ≥ 1 thus see
only their own chain rows (engines run them on nothing else).

The trunk never learns from this head: target hidden states and embeddings are detached on entry, and the
lm_head is a frozen copy of the target's (never trained, refreshed from HeadSync).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from draft_align.conventions import MTPLayout
from draft_align.heads.draft_head import (
    DraftConfigError,
    HeadKind,
    SharedHeadConfig,
    SharedHeadDraft,
    config_from_dict,
)
from draft_align.heads.layers import (
    MLP,
    Attention,
    KVCache,
    PrefixMask,
    RMSNorm,
    Rotary,
    at_rows,
    attend,
    block_shape_from_target,
    chain_tokens,
    default_rope,
    next_tokens,
)

Layout = MTPLayout
LAYOUTS: tuple[str, ...] = ("deepseek_v3", "qwen3_next")


@dataclass(frozen=True)
class MTPConfig(SharedHeadConfig):
    """Shapes of an MTP head; the target's hidden size is the head's (MTP reads the final hidden state)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_num_layers: int  # N: DeepSeek names module d ``model.layers.{N+d}``
    max_position_embeddings: int
    depth: int = 1
    layout: str = "deepseek_v3"
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    rope_parameters: dict[str, Any] = field(default_factory=default_rope)
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise DraftConfigError(f"MTP depth {self.depth} must be ≥ 1")
        if self.layout not in LAYOUTS:
            raise DraftConfigError(f"MTP layout {self.layout!r}: expected one of {LAYOUTS}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise DraftConfigError(f"hidden_act {self.hidden_act!r}: only silu is supported")

    @property
    def chain_post_norm(self) -> bool:
        """Whether a later step reads ``norm(out)`` (Qwen3-Next) rather than ``out`` (DeepSeek-V3)."""
        return self.layout == "qwen3_next"

    @property
    def zero_embed_at_pos0(self) -> bool:
        return self.layout == "deepseek_v3"

    @classmethod
    def from_target(
        cls, target_config: Any, depth: int = 1, layout: str = "deepseek_v3", **overrides: Any
    ) -> MTPConfig:
        """An MTP head whose block is shaped like one decoder layer of ``target_config`` (HF config)."""
        kwargs: dict[str, Any] = dict(
            **block_shape_from_target(target_config),
            target_num_layers=int(target_config.num_hidden_layers),
            depth=int(depth),
            layout=layout,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MTPConfig:
        return config_from_dict(cls, d)


class MTPModule(nn.Module):
    """One depth: the embedding/hidden fusion and a Llama decoder block (names as in both layouts)."""

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(cfg, cfg.hidden_size)  # a plain Llama block: q/k/v read H
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)

    def fuse(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, M, H] x2 → eh_proj(cat(enorm(emb), hnorm(hidden))) [B, M, H]; the embedding half first."""
        return self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(hidden)), dim=-1))

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """x [B, M, H] block input, attn_out [B, M, h·d] → pre-norm block output [B, M, H]."""
        r = x + self.self_attn.o_proj(attn_out)
        return r + self.mlp(self.post_attention_layernorm(r))


@dataclass
class MTPCache:
    """Per-depth KV caches of one sequence.  ``caches[0]`` holds the committed context (one row per
    position) followed by the current chain's module-0 rows; deeper modules hold only chain rows."""

    caches: list[KVCache]
    chain_step: int = 0  # draft step of the next ``from_target=False`` call

    @property
    def length(self) -> int:
        return self.caches[0].length

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` module-0 rows; drop every deeper module's (speculative) rows."""
        self.caches[0].truncate(n)
        for c in self.caches[1:]:
            c.truncate(0)
        self.chain_step = 0


class MTPDraft(SharedHeadDraft):
    """The MTP head.  The embedding is the target's and is passed in; ``lm_head`` is a frozen copy of the
    target's (``shares_target_head``), set by :meth:`set_head` and never trained."""

    kind: HeadKind = "llama_block_mtp"

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(MTPModule(cfg) for _ in range(cfg.depth))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._init_shared_head(cfg.hidden_size, cfg.vocab_size)
        self.rotary = Rotary(cfg)

    # ----------------------------------------------------------------- construction
    @classmethod
    def attach(
        cls, target: nn.Module, depth: int = 1, layout: str = "deepseek_v3", init_from_last_layer: bool = True
    ) -> MTPDraft:
        """A fresh head for an HF decoder-only ``target`` that has none (warm-start).

        Each block starts as a copy of the target's last decoder layer (``init_from_last_layer``); eh_proj
        starts as [I | I] (sum of the normed embedding and hidden), the final norm as the target's, and
        the lm_head is the target's (frozen).
        """
        from draft_align.hf.parts import decoder_parts

        _, layers, norm, lm_head = decoder_parts(target)
        cfg = MTPConfig.from_target(target.config, depth=depth, layout=layout)
        draft = cls(cfg)
        h = cfg.hidden_size
        last = layers[-1]
        p = next(draft.parameters())
        with torch.no_grad():
            for mod in draft.layers:
                mod.eh_proj.weight.copy_(torch.cat((torch.eye(h), torch.eye(h)), dim=1))
                if init_from_last_layer:
                    src = {k: v for k, v in last.state_dict().items() if "rotary" not in k}
                    missing, unexpected = mod.load_state_dict(src, strict=False)
                    unexpected = [k for k in unexpected if not k.endswith("inv_freq")]
                    if unexpected:
                        raise DraftConfigError(
                            f"target's last layer has weights an MTP block lacks: {unexpected} (not a Llama layer)"
                        )
            draft.norm.weight.copy_(norm.weight.detach().to(p.dtype))
        draft.set_head(lm_head.weight)
        return draft

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """Module-named tensors (``layers.{d}.*``, ``norm.weight``, ``lm_head.weight``); layouts map them."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}

    # ----------------------------------------------------------------- helpers
    def _embed(self, embed: Any, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        e = embed(ids).detach()
        if self.cfg.zero_embed_at_pos0:
            e = e * (positions != 0).unsqueeze(-1).to(e.dtype)
        return e

    def _chain(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out) if self.cfg.chain_post_norm else out

    # ----------------------------------------------------------------- training: unroll
    def unroll_hidden(
        self,
        aux: torch.Tensor,
        embed: Any,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        starts: torch.Tensor,
        starts_valid: torch.Tensor,
        steps: int,
    ) -> list[torch.Tensor]:
        """Teacher-forced unroll of ``steps`` draft steps from each chain start (EAGLE-3's signature).

        aux [B, T, H] the target's final post-norm hidden (detached here); input_ids [B, T]; valid [B, T];
        starts [B, M] chain starts s; starts_valid [B, M].  Step j of chain s runs module j mod D at RoPE
        position s+j on embed(x[s+1+j]) (clamped at the row's end; the caller masks such steps) and
        predicts x[s+2+j].  Returns ``steps`` tensors [B, M, H]: norm(out), the lm_head's input.
        """
        b, t = input_ids.shape
        d = self.cfg.depth
        aux = aux.detach()
        pos_all = torch.arange(t, device=input_ids.device).expand(b, t)
        m0 = self.layers[0]
        x0 = m0.fuse(
            self._embed(embed, next_tokens(input_ids), pos_all), aux
        )  # [B, T, H] block inputs of step 0
        cos, sin = self.rotary(x0, pos_all)
        k0, v0 = m0.self_attn.kv(m0.input_layernorm(x0), cos, sin)
        mask = PrefixMask.chains(starts, starts_valid, valid)
        xs = at_rows(x0, starts)  # [B, M, H]
        q = m0.self_attn.q(m0.input_layernorm(xs), at_rows(cos, starts), at_rows(sin, starts))
        out = m0.finish(xs, attend(q, k0, v0, mask, [], []))
        hidden = [self.norm(out)]
        diag: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(d)]
        empty_k = k0[:, :, :0]
        no_shared = PrefixMask(starts)  # modules d ≥ 1 see only their own chain rows
        for j in range(1, steps):
            mod_i = j % d
            mod = self.layers[mod_i]
            pos = starts + j
            x = mod.fuse(self._embed(embed, chain_tokens(input_ids, starts, j), pos), self._chain(out))
            cos, sin = self.rotary(x, pos)
            a_in = mod.input_layernorm(x)
            q = mod.self_attn.q(a_in, cos, sin)
            k, v = mod.self_attn.kv(a_in, cos, sin)
            dk, dv = diag[mod_i]
            dk.append(k)
            dv.append(v)
            if mod_i == 0:
                att = attend(q, k0, v0, mask, dk, dv)
            else:
                att = attend(q, empty_k, empty_k, no_shared, dk, dv)
            out = mod.finish(x, att)
            hidden.append(self.norm(out))
        return hidden

    # ----------------------------------------------------------------- inference: KV-cached
    def new_cache(self) -> MTPCache:
        m0 = self.layers[0]
        return MTPCache([KVCache.empty(m0.self_attn, m0.eh_proj.weight) for _ in range(self.cfg.depth)])

    @torch.no_grad()
    def step(
        self,
        cache: MTPCache,
        hidden: torch.Tensor,
        emb: torch.Tensor,
        positions: torch.Tensor,
        from_target: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run M new rows of one sequence, appending their K/V (EAGLE-3's ``step`` contract).

        ``from_target``: hidden [M, H] is the target's final post-norm hidden at ``positions`` (committed
        context, module 0; the chain restarts); else hidden [1, H] is the previous step's output and the row
        is the next draft step of the chain (module ``chain_step mod D``).  emb [M, H] embeddings of the
        next tokens; positions [M] RoPE positions.  New rows attend causally among themselves and to the
        module's cached rows.  Returns (logits [M, V], the hidden the next step reads [M, H]).
        """
        if from_target:
            cache.chain_step = 0
            mod_i = 0
        else:
            cache.chain_step += 1
            mod_i = cache.chain_step % self.cfg.depth
        mod = self.layers[mod_i]
        kv = cache.caches[mod_i]
        h = hidden.unsqueeze(0)
        pos = positions.unsqueeze(0)
        e = emb.unsqueeze(0)
        if self.cfg.zero_embed_at_pos0:
            e = e * (pos != 0).unsqueeze(-1).to(e.dtype)
        x = mod.fuse(e, h)
        cos, sin = self.rotary(x, pos)
        out = mod.finish(x, mod.self_attn.decode(mod.input_layernorm(x), cos, sin, kv))
        normed = self.norm(out)
        chained = normed if self.cfg.chain_post_norm else out
        return self.lm_head(normed)[0], chained[0]
