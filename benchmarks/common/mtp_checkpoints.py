"""Tiny random-weight checkpoints of model families that ship MTP layers, saved the way the released ones are (no
hub): the one source for the native-MTP tests (tests/heads, tests/publish, tests/engines/vllm, tests/sidecar) and
``benchmarks/mtp_families.py``.

The trunk and the MTP blocks come from transformers itself: a model of N + D layers is built from the family's
config class and saved with ``save_pretrained`` (which writes experts one by one, as checkpoints do); its last D
layers become the MTP blocks under the family's names and the family's glue tensors are added.  vLLM-CPU's
attention needs head_dim 64.

Families and where their MTP layer d lives:

- ``mimo`` (Qwen2 trunk): ``model.mtp_layers.{d}.*`` with ``token_layernorm`` / ``hidden_layernorm`` /
  ``input_proj`` / ``final_layernorm``;
- ``glm4_moe`` (GLM-4.5, experts), ``deepseek_v3`` (MLA and experts), ``glm4_moe_lite`` (MLA and experts):
  ``model.layers.{N+d}.*`` with ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.{norm,head}``;
- ``qwen3_next``, ``qwen3_5`` (gated delta-net hybrids): ``mtp.layers.{d}.*`` with ``mtp.fc`` /
  ``mtp.pre_fc_norm_{embedding,hidden}`` / ``mtp.norm`` (norms (1 + w)-scaled);
- ``ernie`` (ERNIE-4.5 MoE trunk, a dense MTP block): ``model.mtp_block.{d}.*`` with ``model.mtp_emb_norm.{d}``
  / ``model.mtp_hidden_norm.{d}`` / ``model.mtp_linear_proj.{d}``.
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
FAMILIES = ("mimo", "glm4_moe", "deepseek_v3", "qwen3_next", "qwen3_5", "ernie", "glm4_moe_lite")

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
# MLA (DeepSeek-V3, GLM-4.7-Flash): latent 512 + rope 64 = 576, a head size vLLM-CPU's MLA takes (320, 512, 576)
MLA = dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)
MOE = dict(
    moe_intermediate_size=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
ARCHITECTURES = {
    "mimo": "MiMoForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "ernie": "Ernie4_5_MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
}


def family_config(family: str, depth: int = 1, n_layers: int = N_LAYERS, **overrides: Any) -> Any:
    """The family's HF config with ``n_layers`` trunk layers and ``depth`` MTP layers; ``overrides`` set config
    fields after (e.g. ``first_k_dense_replace`` for a GLM-4.5 whose MTP layer is dense)."""
    import transformers as T

    no_head_dim = {k: v for k, v in COMMON.items() if k != "head_dim"}
    hybrid = dict(  # gated delta-net layers first, full attention after (the MTP layers are full attention)
        layer_types=["linear_attention"] + ["full_attention"] * (n_layers - 1),
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    )
    if family == "mimo":
        c = T.Qwen2Config(**COMMON, intermediate_size=256, num_hidden_layers=n_layers)
    elif family == "glm4_moe":
        c = T.Glm4MoeConfig(
            **COMMON,
            **MOE,
            intermediate_size=256,
            num_hidden_layers=n_layers,
            partial_rotary_factor=0.5,
            use_qk_norm=False,
        )
    elif family == "deepseek_v3":
        # MLA has no grouped K/V: transformers' DeepSeek attention needs as many K/V heads as query heads
        c = T.DeepseekV3Config(
            **{**no_head_dim, "num_key_value_heads": 2},
            **MOE,
            **MLA,
            intermediate_size=256,
            num_hidden_layers=n_layers,
        )
        # DeepSeek-V3's router, as its config.json says (vLLM builds e_score_correction_bias only for noaux_tc)
        c.topk_method, c.scoring_func = "noaux_tc", "sigmoid"
    elif family == "glm4_moe_lite":
        c = T.Glm4MoeLiteConfig(
            **no_head_dim, **MOE, **MLA, intermediate_size=256, num_hidden_layers=n_layers
        )
    elif family == "qwen3_next":
        c = T.Qwen3NextConfig(
            **COMMON,
            **hybrid,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=64,
            num_hidden_layers=n_layers,
        )
    elif family == "qwen3_5":
        c = T.Qwen3_5TextConfig(**COMMON, **hybrid, intermediate_size=256, num_hidden_layers=n_layers)
    elif family == "ernie":
        # vLLM maps only the ERNIE-4.5 MoE trunk to ErnieMTP; its MTP block is a dense Llama layer, so layer N
        # (built as the MTP block) stays dense: experts in layer 1 only
        c = T.Ernie4_5_MoeConfig(
            **COMMON,
            intermediate_size=256,
            moe_intermediate_size=64,
            moe_num_experts=4,
            moe_k=2,
            moe_layer_start_index=1,
            moe_layer_end_index=1,
            num_hidden_layers=n_layers,
        )
    else:
        raise ValueError(f"no tiny checkpoint for family {family!r}: expected one of {FAMILIES}")
    if family in ("qwen3_next", "qwen3_5"):
        c.mtp_num_hidden_layers = depth
    else:
        c.num_nextn_predict_layers = depth
    c.architectures = [ARCHITECTURES[family]]
    for k, v in overrides.items():
        setattr(c, k, v)
    return c


def mtp_prefix(family: str, d: int, n: int = N_LAYERS) -> str:
    """Where the family's checkpoint keeps MTP layer ``d`` (``n`` trunk layers)."""
    if family == "mimo":
        return f"model.mtp_layers.{d}."
    if family in ("qwen3_next", "qwen3_5"):
        return f"mtp.layers.{d}."
    if family == "ernie":
        return f"model.mtp_block.{d}."
    return f"model.layers.{n + d}."


