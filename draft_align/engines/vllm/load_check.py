"""Our folders through vLLM's own draft model classes, built on CPU without an engine, fed through their
``load_weights``: which class, against which target config, and what its loader skips or takes from the target,
is the folder's format's entry in :mod:`.drafters` (EAGLE-3 → ``llama_eagle3.Eagle3LlamaForCausalLM`` with the
draft's config parsed by vLLM's own ``ModelConfig``; the Llama-block MTP layouts → ``deepseek_mtp.DeepSeekMTP`` /
``qwen3_next_mtp.Qwen3NextMTP``; a native MTP folder → the family's own drafter).

The class is built inside a one-process gloo group and ``set_current_vllm_config``; the target is a tiny
config shaped like the draft's target.  Each tensor of ``model.safetensors`` is offered to
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from draft_align.engines.vllm.drafters import CLASSES, drafter_for
from draft_align.heads.native_mtp import EMBED
from draft_align.publish.folder import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE

_SENTINEL = 7.75  # exactly representable; no random weight equals it
VLLM_CLASSES = {layout: cls for layout, (_, cls) in CLASSES.items()}


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
    module, cls = CLASSES[layout]
    with set_current_vllm_config(vc), torch.device("cpu"):
        return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)(
            vllm_config=vc
        ), vc


def vllm_load(folder: Path) -> LoadReport:
    """Offer every tensor of the folder at ``folder`` to vLLM's own draft class; see the module doc."""
    from vllm.config import set_current_vllm_config

    folder = Path(folder)
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    drafter = drafter_for(manifest)
    layout = drafter.layout(manifest, cfg)
    tensors = safetensors.torch.load_file(str(folder / WEIGHTS_FILE))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        target = drafter.target_config(folder, manifest, cfg, layout)
        model, vc = _build(layout, target, Path(tmp), draft_dir=folder if drafter.own_config else None)
        rep = LoadReport(layout=layout, vllm_class=VLLM_CLASSES[layout])
        rep.nonfinite = sorted(
            n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())
        )
        if drafter.own_config:
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
            elif name in drafter.skipped:
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
            for name in list(rep.refused) if drafter.retry_in_company and anchor else []:
                hit, err = offer([(anchor, tensors[anchor]), (name, tensors[name])])
                if err is None:  # refused in company too: the first error stands
                    del rep.refused[name]
                    verdict(name, sorted(set(partial[name]) | set(hit)))
        rep.shared = sorted(k for k in params if any(s in k for s in drafter.shared))
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
