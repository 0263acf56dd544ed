"""Our folders through vLLM's own draft model classes, built on CPU without an engine, fed through their
``load_weights``: EAGLE-3 (either dialect) → ``llama_eagle3.Eagle3LlamaForCausalLM`` with the draft's
config parsed by vLLM's own ``ModelConfig`` (the speculators dialect through vLLM's speculators reader);
the Llama-block MTP layouts → ``deepseek_mtp.DeepSeekMTP`` / ``qwen3_next_mtp.Qwen3NextMTP``; a native MTP
folder (format ``draft_align.native_mtp``) → the family's own drafter (``mimo_mtp.MiMoMTP``,
``glm4_moe_mtp.Glm4MoeMTP``, ``deepseek_mtp.DeepSeekMTP``) built from the folder's own config.json.

The class is built inside a one-process gloo group and ``set_current_vllm_config``; the target is a tiny
config shaped like the draft's target (EAGLE-3: a Llama with the manifest's layers / vocab / hidden; Llama-block MTP: the
*real* architecture with our head's shapes, the smallest block vLLM builds; native MTP: the target's config the
folder carries).  Each tensor of ``model.safetensors`` is offered to
``load_weights`` on its own, so the report says, per tensor, whether it landed in a parameter, was
dropped without a word, or was refused with an error; and which of vLLM's parameters nothing wrote.  An MTP
drafter's embedding and lm_head (``shared_head.head`` too) are listed apart as ``shared``: vLLM's proposer
replaces them with the target's when the engine loads the draft (``_maybe_share_embeddings`` /
``_maybe_share_lm_head``), so whatever the folder holds for them never serves, and one left unwritten is no fault.
vLLM is imported lazily here only (docs/engines.md, "Which client read which format").
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from draft_align.heads.native_mtp import EMBED
from draft_align.publish.folder import CONFIG_FILE, MANIFEST_FILE, NATIVE_MTP_FORMAT, WEIGHTS_FILE

# llama_eagle3.py load_weights: `if "t2d" in name: continue` (vLLM maps with d2t only)
_SKIPPED_BY_DESIGN = {"eagle3": ("t2d",)}
_SENTINEL = 7.75  # exactly representable; no random weight equals it
# layout → (module under vllm.model_executor.models, class); "native_mtp/<family>": the family's own drafter
_CLASSES = {
    "eagle3": ("llama_eagle3", "Eagle3LlamaForCausalLM"),
    "deepseek_v3": ("deepseek_mtp", "DeepSeekMTP"),
    "qwen3_next": ("qwen3_next_mtp", "Qwen3NextMTP"),
    "native_mtp/mimo": ("mimo_mtp", "MiMoMTP"),
    "native_mtp/glm4_moe": ("glm4_moe_mtp", "Glm4MoeMTP"),
    "native_mtp/deepseek_v3": ("deepseek_mtp", "DeepSeekMTP"),
}
VLLM_CLASSES = {layout: cls for layout, (_, cls) in _CLASSES.items()}
# vLLM parameters an MTP drafter takes from the target at engine load (llm_base_proposer.py)
_SHARED_WITH_TARGET = ("embed_tokens.", "lm_head.", "shared_head.head.")


@dataclass
class LoadReport:
    """What vLLM's ``load_weights`` did with each tensor of one folder."""

    layout: str  # eagle3 / deepseek_v3 / qwen3_next / native_mtp/<family>
    vllm_class: str
    aux_ids: list[int] | None = None  # EAGLE-3: the HF indices vLLM will capture (None: its default)
    landed: dict[str, list[str]] = field(default_factory=dict)  # our tensor → vLLM parameter(s) it wrote
    dropped: list[str] = field(default_factory=list)  # accepted without error, wrote nothing
    skipped: list[str] = field(default_factory=list)  # dropped on purpose by the loader (EAGLE-3: t2d)
    refused: dict[str, str] = field(default_factory=dict)  # our tensor → the loader's error
    unloaded: list[str] = field(
        default_factory=list
    )  # vLLM parameters no tensor wrote (embed_tokens and the shared ones excluded)
    shared: list[str] = field(default_factory=list)  # MTP: parameters vLLM takes from the target at load
    nonfinite: list[str] = field(
        default_factory=list
    )  # our tensors holding NaN or Inf (load, but never serve)

    @property
    def ok(self) -> bool:
        return not (self.dropped or self.refused or self.unloaded or self.nonfinite)

    def problems(self) -> list[str]:
        out = [f"{n}: holds NaN or Inf values" for n in self.nonfinite]
        out += [f"{n}: dropped silently by {self.vllm_class}.load_weights" for n in self.dropped]
        out += [f"{n}: refused by {self.vllm_class}.load_weights ({e})" for n, e in self.refused.items()]
        out += [f"vLLM parameter {p} is never written (keeps its initial values)" for p in self.unloaded]
        return out

    def lines(self) -> list[str]:
        """The per-tensor report: where each tensor went, then the shared parameters."""
        out = [f"{n} → {', '.join(ps)}" for n, ps in self.landed.items()]
        out += [f"{n}: skipped by {self.vllm_class}.load_weights by design" for n in self.skipped]
        out += self.problems()
        if self.shared:
            out.append(
                f"shared with the target at engine load (the folder's copy never serves): {', '.join(self.shared)}"
            )
        return out


