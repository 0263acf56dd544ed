"""A model's own MTP layer built as megatron-core's ``MultiTokenPredictionLayer`` (``draft.mtp_impl: megatron``;
docs/mtp.md "The Megatron path").

The same head as :class:`~draft_align.heads.native_mtp.NativeMTPDraft` (its TTT unroll, step decoder, glue
semantics and export), but each depth is megatron-core's own MTP layer, built with the local (non-Transformer-
Engine) layer spec from a ``TransformerConfig`` derived from the target's HF config: ``enorm``, ``hnorm``,
``eh_proj`` (megatron concatenates ``(embedding, hidden)``), ``transformer_layer`` and ``final_layernorm``.  The
head reads what megatron's ``GPTModel`` feeds its MTP block: the decoder's output after ``final_layernorm`` (HF
``hidden_states[L]``, the Tap's ``final_hidden``).  Only the glue is written here:

- the fuse is the layer's own ``_concat_embeddings`` (enorm, hnorm, eh_proj); the block is its
  ``transformer_layer`` run on sequence-first rows with a boolean mask (True = masked, megatron's convention) and
  megatron's ``RotaryEmbedding`` indexed at each row's position; ``out_norm`` is its ``final_layernorm``;
- which hidden the next draft step reads follows the family as vLLM's drafter chains it (GLM-4.5: the
  pre-norm output; megatron's own training block chains the post-norm one), so the head serves as it trains;
- position 0's embedding is zeroed as vLLM's drafters do (megatron's training roll does not).

Weights: the head's state is megatron's parameter names (``mtp.layers.{d}.enorm.weight``,
``...transformer_layer.self_attention.linear_qkv.weight`` with q/k/v grouped per query group,
``...mlp.linear_fc1.weight`` = [gate; up]), as a megatron GPTModel with an MTP block holds them
(:func:`megatron_state_dict`, :func:`load_megatron_state`); :func:`hf_to_megatron` / :func:`megatron_to_hf`
convert to and from the family's HF names, so :func:`from_checkpoint` / :func:`to_checkpoint` read and write
exactly what the transformers-built head does (bit for bit).

Scope: families whose MTP block is a GQA decoder layer (:data:`MEGATRON_FAMILIES`: GLM-4.5, its MTP layer dense
or a mixture of experts with GLM's sigmoid router and shared experts, megatron's ``SequentialMLP`` experts named
``mlp.experts.local_experts.{e}``; MiMo); MLA (DeepSeek-V3) is refused in one line.  megatron-core's model-parallel state must
be initialised with every parallel size 1 (``parallel_state.initialize_model_parallel(1, 1)``); on a
CPU-only machine megatron-core also needs ``torch.cuda.current_device`` to answer "cpu" (the tests' setup).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draft_align.heads.draft_head import DraftConfigError
from draft_align.heads.native_mtp import EMBED, NativeMTPConfig, NativeMTPDraft, require_mtp_tensors

#: families whose MTP block megatron-core's local GPT layer spec expresses and whose names are mapped here
MEGATRON_FAMILIES = ("glm4_moe", "mimo")
#: the megatron glue name of each of our glue names (native_mtp's ``MTPFamily.glue``)
GLUE = {"emb_norm": "enorm", "hidden_norm": "hnorm", "proj": "eh_proj", "out_norm": "final_layernorm"}
PREFIX = "mtp.layers.{d}."  # where a megatron GPTModel keeps MTP layer d


def _megatron() -> dict[str, Any]:
    """The megatron-core pieces the head is built from; one line when megatron-core is not installed."""
    names = {
        "TransformerConfig": "megatron.core.transformer.transformer_config",
        "get_gpt_layer_local_spec": "megatron.core.models.gpt.gpt_layer_specs",
        "get_mtp_layer_spec": "megatron.core.transformer.multi_token_prediction",
        "build_module": "megatron.core.transformer.spec_utils",
        "ProcessGroupCollection": "megatron.core.process_groups_config",
        "RotaryEmbedding": "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "parallel_state": "megatron.core",
    }
    out: dict[str, Any] = {}
    for name, module in names.items():
        try:
            out[name] = getattr(importlib.import_module(module), name)
        except ImportError as e:
            raise DraftConfigError(
                f"draft.mtp_impl=megatron needs megatron-core (pip install megatron-core): {e}"
            ) from e
    return out


def _shape(cfg: NativeMTPConfig) -> dict[str, Any]:
    """The target's attention and MLP shape as megatron needs it; one line for what the mapping cannot express."""
    t, fam = cfg.target_config, cfg.family
    if fam not in MEGATRON_FAMILIES:
        raise DraftConfigError(
            f"draft.mtp_impl=megatron: family {fam!r} ({cfg.spec.architecture}) is not mapped onto megatron-core's "
            f"MTP layer here (MLA attention); supported {', '.join(MEGATRON_FAMILIES)}, or use mtp_impl=transformers"
        )
    n = cfg.target_num_layers
    moe: dict[str, Any] | None = None
    if fam == "glm4_moe":
        first_dense = int(t.get("first_k_dense_replace") or 0)
        kinds = {n + d >= first_dense for d in range(cfg.depth)}
        if kinds == {True, False}:
            raise DraftConfigError(
                f"draft.mtp_impl=megatron: the {cfg.spec.architecture} MTP layers mix dense and expert layers "
                f"(first_k_dense_replace={first_dense}); megatron builds them from one layer spec"
            )
        if kinds == {True}:
            if not t.get("norm_topk_prob", True):
                raise DraftConfigError(
                    "draft.mtp_impl=megatron: norm_topk_prob=false is not mapped (megatron's sigmoid router "
                    "normalises the top-k weights)"
                )
            moe = {
                "experts": int(t["n_routed_experts"]),
                "topk": int(t["num_experts_per_tok"]),
                "ffn": int(t["moe_intermediate_size"]),
                "shared_ffn": int(t.get("n_shared_experts") or 0) * int(t["moe_intermediate_size"]),
                "scale": float(t.get("routed_scaling_factor") or 1.0),
                "groups": int(t.get("n_group") or 1),
                "group_topk": int(t.get("topk_group") or 1),
            }
    if t.get("use_qk_norm"):
        raise DraftConfigError("draft.mtp_impl=megatron: use_qk_norm=true is not mapped (q/k norms)")
    rope = dict(t.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default" or t.get("rope_scaling"):
        raise DraftConfigError(
            f"draft.mtp_impl=megatron: RoPE type {rope.get('rope_type')!r} is not mapped (plain RoPE only)"
        )
    if t.get("hidden_act", "silu") != "silu":
        raise DraftConfigError(
            f"draft.mtp_impl=megatron: hidden_act {t.get('hidden_act')!r} (SwiGLU/silu only)"
        )
    heads = int(t["num_attention_heads"])
    return {
        "heads": heads,
        "groups": int(t.get("num_key_value_heads") or heads),
        "head_dim": int(t.get("head_dim") or cfg.hidden_size // heads),
        "ffn": int(t["intermediate_size"]),
        "eps": float(t["rms_norm_eps"]),
        "qkv_bias": fam == "mimo" or bool(t.get("attention_bias")),  # Qwen2 (MiMo) always biases q, k, v
        "theta": float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
        "rotary_percent": float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0))),
        "moe": moe,  # None: a dense MLP
    }


