"""SGLang as a client: our HF-dialect folder through SGLang's own ``LlamaForCausalLMEagle3.load_weights``.

Not importable on this project's CPU machines (docs/engines.md, "Which client read which format": a full
``pip install sglang==0.5.23`` needs CUDA wheels and fails building ``cuda-tile``; with ``--no-deps``,
``import sglang.srt.models.llama_eagle3`` stops at ``sglang/srt/multimodal/internvl_utils.py`` importing
torchvision, whose PyPI build fails on the CPU torch).  :func:`sglang_available` says why; the CLI then runs
the rule-based checker (``publish/sglang.py``).  On a GPU machine with SGLang installed, run
``benchmarks/device/sglang_check.py``.  This path has not been run on this project's machines.

Read in sglang 0.5.23 (``python/sglang/srt/models/llama_eagle3.py``): ``load_weights`` renames the legacy
``midlayer`` to ``layers.0`` (older commits had no such map), takes ``d2t`` as ``hot_token_id = d2t +
arange``, skips ``t2d``, fuses q/k/v and gate/up, tries each name as-is and with ``model.``, and drops
every other name silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from draft_align.publish.folder import CONFIG_FILE, WEIGHTS_FILE

_SENTINEL = 7.75


def sglang_available() -> str | None:
    """None when SGLang's EAGLE-3 model class imports here; else the reason, as the import failed."""
    try:
        import sglang.srt.models.llama_eagle3  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return f"{type(e).__name__}: {e}"
    return None


def sglang_load(folder: Path, device: str = "cuda") -> dict[str, Any]:
    """Offer each tensor of ``folder`` to SGLang's ``LlamaForCausalLMEagle3.load_weights`` on its own.

    Returns {"landed": {name: [params]}, "dropped": [...], "unloaded": [params never written, the shared
    embed_tokens excluded], "hot_token_id_ok": bool, "aux_ids_sglang": eagle_config ids or None}.
    """
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from transformers import LlamaConfig

    folder = Path(folder)
    raw = json.loads((folder / CONFIG_FILE).read_text())
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    set_global_server_args_for_scheduler(ServerArgs(model_path=str(folder), speculative_algorithm="EAGLE3"))
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        backend="gloo",
        distributed_init_method=f"file://{folder.parent / '.sglang-dist-init'}",
    )
    initialize_model_parallel(1, 1)
    with torch.device(device):
        model = LlamaForCausalLMEagle3(config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(_SENTINEL)
    tensors = safetensors.torch.load_file(str(folder / WEIGHTS_FILE))
    out: dict[str, Any] = {"landed": {}, "dropped": [], "unloaded": []}
    for name, t in tensors.items():
        snap = {k: v.detach().clone() for k, v in params.items()}
        model.load_weights([(name, t.to(device))])
        hit = [k for k, v in params.items() if not torch.equal(v.detach(), snap[k])]
        if hit:
            out["landed"][name] = hit
        elif name not in ("d2t", "t2d"):
            out["dropped"].append(name)
    out["unloaded"] = sorted(
        k for k, v in params.items() if "embed_tokens" not in k and bool((v.detach() == _SENTINEL).any())
    )
    d2t = tensors.get("d2t")  # absent for a full-vocabulary draft: SGLang then has no hot ids either
    hot = model.get_hot_token_id()
    out["hot_token_id_ok"] = (
        hot is None
        if d2t is None
        else hot is not None and torch.equal(hot.cpu(), d2t + torch.arange(d2t.numel()))
    )
    out["aux_ids_sglang"] = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return out