def _target_config(layout: str, cfg: Mapping[str, Any]) -> Any:
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


def _build(layout: str, hf_config: Any, workdir: Path, draft_dir: Path | None = None) -> Any:
    """vLLM's draft model on CPU, outside any engine (a one-process gloo group); ``hf_config`` is the
    target's, ``draft_dir`` the EAGLE-3 folder (MTP drafts are configured by the target's config)."""
    import importlib
    import types

    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    hf_config.save_pretrained(workdir)
    with set_current_vllm_config(VllmConfig()):
        if not ps.model_parallel_is_initialized():
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"file://{workdir / 'dist-init'}",
            )
            ps.initialize_model_parallel(1, 1)
    mc = ModelConfig(model=str(workdir), skip_tokenizer_init=True, dtype="float32")
    vc = VllmConfig(model_config=mc)
    dm = (
        mc
        if draft_dir is None
        else ModelConfig(model=str(draft_dir), skip_tokenizer_init=True, dtype="float32")
    )
    # the draft classes read the draft's config from the speculative config (MTP: the target's folder)
    vc.speculative_config = types.SimpleNamespace(
        draft_model_config=dm,
        enable_adaptive_verification=False,
        method="eagle3" if draft_dir else "mtp",
        num_speculative_tokens=1,
        draft_parallel_config=vc.parallel_config,
        parallel_drafting=False,
    )
    module, cls = _CLASSES[layout]
    with set_current_vllm_config(vc), torch.device("cpu"):
        return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)(
            vllm_config=vc
        ), vc


def _eagle3_target_config(folder: Path) -> Any:
    """A Llama target with the layers / vocab / hidden size the EAGLE-3 draft's manifest records."""
    from transformers import LlamaConfig

    e3 = json.loads((folder / MANIFEST_FILE).read_text())["eagle3_config"]
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