def _glue(family: str, d: int, n: int, g: torch.Generator, lm_head: torch.Tensor) -> dict[str, torch.Tensor]:
    """The family's MTP glue tensors of depth ``d``: random norms near 1 and a random 2H → H projection."""

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(HIDDEN, generator=g)

    proj = torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * (2 * HIDDEN) ** -0.5
    p = mtp_prefix(family, d, n)
    if family == "mimo":
        return {
            p + "token_layernorm.weight": norm(),
            p + "hidden_layernorm.weight": norm(),
            p + "input_proj.weight": proj,
            p + "final_layernorm.weight": norm(),
        }
    if family in ("qwen3_next", "qwen3_5"):  # one glue for every depth; (1 + w)-scaled norms: w near 0
        return {
            "mtp.fc.weight": proj,
            "mtp.pre_fc_norm_embedding.weight": norm() - 1.0,
            "mtp.pre_fc_norm_hidden.weight": norm() - 1.0,
            "mtp.norm.weight": norm() - 1.0,
        }
    if family == "ernie":
        return {
            f"model.mtp_emb_norm.{d}.weight": norm(),
            f"model.mtp_hidden_norm.{d}.weight": norm(),
            f"model.mtp_linear_proj.{d}.weight": proj,
        }
    # released GLM-4.5 / DeepSeek-V3 checkpoints carry a copy of the lm_head per MTP layer
    return {
        p + "enorm.weight": norm(),
        p + "hnorm.weight": norm(),
        p + "eh_proj.weight": proj,
        p + "shared_head.norm.weight": norm(),
        p + "shared_head.head.weight": lm_head.clone(),
    }


