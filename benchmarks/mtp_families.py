"""Which vLLM-CPU MTP drafters serve a model family: a tiny random-weight checkpoint of the family (transformers'
config class, N = 2 trunk layers, one MTP layer saved under the released checkpoints' names), then
``vllm.LLM(..., speculative_config={"method": "mtp", "num_speculative_tokens": K})`` on it, 16 greedy tokens for
two prompts, and vLLM's spec-decode counters.  One family per process (vLLM's state is process-wide)::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 nice -n 19 .venv/bin/python benchmarks/mtp_families.py FAMILY [K] [OUT_DIR]

FAMILY: mimo, glm4_moe, deepseek_v3, qwen3_next, qwen3_5, ernie, glm4_moe_lite.  It prints ``RESULT {json}``
(start seconds, output tokens, drafts, accepted) or the error vLLM raised; docs/mtp.md records the outcome
per family.
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ.update(
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    VLLM_CPU_KVCACHE_SPACE="1",
    VLLM_CPU_OMP_THREADS_BIND="nobind",
)
import safetensors.torch as st  # noqa: E402
import torch  # noqa: E402

N, D, V, H = 2, 1, 256, 128
COMMON = dict(
    vocab_size=V,
    hidden_size=H,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def cfg_for(fam):
    import transformers as T

    if fam == "mimo":
        c = T.Qwen2Config(**COMMON, intermediate_size=256, num_hidden_layers=N + D)
        arch = "MiMoForCausalLM"
    elif fam == "glm4_moe":
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
            num_hidden_layers=N + D,
            num_nextn_predict_layers=D,
            partial_rotary_factor=0.5,
            use_qk_norm=False,
        )
        arch = "Glm4MoeForCausalLM"
    elif fam == "deepseek_v3":
        c = T.DeepseekV3Config(
            **{k: v for k, v in COMMON.items() if k != "head_dim"},
            intermediate_size=256,
            moe_intermediate_size=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            num_hidden_layers=N + D,
            num_nextn_predict_layers=D,
            q_lora_rank=None,
            kv_lora_rank=512,  # vLLM's MLA takes latent + rope = 320, 512 or 576 (DeepSeek-V3: 512 + 64)
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
        )
        # the router DeepSeek-V3's config.json names (vLLM builds e_score_correction_bias only for noaux_tc)
        c.topk_method, c.scoring_func = "noaux_tc", "sigmoid"
        arch = "DeepseekV3ForCausalLM"
    elif fam == "qwen3_next":
        c = T.Qwen3NextConfig(
            **COMMON,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=64,
            num_hidden_layers=N + D,
            layer_types=["linear_attention", "full_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
        )
        c.mtp_num_hidden_layers = D
        arch = "Qwen3NextForCausalLM"
    elif fam == "qwen3_5":
        c = T.Qwen3_5TextConfig(
            **COMMON,
            intermediate_size=256,
            num_hidden_layers=N + D,
            layer_types=["linear_attention", "full_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
        )
        c.mtp_num_hidden_layers = D
        arch = "Qwen3_5ForCausalLM"
    elif fam == "ernie":
        # ERNIE-4.5 MoE trunk (vLLM maps only ernie4_5_moe to ErnieMTP); its MTP block is a dense Llama layer, so
        # layer N (the MTP block here) stays dense: experts in layer 1 only
        c = T.Ernie4_5_MoeConfig(
            **COMMON,
            intermediate_size=256,
            moe_intermediate_size=64,
            moe_num_experts=4,
            moe_k=2,
            moe_layer_start_index=1,
            moe_layer_end_index=1,
            num_hidden_layers=N + D,
        )
        c.num_nextn_predict_layers = D
        arch = "Ernie4_5_MoeForCausalLM"
    elif fam == "glm4_moe_lite":
        c = T.Glm4MoeLiteConfig(
            **{k: v for k, v in COMMON.items() if k != "head_dim"},
            intermediate_size=256,
            moe_intermediate_size=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            num_hidden_layers=N + D,
            num_nextn_predict_layers=D,
            q_lora_rank=None,
            kv_lora_rank=512,  # vLLM's MLA takes latent + rope = 320, 512 or 576 (DeepSeek-V3: 512 + 64)
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
        )
        arch = "Glm4MoeLiteForCausalLM"
    else:
        raise SystemExit(f"unknown {fam}")
    c.architectures = [arch]
    return c


def rename(fam, name):
    """Map an HF layer-N name to the released checkpoint's MTP name (None: keep)."""
    pre = f"model.layers.{N}."
    if not name.startswith(pre):
        return name
    rest = name[len(pre) :]
    if fam == "mimo":
        return "model.mtp_layers.0." + rest
    if fam in ("qwen3_next", "qwen3_5"):
        return "mtp.layers.0." + rest
    if fam == "ernie":
        return "model.mtp_block.0." + rest
    return name  # DeepSeek/GLM keep model.layers.N


