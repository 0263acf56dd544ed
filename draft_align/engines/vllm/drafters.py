"""What vLLM does with each published draft format: one :class:`VLLMDrafter` per manifest ``format`` (the formats
themselves: ``publish/registry.py``), looked up once by :func:`drafter_for`.

Each entry says which ``speculative_config`` method :func:`~.start.start_engine` and :func:`~.serve.server_command`
write for the folder (:func:`speculative_config`), and how :mod:`.load_check` builds vLLM's drafter class for it
outside an engine:

- ``draft_align.eagle3`` (either dialect): method ``eagle3``; ``llama_eagle3.Eagle3LlamaForCausalLM``, its config
  parsed by vLLM's own ``ModelConfig`` from the folder, against a Llama target with the manifest's layers / vocab /
  hidden; vLLM's loader skips ``t2d`` by design;
- ``draft_align.mtp`` (a Llama block under DeepSeek-V3's or Qwen3-Next's MTP names, not servable by vLLM as written:
  docs/formats.md): method ``eagle3``, what start and serve have always written for it; the load check builds
  ``deepseek_mtp.DeepSeekMTP`` / ``qwen3_next_mtp.Qwen3NextMTP`` against a tiny target of the *real* architecture
  with our head's shapes (the smallest block vLLM builds);
- ``draft_align.native_mtp``: method ``mtp``; the family's own drafter (``mimo_mtp.MiMoMTP``,
  ``glm4_moe_mtp.Glm4MoeMTP``, ``deepseek_mtp.DeepSeekMTP``), built from the target's config the folder carries.

An MTP drafter's embedding and lm_head (``shared_head.head`` too) are the target's once the engine loads the draft
(vLLM's ``_maybe_share_embeddings`` / ``_maybe_share_lm_head``): :attr:`VLLMDrafter.shared`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_align.publish.folder import EAGLE3_FORMAT, MTP_FORMAT, NATIVE_MTP_FORMAT

# layout → (module under vllm.model_executor.models, class); "native_mtp/<family>": the family's own drafter
CLASSES = {
    "eagle3": ("llama_eagle3", "Eagle3LlamaForCausalLM"),
    "deepseek_v3": ("deepseek_mtp", "DeepSeekMTP"),
    "qwen3_next": ("qwen3_next_mtp", "Qwen3NextMTP"),
    "native_mtp/mimo": ("mimo_mtp", "MiMoMTP"),
    "native_mtp/glm4_moe": ("glm4_moe_mtp", "Glm4MoeMTP"),
    "native_mtp/deepseek_v3": ("deepseek_mtp", "DeepSeekMTP"),
}
# vLLM parameters an MTP drafter takes from the target at engine load (llm_base_proposer.py)
SHARED_WITH_TARGET = ("embed_tokens.", "lm_head.", "shared_head.head.")


@dataclass(frozen=True)
class VLLMDrafter:
    """vLLM's side of one published format (module docstring)."""

    method: str  # speculative_config's "method"
    # (manifest, config.json) → the load check's layout: a key of CLASSES
    layout: Callable[[Mapping[str, Any], Mapping[str, Any]], str]
    # (folder, manifest, config.json, layout) → the HF config of the target vLLM builds the drafter against
    target_config: Callable[[Path, Mapping[str, Any], Mapping[str, Any], str], Any]
    own_config: bool = (
        False  # vLLM reads the drafter's config from the folder (EAGLE-3), and its aux ids from it
    )
    skipped: tuple[
        str, ...
    ] = ()  # tensors the loader drops on purpose (llama_eagle3: `if "t2d" in name: continue`)
    shared: tuple[str, ...] = ()  # vLLM parameters the drafter takes from the target at engine load
    # a tensor the loader refused alone is offered again beside one that landed (DeepSeekMTP.load_weights raises
    # unless one call holds an MTP layer's tensor)
    retry_in_company: bool = False
    # a running engine serves it as the rollouts' draft (draft_align.mtp: a Llama block under MTP names, which
    # vLLM's MTP drafters do not build as written: docs/formats.md; its folders are load-checked only)
    serves: bool = True