def megatron_config(cfg: NativeMTPConfig) -> Any:
    """megatron-core's ``TransformerConfig`` of the target (N decoder layers, D MTP layers), CPU-initialised,
    without fusions or dropout."""
    m, s = _megatron(), _shape(cfg)
    moe = s["moe"]
    experts = (
        {}
        if moe is None
        else {  # GLM-4.5's router: sigmoid scores, a selection bias, group top-k, normalised and scaled weights
            "num_moe_experts": moe["experts"],
            "moe_ffn_hidden_size": moe["ffn"],
            "moe_router_topk": moe["topk"],
            "moe_shared_expert_intermediate_size": moe["shared_ffn"] or None,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_topk_scaling_factor": moe["scale"],
            "moe_router_num_groups": moe["groups"],
            "moe_router_group_topk": moe["group_topk"],
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_token_dispatcher_type": "allgather",
        }
    )
    return m["TransformerConfig"](
        num_layers=cfg.target_num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=s["heads"],
        num_query_groups=s["groups"],
        kv_channels=s["head_dim"],
        ffn_hidden_size=s["ffn"],
        normalization="RMSNorm",
        layernorm_epsilon=s["eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=s["qkv_bias"],
        mtp_num_layers=cfg.depth,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **experts,
    )


class MegatronMTPLayer(nn.Module):
    """One depth: megatron-core's ``MultiTokenPredictionLayer`` (``mtp``) behind the interface the unroll uses."""

    def __init__(self, mtp: nn.Module) -> None:
        super().__init__()
        self.mtp = mtp

    def fuse(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb, hidden [B, M, H] → eh_proj(cat(enorm(emb), hnorm(hidden))) [B, M, H] (megatron's own fuse)."""
        return self.mtp._concat_embeddings(hidden.transpose(0, 1), emb.transpose(0, 1)).transpose(0, 1)

    def out_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.mtp.final_layernorm(x)


class MegatronMTPDraft(NativeMTPDraft):
    """:class:`NativeMTPDraft` whose depths are megatron-core's MTP layers (kind "native_mtp": published, served
    and trained as the transformers-built head)."""

    def _build_blocks(self, cfg: NativeMTPConfig) -> tuple[nn.ModuleList, nn.Module]:
        m, s = _megatron(), _shape(cfg)
        ps = m["parallel_state"]
        if not ps.model_parallel_is_initialized():
            raise DraftConfigError(
                "draft.mtp_impl=megatron: megatron-core's model-parallel state is not initialised "
                "(megatron.core.parallel_state.initialize_model_parallel(1, 1))"
            )
        sizes = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
        )
        if sizes != (1, 1, 1, 1):
            raise DraftConfigError(
                f"draft.mtp_impl=megatron: tensor/pipeline/context/expert-parallel sizes {sizes}; the MTP head runs "
                "unsharded (all 1)"
            )
        mcfg = megatron_config(cfg)
        spec = m["get_mtp_layer_spec"](
            m["get_gpt_layer_local_spec"](
                num_experts=None if s["moe"] is None else s["moe"]["experts"], normalization="RMSNorm"
            ),
            use_transformer_engine=False,
        )
        groups = m["ProcessGroupCollection"].use_mpu_process_groups(required_pgs=["tp", "cp"])
        layers = nn.ModuleList(
            MegatronMTPLayer(m["build_module"](spec, config=mcfg, layer_number=d + 1, pg_collection=groups))
            for d in range(cfg.depth)
        )
        rotary = m["RotaryEmbedding"](
            kv_channels=s["head_dim"],
            rotary_percent=s["rotary_percent"],
            rotary_base=s["theta"],
            use_cpu_initialization=True,
        )
        return layers, rotary

    def _run(self, layer: Any, x: torch.Tensor, pos: torch.Tensor, allow: torch.Tensor) -> torch.Tensor:
        """megatron's transformer layer on rows x [B, Q, H] at RoPE positions pos [B, Q] (megatron's rotary
        table indexed per row) under bool mask allow [B, 1, Q, Q]."""
        table = self.rotary(int(pos.max()) + 1)[:, 0, 0]  # [S, d]: megatron's RoPE angles of positions 0..S-1
        freqs = table.to(x.device)[pos].transpose(0, 1).unsqueeze(2)  # [Q, B, 1, d]
        out, _ = layer.mtp.transformer_layer(
            hidden_states=x.transpose(0, 1), attention_mask=~allow, rotary_pos_emb=freqs
        )
        return out.transpose(0, 1)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return to_checkpoint(self)

    # megatron's local linear layers save an ``_extra_state`` of None (Transformer Engine's FP8 metadata slot):
    # the head's state dict leaves them out so it holds tensors only (the trainer's checkpoints save it as is)
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        sd = super().state_dict(*args, **kwargs)
        for k in [k for k, v in sd.items() if k.endswith("._extra_state") and v is None]:
            del sd[k]
        return sd

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        full = dict(state_dict)
        for k, v in super().state_dict().items():
            if k.endswith("._extra_state") and v is None:
                full.setdefault(k, None)
        return super().load_state_dict(full, strict=strict, assign=assign)


# ---------------------------------------------------------------------- names: megatron ↔ the family's
def megatron_state_dict(draft: MegatronMTPDraft) -> dict[str, torch.Tensor]:
    """The MTP layers' tensors under megatron's own names (``mtp.layers.{d}.*``, as a GPTModel holds them)."""
    out: dict[str, torch.Tensor] = {}
    for d, layer in enumerate(draft.layers):
        for k, v in layer.mtp.state_dict().items():
            if not k.endswith("_extra_state"):
                out[PREFIX.format(d=d) + k] = v
    return out


def load_megatron_state(draft: MegatronMTPDraft, state: Mapping[str, torch.Tensor]) -> None:
    """Copy megatron-named MTP tensors (``mtp.layers.{d}.*``; other keys ignored) into ``draft``; one line for a
    missing or mis-shaped tensor."""
    own = megatron_state_dict(draft)
    missing = [k for k in own if k not in state]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise DraftConfigError(f"megatron MTP state lacks {missing[:3]}{more}")
    for k, v in own.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise DraftConfigError(
                f"MTP tensor for {k} has shape {tuple(state[k].shape)}, the "
                f"{draft.cfg.spec.architecture} config implies {tuple(v.shape)}"
            )
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k].detach().to(v.dtype))