def extras(fam):
    g = torch.Generator().manual_seed(1)
    ones = torch.ones(H)

    def w(*s):
        return torch.randn(*s, generator=g) * 0.05

    if fam == "mimo":
        p = "model.mtp_layers.0."
        return {
            p + "token_layernorm.weight": ones,
            p + "hidden_layernorm.weight": ones.clone(),
            p + "input_proj.weight": w(H, 2 * H),
            p + "final_layernorm.weight": ones.clone(),
        }
    if fam in ("glm4_moe", "deepseek_v3", "glm4_moe_lite"):
        p = f"model.layers.{N}."
        return {
            p + "enorm.weight": ones,
            p + "hnorm.weight": ones.clone(),
            p + "eh_proj.weight": w(H, 2 * H),
            p + "shared_head.norm.weight": ones.clone(),
            p + "shared_head.head.weight": w(V, H),
        }
    if fam in ("qwen3_next", "qwen3_5"):
        z = torch.zeros(H)  # Qwen3-Next / Qwen3.5 norms are (1 + w)-scaled: zero is the identity
        return {
            "mtp.fc.weight": w(H, 2 * H),
            "mtp.pre_fc_norm_embedding.weight": z,
            "mtp.pre_fc_norm_hidden.weight": z.clone(),
            "mtp.norm.weight": z.clone(),
        }
    if fam == "ernie":
        return {
            "model.mtp_emb_norm.0.weight": ones,
            "model.mtp_hidden_norm.0.weight": ones.clone(),
            "model.mtp_linear_proj.0.weight": w(H, 2 * H),
        }
    return {}


def build(fam, out: Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    c = cfg_for(fam)
    arch = list(c.architectures)  # save_pretrained overwrites it with the class it built (Qwen2 for MiMo)
    m = AutoModelForCausalLM.from_config(c)
    m.save_pretrained(out)
    sd = {}
    for f in sorted(out.glob("*.safetensors")):
        sd.update(st.load_file(str(f)))
        f.unlink()
    new = {rename(fam, k): v for k, v in sd.items()}
    new.update(extras(fam))
    st.save_file({k: v.contiguous() for k, v in new.items()}, str(out / "model.safetensors"))
    cj = json.loads((out / "config.json").read_text())
    cj["num_hidden_layers"] = N
    cj["architectures"] = arch
    if isinstance(cj.get("layer_types"), list):
        cj["layer_types"] = cj["layer_types"][:N]
    if fam == "mimo":
        cj["num_nextn_predict_layers"] = D
    (out / "config.json").write_text(json.dumps(cj, indent=1))
    return sorted(new)


def serve(out: Path, k: int):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(
        model=str(out),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
        disable_log_stats=False,
        seed=0,
    )
    t1 = time.time()
    sp = SamplingParams(temperature=0, max_tokens=16, detokenize=False, ignore_eos=True)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9]), TokensPrompt(prompt_token_ids=[11, 3, 40])], sp
    )
    toks = [list(o.outputs[0].token_ids) for o in outs]
    from draft_align.engines.vllm.counters import SpecCounters

    c = SpecCounters.snapshot(llm)
    print(
        "RESULT",
        json.dumps(
            dict(
                start_s=round(t1 - t0, 1),
                toks=toks,
                drafts=c.num_drafts,
                accepted=c.num_accepted_tokens,
                per_pos=c.accepted_per_pos,
            )
        ),
        flush=True,
    )


if __name__ == "__main__":
    import shutil
    import tempfile

    torch.set_num_threads(1)
    fam, k = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    root = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.mkdtemp(prefix="mtp-families-"))
    out = root / f"ckpt-{fam}"
    shutil.rmtree(out, ignore_errors=True)
    names = build(fam, out)
    print(
        "MTP tensors",
        [n for n in names if not n.startswith(("model.layers.0.", "model.layers.1."))],
        flush=True,
    )
    serve(out, k)