def save_checkpoint(
    family: str,
    out: Path,
    depth: int = 1,
    seed: int = 0,
    logit_scale: float = 1.0,
    n_layers: int = N_LAYERS,
    **overrides: Any,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Save a tiny ``family`` checkpoint with ``n_layers`` trunk and ``depth`` MTP layers at ``out``; returns
    (config, tensors).  ``logit_scale`` multiplies the trunk's lm_head (peaky distributions: few near-ties at
    T = 0); ``overrides`` go to :func:`family_config`."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    cfg = family_config(family, depth, n_layers=n_layers, **overrides)
    full = family_config(family, depth, n_layers=n_layers + depth, **overrides)
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
    renamed: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        for d in range(depth):
            pre = f"model.layers.{n_layers + d}."
            if name.startswith(pre):
                name = mtp_prefix(family, d, n_layers) + name[len(pre) :]
        renamed[name] = t
    g = torch.Generator().manual_seed(seed + 1)
    for d in range(depth):
        renamed.update(_glue(family, d, n_layers, g, renamed["lm_head.weight"]))
    renamed = {k: v.contiguous() for k, v in renamed.items()}
    safetensors.torch.save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    cj = json.loads((out / "config.json").read_text())
    cj["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cj, indent=2))
    return cfg, renamed


def mtp_names(
    family: str, tensors: dict[str, torch.Tensor], depth: int = 1, n_layers: int = N_LAYERS
) -> set[str]:
    """The names of the checkpoint's MTP tensors (the trunk's excluded)."""
    if family in ("qwen3_next", "qwen3_5"):
        return {k for k in tensors if k.startswith("mtp.")}
    if family == "ernie":
        return {k for k in tensors if k.startswith(("model.mtp_",))}
    return {k for k in tensors if any(k.startswith(mtp_prefix(family, d, n_layers)) for d in range(depth))}


def llama_as_mimo(src: Path, out: Path, seed: int = 0) -> Any:
    """A released Llama-architecture checkpoint (SmolLM2) as a MiMo one with one fresh MTP layer, at ``out``.

    MiMo's trunk is Qwen2's, which is Llama's with q/k/v biases: the Llama weights with zero biases compute the
    same function (``tests/heads/test_llama_as_mimo.py`` checks the logits).  The lm_head is written out (MiMo's
    MTP drafter in vLLM reads ``lm_head.weight``; SmolLM2 ties it to the embedding).  The MTP layer is new:
    a Qwen2 decoder layer from transformers' own initialisation (``initializer_range``), norms at 1 and a random
    2H → H projection; a native warm-start trains it.  Tokenizer files are copied.  Returns the config."""
    import shutil

    import transformers as T

    src, out = Path(src), Path(out)
    llama = T.AutoConfig.from_pretrained(src)
    n = int(llama.num_hidden_layers)
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    kw = {k: getattr(llama, k) for k in keep}
    kw["head_dim"] = int(getattr(llama, "head_dim", None) or llama.hidden_size // llama.num_attention_heads)
    rope = dict(getattr(llama, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})

    def config(layers: int) -> Any:
        c = T.Qwen2Config(**kw, num_hidden_layers=layers, tie_word_embeddings=False, rope_parameters=rope)
        c.num_nextn_predict_layers = 1
        c.architectures = [ARCHITECTURES["mimo"]]
        return c

    trunk = safetensors.torch.load_file(str(src / "model.safetensors"))
    torch.manual_seed(seed)
    layer = T.Qwen2ForCausalLM(config(1)).model.layers[0]  # the new MTP layer, as transformers initialises it
    tensors = {k: v.float().contiguous() for k, v in trunk.items()}
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"].clone())
    h, hd = int(kw["hidden_size"]), kw["head_dim"]
    sizes = {"q": int(llama.num_attention_heads) * hd, "k": int(llama.num_key_value_heads) * hd}
    sizes["v"] = sizes["k"]
    for i in range(n):  # Qwen2's q/k/v biases, zero: Llama's function
        for p, size in sizes.items():
            tensors[f"model.layers.{i}.self_attn.{p}_proj.bias"] = torch.zeros(size)
    pre = mtp_prefix("mimo", 0, n)
    tensors.update({pre + k: v.detach().float().clone() for k, v in layer.state_dict().items()})
    g = torch.Generator().manual_seed(seed + 1)
    tensors.update(
        {
            pre + "token_layernorm.weight": torch.ones(h),
            pre + "hidden_layernorm.weight": torch.ones(h),
            pre + "input_proj.weight": torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5,
            pre + "final_layernorm.weight": torch.ones(h),
        }
    )
    out.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = config(n)
    cfg.save_pretrained(out)
    cj = json.loads((out / "config.json").read_text())
    cj["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cj, indent=2))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return cfg


def main() -> None:
    """``python -m benchmarks.common.mtp_checkpoints --llama-as-mimo smollm2-135m --out DIR``."""
    import argparse

    from draft_align.assets import resolve_model

    ap = argparse.ArgumentParser(description=llama_as_mimo.__doc__)
    ap.add_argument(
        "--llama-as-mimo", required=True, help="a Llama checkpoint: alias (smollm2-135m) or folder"
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    llama_as_mimo(Path(resolve_model(args.llama_as_mimo)), Path(args.out), seed=args.seed)
    print(f"{args.out}: {args.llama_as_mimo} as MiMoForCausalLM with one fresh MTP layer")


if __name__ == "__main__":
    main()
