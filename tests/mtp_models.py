"""Tiny random-weight checkpoints of model families that ship MTP layers, saved the way the released ones are
(no hub): MiMo (a Qwen2 trunk, ``model.mtp_layers.{d}.*``), GLM-4.5 (``Glm4MoeForCausalLM``, a mixture of
experts) and DeepSeek-V3 (MLA and experts), the last two with MTP layer d under ``model.layers.{N+d}.*`` with
``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.{norm,head}``).

The trunk and the MTP blocks come from transformers itself: a model of N + D layers is built and saved with
``save_pretrained`` (which writes experts one by one, as checkpoints do); its last D layers become the MTP
blocks under the family's names and the glue tensors are added.  vLLM-CPU's attention needs head_dim 64.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

N_LAYERS = 2
HIDDEN = 128
VOCAB = 256

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def family_config(family: str, depth: int = 1, n_layers: int = N_LAYERS) -> Any:
    """The family's HF config with ``n_layers`` trunk layers and ``depth`` MTP layers."""
    import transformers as T

    if family == "mimo":
        c = T.Qwen2Config(**COMMON, intermediate_size=256, num_hidden_layers=n_layers)
        c.architectures = ["MiMoForCausalLM"]
    elif family == "glm4_moe":
        c = T.Glm4MoeConfig(
            **COMMON,
            intermediate_size=256,
            moe_intermediate_size=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            num_hidden_layers=n_layers,
            partial_rotary_factor=0.5,
            use_qk_norm=False,
        )
        c.architectures = ["Glm4MoeForCausalLM"]
    elif family == "deepseek_v3":
        # MLA has no grouped K/V: transformers' DeepSeek attention needs as many K/V heads as query heads
        common = {**{k: v for k, v in COMMON.items() if k != "head_dim"}, "num_key_value_heads": 2}
        c = T.DeepseekV3Config(
            **common,
            intermediate_size=256,
            moe_intermediate_size=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            num_hidden_layers=n_layers,
            q_lora_rank=None,
            kv_lora_rank=512,  # vLLM-CPU's MLA takes latent + rope = 576 (DeepSeek-V3's 512 + 64)
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
        )
        c.topk_method, c.scoring_func = "noaux_tc", "sigmoid"  # DeepSeek-V3's router, as its config.json says
        c.architectures = ["DeepseekV3ForCausalLM"]
    else:
        raise ValueError(f"no tiny checkpoint for family {family!r}")
    c.num_nextn_predict_layers = depth
    return c


def _glue(family: str, d: int, n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(HIDDEN, generator=g)

    proj = torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * (2 * HIDDEN) ** -0.5
    if family == "mimo":
        p = f"model.mtp_layers.{d}."
        return {
            p + "token_layernorm.weight": norm(),
            p + "hidden_layernorm.weight": norm(),
            p + "input_proj.weight": proj,
            p + "final_layernorm.weight": norm(),
        }
    p = f"model.layers.{n + d}."
    return {
        p + "enorm.weight": norm(),
        p + "hnorm.weight": norm(),
        p + "eh_proj.weight": proj,
        p + "shared_head.norm.weight": norm(),
    }


def save_checkpoint(
    family: str, out: Path, depth: int = 1, seed: int = 0, logit_scale: float = 1.0
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Save a tiny ``family`` checkpoint with ``depth`` MTP layers at ``out``; returns (config, tensors).

    ``logit_scale`` multiplies the trunk's lm_head (peaky distributions: few near-ties at T = 0)."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    cfg = family_config(family, depth)
    full = family_config(family, depth, n_layers=N_LAYERS + depth)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(full).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(out)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(safetensors.torch.load_file(str(f)))
        f.unlink()
    for f in out.glob("*.index.json"):
        f.unlink()
    g = torch.Generator().manual_seed(seed + 1)
    renamed: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        for d in range(depth):
            pre = f"model.layers.{N_LAYERS + d}."
            if family == "mimo" and name.startswith(pre):
                name = f"model.mtp_layers.{d}." + name[len(pre) :]
        renamed[name] = t
    for d in range(depth):
        renamed.update(_glue(family, d, N_LAYERS, g))
        if family != "mimo":  # released GLM-4.5 / DeepSeek-V3 checkpoints carry a copy of the lm_head
            renamed[f"model.layers.{N_LAYERS + d}.shared_head.head.weight"] = renamed[
                "lm_head.weight"
            ].clone()
    renamed = {k: v.contiguous() for k, v in renamed.items()}
    safetensors.torch.save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    cj = json.loads((out / "config.json").read_text())
    cj["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cj, indent=2))
    return cfg, renamed


def mtp_names(family: str, tensors: dict[str, torch.Tensor], depth: int = 1) -> set[str]:
    """The names of the checkpoint's MTP tensors (the trunk's excluded)."""
    if family == "mimo":
        return {k for k in tensors if k.startswith("model.mtp_layers.")}
    return {k for k in tensors if any(k.startswith(f"model.layers.{N_LAYERS + d}.") for d in range(depth))}