# --------------------------------------------------------------------------------------- layouts
def _eagle3_layout(manifest: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    return "eagle3"


def _mtp_layout(manifest: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    """config.json's ``model_type`` (``deepseek_v3_mtp`` / ``qwen3_next_mtp``) without its ``_mtp``."""
    return str(config["model_type"]).removesuffix("_mtp")


def _native_mtp_layout(manifest: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    """``native_mtp/<family>``; ValueError for a family vLLM has no drafter for here."""
    layout = f"native_mtp/{manifest.get('family')}"
    if layout not in CLASSES:
        known = ", ".join(k.removeprefix("native_mtp/") for k in CLASSES if k.startswith("native_mtp/"))
        raise ValueError(f"no vLLM drafter known for native MTP family {manifest.get('family')!r}: {known}")
    return layout


# --------------------------------------------------------------------------------------- tiny targets
def _eagle3_target(folder: Path, manifest: Mapping[str, Any], config: Mapping[str, Any], layout: str) -> Any:
    """A Llama target with the layers / vocab / hidden size the EAGLE-3 draft's manifest records."""
    from transformers import LlamaConfig

    e3 = manifest["eagle3_config"]
    heads = int(e3["num_attention_heads"])
    h = int(e3["target_hidden_size"])
    c = LlamaConfig(
        vocab_size=int(e3["vocab_size"]),
        hidden_size=h,
        intermediate_size=2 * h,
        num_hidden_layers=int(e3["target_num_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=h // heads,
        max_position_embeddings=int(e3["max_position_embeddings"]),
    )
    c.architectures = ["LlamaForCausalLM"]
    return c


def _mtp_target(folder: Path, manifest: Mapping[str, Any], cfg: Mapping[str, Any], layout: str) -> Any:
    """A tiny HF config of the real architecture with our head's shapes (dense MLP, no experts)."""
    n, depth = int(cfg["num_hidden_layers"]), int(cfg.get("num_nextn_predict_layers", 1))
    common = dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=n,
        num_attention_heads=int(cfg["num_attention_heads"]),
        num_key_value_heads=int(cfg["num_key_value_heads"]),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        tie_word_embeddings=False,
    )
    if layout == "deepseek_v3":
        from transformers import DeepseekV3Config

        # qk_nope/qk_rope 0 → vLLM's plain multi-head DeepseekAttention (the closest to our Llama block);
        # first_k_dense_replace past every MTP layer → a dense MLP there.
        c = DeepseekV3Config(
            **common,
            num_nextn_predict_layers=depth,
            first_k_dense_replace=n + depth,
            n_routed_experts=1,
            n_shared_experts=0,
            num_experts_per_tok=1,
            q_lora_rank=None,
            kv_lora_rank=0,
            qk_nope_head_dim=0,
            qk_rope_head_dim=0,
            v_head_dim=0,
            head_dim=int(cfg["head_dim"]),
            n_group=1,
            topk_group=1,
        )
        c.architectures = ["DeepseekV3ForCausalLM"]
        return c
    from transformers import Qwen3NextConfig

    # Qwen3NextMTP.__init__ raises "No Qwen3Next layer found" unless its block is a sparse-MoE one
    # (set_moe_parameters): the smallest such block, two experts, one shared expert.
    inter = int(cfg["intermediate_size"])
    c = Qwen3NextConfig(
        **common,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=inter,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        head_dim=int(cfg["head_dim"]),
        num_nextn_predict_layers=depth,
        mtp_num_hidden_layers=depth,
    )
    c.architectures = ["Qwen3NextForCausalLM"]
    return c


def _native_mtp_target(
    folder: Path, manifest: Mapping[str, Any], config: Mapping[str, Any], layout: str
) -> Any:
    """The target's own config, which the folder carries as its config.json."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


#: manifest ``format`` → what vLLM does with it
DRAFTERS: dict[str, VLLMDrafter] = {
    EAGLE3_FORMAT: VLLMDrafter("eagle3", _eagle3_layout, _eagle3_target, own_config=True, skipped=("t2d",)),
    MTP_FORMAT: VLLMDrafter("eagle3", _mtp_layout, _mtp_target, shared=SHARED_WITH_TARGET, serves=False),
    NATIVE_MTP_FORMAT: VLLMDrafter(
        "mtp", _native_mtp_layout, _native_mtp_target, shared=SHARED_WITH_TARGET, retry_in_company=True
    ),
}


def drafter_for(manifest: Mapping[str, Any]) -> VLLMDrafter:
    """The entry of the format ``manifest`` names; ValueError for a format vLLM has none for."""
    drafter = DRAFTERS.get(str(manifest.get("format")))
    if drafter is None:
        raise ValueError(
            f"no vLLM drafter known for manifest format {manifest.get('format')!r}: expected one of "
            f"{sorted(DRAFTERS)}"
        )
    return drafter


def speculative_config(folder: Path, manifest: Mapping[str, Any], k: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for the (verified) draft folder ``folder``: its format's method, the folder,
    ``k`` draft tokens per round."""
    return {"method": drafter_for(manifest).method, "model": str(folder), "num_speculative_tokens": int(k)}