def vllm_load(folder: Path) -> LoadReport:
    """Offer every tensor of the folder at ``folder`` to vLLM's own draft class; see the module doc."""
    from vllm.config import set_current_vllm_config

    folder = Path(folder)
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    native = manifest.get("format") == NATIVE_MTP_FORMAT
    mtp = native or str(cfg.get("model_type", "")).endswith("_mtp")
    if native:
        layout = f"native_mtp/{manifest.get('family')}"
        if layout not in _CLASSES:
            known = ", ".join(k.removeprefix("native_mtp/") for k in _CLASSES if k.startswith("native_mtp/"))
            raise ValueError(
                f"no vLLM drafter known for native MTP family {manifest.get('family')!r}: {known}"
            )
    else:
        layout = str(cfg["model_type"]).removesuffix("_mtp") if mtp else "eagle3"
    tensors = safetensors.torch.load_file(str(folder / WEIGHTS_FILE))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        if native:
            from transformers import AutoConfig

            model, vc = _build(layout, AutoConfig.from_pretrained(folder), Path(tmp))
        elif mtp:
            model, vc = _build(layout, _target_config(layout, cfg), Path(tmp))
        else:
            model, vc = _build(layout, _eagle3_target_config(folder), Path(tmp), draft_dir=folder)
        rep = LoadReport(layout=layout, vllm_class=VLLM_CLASSES[layout])
        rep.nonfinite = sorted(
            n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())
        )
        if not mtp:
            from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

            ids = get_eagle3_aux_layers_from_config(vc.speculative_config)
            rep.aux_ids = None if ids is None else [int(i) for i in ids]
        params = dict(model.named_parameters())
        with torch.no_grad():
            for v in params.values():  # vLLM allocates with torch.empty: mark every element as unwritten
                v.fill_(_SENTINEL)

        def offer(batch: list[tuple[str, torch.Tensor]]) -> tuple[list[str], str | None]:
            """The parameters ``load_weights(batch)`` changed, even if it then raised, and its error (a
            batch's earlier tensors already landed with these values: re-writing them changes nothing)."""
            snap = {k: v.detach().clone() for k, v in params.items()}
            err = None
            try:
                model.load_weights(batch)
            except Exception as e:  # noqa: BLE001 - any loader error is the finding
                err = f"{type(e).__name__}: {e}"
            return [k for k, v in params.items() if not torch.equal(v.detach(), snap[k])], err

        def verdict(name: str, hit: list[str]) -> None:
            if hit:
                rep.landed[name] = hit
            elif name in _SKIPPED_BY_DESIGN.get(layout, ()):
                rep.skipped.append(name)
            else:
                rep.dropped.append(name)

        partial: dict[str, list[str]] = {}  # what a refused tensor wrote before the loader raised
        with set_current_vllm_config(vc):
            for name, t in tensors.items():
                hit, err = offer([(name, t)])
                if err is None:
                    verdict(name, hit)
                else:
                    rep.refused[name], partial[name] = err, hit
            # DeepSeekMTP.load_weights raises unless one call holds an MTP layer's tensor ("MTP speculative
            # decoding layer N weights missing"): a tensor it refused alone is offered again after one that
            # landed, as a whole-folder load would see it
            anchor = next((n for n in rep.landed if n not in (EMBED, "lm_head.weight")), None)
            for name in list(rep.refused) if native and anchor else []:
                hit, err = offer([(anchor, tensors[anchor]), (name, tensors[name])])
                if err is None:  # refused in company too: the first error stands
                    del rep.refused[name]
                    verdict(name, sorted(set(partial[name]) | set(hit)))
        if mtp:
            rep.shared = sorted(k for k in params if any(s in k for s in _SHARED_WITH_TARGET))
        # a parameter with any element still at the sentinel was (partly) never written, e.g. the k/v
        # rows of a fused qkv_proj when only q_proj landed
        rep.unloaded = sorted(
            k
            for k, v in params.items()
            if "embed_tokens" not in k
            and "draft_id_to_target_id" != k
            and k not in rep.shared
            and bool((v.detach() == _SENTINEL).any())
        )
    return rep


def vllm_load_isolated(folder: Path, timeout_s: float = 600.0) -> LoadReport:
    """:func:`vllm_load` in a child interpreter: building the class initialises vLLM's process-wide
    distributed state, which an engine started later in the same process must not inherit."""
    import dataclasses
    import subprocess
    import sys

    code = (
        "import dataclasses, json, sys; from draft_align.engines.vllm.load_check import vllm_load; "
        "print('REPORT ' + json.dumps(dataclasses.asdict(vllm_load(sys.argv[1]))))"
    )
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(folder)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM load failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    data = json.loads(lines[-1][len("REPORT ") :])
    return LoadReport(**{f.name: data[f.name] for f in dataclasses.fields(LoadReport)})