def _attention_dims(cfg: NativeMTPConfig) -> tuple[int, int, int]:
    s = _shape(cfg)
    return s["groups"], s["heads"] // s["groups"], s["head_dim"]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: tuple[int, int, int]) -> torch.Tensor:
    """HF q [nh·d, ...], k, v [ng·d, ...] → megatron's linear_qkv rows, grouped per query group [q…, k, v];
    ``dims`` = (query groups, heads per group, head dim)."""
    g, per, hd = dims
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(g, per * hd, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)], dim=1
    ).reshape(-1, *rest)


def split_qkv(w: torch.Tensor, dims: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
    """megatron's linear_qkv rows (weight or bias) → HF (q, k, v): the inverse of :func:`fuse_qkv`."""
    g, per, hd = dims
    rest = w.shape[1:]
    q, k, v = w.reshape(g, (per + 2) * hd, *rest).split([per * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    """eh_proj columns [A | B] → [B | A]: MiMo projects cat(hidden, emb), megatron cat(emb, hidden)."""
    h = w.shape[1] // 2
    return torch.cat((w[:, h:], w[:, :h]), dim=1)


_PLAIN = (  # the block's one-to-one names: (HF, megatron under transformer_layer.)
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
)


def hf_to_megatron(cfg: NativeMTPConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The family's MTP tensors (HF names) → megatron's names (``mtp.layers.{d}.*``); q/k/v and gate/up fused.
    One line naming the missing tensors."""
    fam, n, dims = cfg.spec, cfg.target_num_layers, _attention_dims(cfg)
    qkv_bias = _shape(cfg)["qkv_bias"]
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []

    def get(name: str) -> torch.Tensor | None:
        if name not in tensors:
            missing.append(name)
            return None
        return tensors[name]

    for d in range(cfg.depth):
        pre, mp = fam.prefix.format(d=d, n=n + d), PREFIX.format(d=d)
        for ours, theirs in fam.glue:
            t = get(f"{pre}{theirs}.weight")
            if t is not None:
                out[f"{mp}{GLUE[ours]}.weight"] = (
                    _swap_halves(t) if ours == "proj" and fam.hidden_first else t
                )
        tl = mp + "transformer_layer."
        for hf, mg in _PLAIN:
            t = get(pre + hf)
            if t is not None:
                out[tl + mg] = t
        for kind in ("weight", "bias") if qkv_bias else ("weight",):
            q, k, v = (get(f"{pre}self_attn.{p}_proj.{kind}") for p in "qkv")
            if q is not None and k is not None and v is not None:
                out[f"{tl}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, dims)
        moe = _shape(cfg)["moe"]
        mlps = [("mlp.", "mlp.")] if moe is None else [("mlp.shared_experts.", "mlp.shared_experts.")]
        if moe is not None:
            mlps += [(f"mlp.experts.{e}.", f"mlp.experts.local_experts.{e}.") for e in range(moe["experts"])]
            router = get(pre + "mlp.gate.weight")
            if router is not None:
                out[tl + "mlp.router.weight"] = router
            # a checkpoint may leave the selection bias out: zeros, as transformers starts it
            out[tl + "mlp.router.expert_bias"] = tensors.get(
                pre + "mlp.gate.e_score_correction_bias", torch.zeros(moe["experts"], dtype=torch.float32)
            )
        for hf, mg in mlps:
            gate, up, down = (get(f"{pre}{hf}{x}_proj.weight") for x in ("gate", "up", "down"))
            if gate is not None and up is not None:
                out[f"{tl}{mg}linear_fc1.weight"] = torch.cat((gate, up), dim=0)
            if down is not None:
                out[f"{tl}{mg}linear_fc2.weight"] = down
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise DraftConfigError(f"checkpoint lacks MTP tensors {missing[:3]}{more}")
    return out


def megatron_to_hf(cfg: NativeMTPConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron-named MTP tensors → the family's HF names (the inverse of :func:`hf_to_megatron`)."""
    fam, n, dims = cfg.spec, cfg.target_num_layers, _attention_dims(cfg)
    out: dict[str, torch.Tensor] = {}
    for d in range(cfg.depth):
        pre, mp = fam.prefix.format(d=d, n=n + d), PREFIX.format(d=d)
        for ours, theirs in fam.glue:
            t = state[f"{mp}{GLUE[ours]}.weight"]
            out[f"{pre}{theirs}.weight"] = _swap_halves(t) if ours == "proj" and fam.hidden_first else t
        tl = mp + "transformer_layer."
        for hf, mg in _PLAIN:
            out[pre + hf] = state[tl + mg]
        for kind in ("weight", "bias"):
            fused = state.get(f"{tl}self_attention.linear_qkv.{kind}")
            if fused is not None:
                for p, t in zip("qkv", split_qkv(fused, dims), strict=True):
                    out[f"{pre}self_attn.{p}_proj.{kind}"] = t
        moe = _shape(cfg)["moe"]
        mlps = [("mlp.", "mlp.")] if moe is None else [("mlp.shared_experts.", "mlp.shared_experts.")]
        if moe is not None:
            mlps += [(f"mlp.experts.{e}.", f"mlp.experts.local_experts.{e}.") for e in range(moe["experts"])]
            out[pre + "mlp.gate.weight"] = state[tl + "mlp.router.weight"]
            out[pre + "mlp.gate.e_score_correction_bias"] = state[tl + "mlp.router.expert_bias"]
        for hf, mg in mlps:
            gate, up = state[f"{tl}{mg}linear_fc1.weight"].chunk(2, dim=0)
            out[f"{pre}{hf}gate_proj.weight"], out[f"{pre}{hf}up_proj.weight"] = gate, up
            out[f"{pre}{hf}down_proj.weight"] = state[f"{tl}{mg}linear_fc2.weight"]
    return out


def to_checkpoint(draft: MegatronMTPDraft) -> dict[str, torch.Tensor]:
    """The head's tensors under the family's released names (as heads/native_mtp.to_checkpoint writes them), with
    ``shared_head.head`` (= the lm_head) for a family that keeps a per-depth copy."""
    cfg = draft.cfg
    out = megatron_to_hf(cfg, megatron_state_dict(draft))
    if cfg.spec.head is not None:
        for d in range(cfg.depth):
            out[f"{cfg.spec.prefix.format(d=d, n=cfg.target_num_layers + d)}{cfg.spec.head}.weight"] = (
                draft.lm_head.weight
            )
    return {k: v.detach().contiguous() for k, v in out.items()}


def from_checkpoint(
    cfg: NativeMTPConfig, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> MegatronMTPDraft:
    """The megatron-built head with the checkpoint's own MTP tensors (HF names: the target's state dict or its MTP
    part plus ``lm_head.weight`` and ``model.embed_tokens.weight``), as :func:`~draft_align.heads.native_mtp.
    from_checkpoint` reads them.  One-line errors: megatron-core missing, a family or layer not mapped, no MTP
    tensors, a missing or mis-shaped tensor."""
    _megatron()  # refuse a missing megatron-core, then what it cannot express, before anything is built
    _shape(cfg)
    fam = cfg.spec
    first = require_mtp_tensors(cfg, tensors)
    state = hf_to_megatron(cfg, tensors)
    head_name = "lm_head.weight" if fam.head is None else f"{first}{fam.head}.weight"
    lost = [x for x in (head_name, EMBED) if x not in tensors]
    if lost:
        raise DraftConfigError(f"checkpoint lacks MTP tensors {lost}")
    draft = MegatronMTPDraft(cfg)
    load_megatron_state(draft, state)
    draft.set_head(tensors[head_name])
    if tuple(tensors[EMBED].shape) != tuple(draft.embed_tokens.shape):
        raise DraftConfigError(
            f"MTP tensor for embed_tokens has shape {tuple(tensors[EMBED].shape)}, the {fam.architecture} config "
            f"implies {tuple(draft.embed_tokens.shape)}"
        )
    with torch.no_grad():
        draft.embed_tokens.copy_(tensors[EMBED])
    return draft.to(dtype) if dtype is not None else draft
