"""EAGLE-3 draft head, matching vLLM's and SGLang's ``LlamaForCausalLMEagle3``.

One Llama decoder layer (docs/formats.md §1).  Step 0 at position t::

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
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from draft_align.conventions import default_aux_layer_ids
from draft_align.heads.draft_head import DraftConfigError, DraftModule, HeadKind, config_from_dict
from draft_align.heads.layers import (
    MLP,
    Attention,
    KVCache,
    LayerWidths,
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

ARCHITECTURE = "LlamaForCausalLMEagle3"


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
    rope_parameters: dict[str, Any] = field(default_factory=default_rope)
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
        return default_aux_layer_ids(num_layers)

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
        kwargs: dict[str, Any] = dict(
            **block_shape_from_target(tc),
            draft_vocab_size=min(int(draft_vocab_size), int(tc.vocab_size)),
            target_hidden_size=int(tc.hidden_size),
            aux_layer_ids=tuple(aux_layer_ids or cls.default_aux_layer_ids(n_layers)),
            target_num_layers=n_layers,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        return config_from_dict(cls, d)


def check_aux_order(ids: tuple[int, ...]) -> None:
    """Raise DraftConfigError unless ``ids`` are distinct and ascending."""
    if len(set(ids)) != len(ids):
        raise DraftConfigError(
            f"aux_layer_ids {list(ids)} are not distinct: vLLM de-duplicates them and the fc width would no "
            f"longer match (the engines' default (2, L//2, L-3) collides for small L; set draft.aux_layer_ids)"
        )
    if list(ids) != sorted(ids):
        raise DraftConfigError(
            f"aux_layer_ids {list(ids)} must be ascending (engines capture in layer order)"
        )


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


class Eagle3Shape(LayerWidths, Protocol):
    """The sizes that fix an EAGLE-3 head's engine tensors (:class:`Eagle3Config` has them all)."""

    @property
    def fc_in_features(self) -> int: ...
    @property
    def draft_vocab_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


def full_vocab(cfg: Eagle3Shape) -> bool:
    """Whether the draft vocabulary is the target's whole vocabulary: the engine tensors then carry no d2t/t2d
    (vLLM's EAGLE-3 model has no parameter for them and refuses them; speculators and SGLang take their absence
    as the identity), and ``lm_head`` rows are in target-id order."""
    return cfg.draft_vocab_size == cfg.vocab_size


def expected_shapes(cfg: Eagle3Shape) -> dict[str, tuple[int, ...]]:
    """Every engine tensor of the head, by its engine name (= this module's state-dict name), and its shape
    (no ``d2t``/``t2d`` for a :func:`full_vocab` draft)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    a = "midlayer.self_attn."
    m = "midlayer.mlp."
    shapes = {
        "fc.weight": (h, cfg.fc_in_features),
        a + "q_proj.weight": (q, 2 * h),  # q/k/v read cat(emb, hidden)
        a + "k_proj.weight": (kv, 2 * h),
        a + "v_proj.weight": (kv, 2 * h),
        a + "o_proj.weight": (h, q),
        m + "gate_proj.weight": (inter, h),
        m + "up_proj.weight": (inter, h),
        m + "down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
    }
    if not full_vocab(cfg):
        shapes["d2t"] = (cfg.draft_vocab_size,)
        shapes["t2d"] = (cfg.vocab_size,)
    return shapes


class MidLayer(nn.Module):
    """The single EAGLE-3 decoder layer (``norm_before_residual: false``)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size)  # q/k/v read cat(emb, hidden)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # [B, M, H] x2 → [B, M, 2H]; the embedding half comes first, as in both engines
        return torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        # attn_out [B, M, h·d] → pre-norm output [B, M, H]
        r = hidden + self.self_attn.o_proj(attn_out)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Draft(DraftModule):
    """The EAGLE-3 head.  The token embedding is the target's and is passed in, never owned."""

    kind: HeadKind = "eagle3"
    shares_target_head = False  # its own lm_head over the draft vocabulary

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
            raise DraftConfigError(
                f"{d2t.numel()} selected ids for draft_vocab_size {self.cfg.draft_vocab_size}"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """Exactly the tensors an engine loads (rotary caches excluded).  A :func:`full_vocab` draft's
        ``lm_head`` rows are put in target-id order and its d2t/t2d left out: the same draft, in the only
        layout vLLM loads."""
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        if full_vocab(self.cfg):
            order = torch.argsort(self.draft_to_target)  # row of target id t = the draft id mapped to t
            sd["lm_head.weight"] = sd["lm_head.weight"][order.to(sd["lm_head.weight"].device)]
            del sd["d2t"], sd["t2d"]
        return sd

    @staticmethod
    def identity_vocab(cfg: Eagle3Shape) -> dict[str, torch.Tensor]:
        """The d2t/t2d of a :func:`full_vocab` draft whose ``lm_head`` is in target-id order (what a loader
        fills in when the engine tensors leave them out)."""
        return {
            "d2t": torch.zeros(cfg.draft_vocab_size, dtype=torch.long),
            "t2d": torch.ones(cfg.vocab_size, dtype=torch.bool),
        }

    # ----------------------------------------------------------------- training: TTT unroll
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
        layer = self.midlayer
        attn = layer.self_attn
        pos_all = torch.arange(t, device=input_ids.device).expand(b, t)
        h0 = self.fc(aux)  # [B, T, H]
        cos, sin = self.rotary(h0, pos_all)
        x0 = layer.attn_input(embed(next_tokens(input_ids)), h0)
        k0, v0 = attn.kv(x0, cos, sin)
        # Only keys/values are needed at every position; queries and everything after attention run
        # on the chain starts alone (prompt positions that start no chain cost just fc + qkv).
        mask = PrefixMask.chains(starts, starts_valid, valid)
        q = attn.q(at_rows(x0, starts), at_rows(cos, starts), at_rows(sin, starts))
        hid = layer.finish(at_rows(h0, starts), attend(q, k0, v0, mask, [], []))
        logits = [self.norm(hid)]
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        for j in range(1, steps):
            cos, sin = self.rotary(hid, starts + j)
            x = layer.attn_input(embed(chain_tokens(input_ids, starts, j)), hid)
            q = attn.q(x, cos, sin)
            k, v = attn.kv(x, cos, sin)
            diag_k.append(k)
            diag_v.append(v)
            out = attend(q, k0, v0, mask, diag_k, diag_v)
            hid = layer.finish(hid, out)
            logits.append(self.norm(hid))
        return logits

    # ----------------------------------------------------------------- inference: KV-cached
    def new_cache(self) -> KVCache:
        return KVCache.empty(self.midlayer.self_attn, next(self.parameters()))

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
        cos, sin = self.rotary(h, positions.unsqueeze(0))
        x = self.midlayer.attn_input(emb.unsqueeze(0), h)
        hid = self.midlayer.finish(h, self.midlayer.self_attn.decode(x, cos, sin, cache))
        return self.lm_head(self.norm(hid))[0], hid[0]
