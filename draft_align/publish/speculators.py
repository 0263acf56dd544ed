"""The speculators library as a client: load our speculators-dialect folder with its own loader, and
import a draft that speculators itself saved.

Read in speculators 0.9.0 (``speculators/model.py``, ``models/eagle3/{config,core,model_definitions}.py``):

- ``SpeculatorModel.from_pretrained(folder)`` picks ``Eagle3DraftModel`` from
  ``speculators_model_type``, validates config.json with ``Eagle3SpeculatorConfig`` (pydantic), loads
  ``model.safetensors`` through transformers' ``PreTrainedModel.from_pretrained``, then reads
  ``embed_tokens.weight`` (and ``lm_head`` / ``model.norm`` for its training-only ``verifier_*`` copies)
  from ``speculators_config.verifier.name_or_path``, which must therefore be a loadable target.
- Its embedding is reloaded from the verifier only when it still holds NaN (the init sentinel).  With
  transformers 5.19, a checkpoint without ``embed_tokens.weight`` (ours: the draft shares the target's)
  comes out of ``from_pretrained`` holding uninitialised memory, not NaN, so the verifier's embedding is
  mostly *not* loaded and the draft embeds with garbage.  :func:`speculators_load` reloads it explicitly
  (``_load_verifier_weights(overwrite_embed_tokens=True)``) and says so.
- Its ``fc`` is ``Linear(n_aux · hidden_size, hidden_size)`` and the verifier's hidden size must equal the
  draft's: speculators cannot hold a draft whose ``target_hidden_size`` differs from ``hidden_size``.
- Its forward returns draft tokens (argmax) only; the logits are ``lm_head``'s outputs, one call per TTT
  step.  Step j at position i embeds ``input_ids[i + j]`` (teacher-forced, right-padded with 0) at RoPE
  position ``1 + i + j``, attends to step-0 keys ≤ i and to its own chain's earlier steps.  Fed our
  ``x[i + 1]`` as ``input_ids[i]`` that is our unroll exactly (RoPE is relative: the +1 cancels).
- ``norm_before_residual`` defaults to False in speculators (vLLM's speculators reader defaults to True:
  hence written explicitly); ``norm_before_fc``, ``fc_norm``, ``norm_output`` (Eagle 3.1) change the
  forward and are refused on import.

speculators is imported lazily, only here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from draft_align.conventions import default_aux_layer_ids
from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.heads.layers import Rotary, block_shape_from_target
from draft_align.publish.eagle3_format import check_tensors, engine_name
from draft_align.publish.folder import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE, ExportError

# speculators-only tensors we never carry: its own copy of the target's embedding (ours is shared) and the
# training-time verifier copies (not saved by speculators either, `_keys_to_ignore_on_save`)
SPECULATORS_ONLY = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
_FORWARD_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass
class SpeculatorsLoadReport:
    """What ``SpeculatorModel.from_pretrained`` made of one folder."""

    model_class: str
    landed: list[str] = field(default_factory=list)  # file tensors equal to the loaded model's
    missing: list[str] = field(default_factory=list)  # file tensors the model has no place for
    differ: list[str] = field(default_factory=list)  # file tensors whose loaded value differs
    embed_reloaded: bool = False  # the verifier embedding had to be reloaded (see the module doc)
    aux_ids: list[int] | None = None  # speculators' resolved eagle_aux_hidden_state_layer_ids
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.differ or self.problems)


def speculators_load(
    folder: Path, *, verifier: str | Path | None = None, attn_implementation: str = "eager"
) -> tuple[Any, SpeculatorsLoadReport]:
    """Load ``folder`` with speculators' own ``SpeculatorModel.from_pretrained``; returns (model, report).

    ``verifier``: a local target folder to use instead of the config's ``verifier.name_or_path`` (it is
    where speculators reads the embedding).  ``attn_implementation``: speculators forces
    ``simple_flex_attention`` when unset; ``eager`` runs on any CPU and any length.
    """
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    folder = Path(folder)
    config = Eagle3SpeculatorConfig.from_pretrained(str(folder))
    if verifier is not None:
        config.speculators_config.verifier.name_or_path = str(verifier)
    config.transformer_layer_config._attn_implementation = attn_implementation  # noqa: SLF001
    model = SpeculatorModel.from_pretrained(str(folder), config=config).eval()
    rep = SpeculatorsLoadReport(model_class=type(model).__name__)
    emb = model.embed_tokens.weight
    from speculators.utils.loading import load_model_layers

    verifier_path = config.speculators_config.verifier.name_or_path
    want = load_model_layers(["embed_tokens.weight"], verifier_path)["embed_tokens.weight"]
    if not torch.equal(emb.detach(), want.to(emb.dtype)):
        model._load_verifier_weights(overwrite_embed_tokens=True)  # noqa: SLF001 - see the module doc
        rep.embed_reloaded = True
        if not torch.equal(model.embed_tokens.weight.detach(), want.to(emb.dtype)):
            rep.problems.append("the verifier's embedding did not load into embed_tokens")
    sd = model.state_dict()
    for name, t in safetensors.torch.load_file(str(folder / WEIGHTS_FILE)).items():
        if name not in sd or sd[name] is None:
            rep.missing.append(name)
        elif sd[name].shape != t.shape or not torch.equal(sd[name].to(t.dtype), t):
            rep.differ.append(name)
        else:
            rep.landed.append(name)
    rep.aux_ids = list(model.config.eagle_aux_hidden_state_layer_ids or [])
    if model.config.norm_before_residual:
        rep.problems.append("norm_before_residual is true: not the forward draft_align trained")
    manifest_path = folder / MANIFEST_FILE
    if manifest_path.exists():
        hf_ids = json.loads(manifest_path.read_text()).get("aux_layer_ids", {}).get("hf")
        if hf_ids is not None and list(hf_ids) != rep.aux_ids:
            rep.problems.append(
                f"speculators resolves aux ids {rep.aux_ids}, the draft was trained on {hf_ids}"
            )
    return model, rep


def speculators_step_logits(
    model: Any, aux: torch.Tensor, input_ids: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Draft logits of speculators' Eagle3 forward at every TTT step, on our alignment.

    aux [1, T, n_aux·H] target aux states; input_ids [1, T] our tokens x.  Returns ``steps`` tensors
    [1, T, draft_vocab]; step j is comparable with our unroll at chain starts 0..T−2−j (later positions
    read speculators' 0 padding where we clamp).
    """
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach()))
    try:
        shifted = torch.cat((input_ids[:, 1:], input_ids.new_zeros(1, 1)), dim=1)  # theirs[i] = x[i + 1]
        doc = torch.zeros_like(input_ids)
        with torch.no_grad():
            model(hidden_states=aux, input_ids=shifted, document_ids=doc, ttt_steps=steps)
    finally:
        hook.remove()
    return logits


def import_speculators(folder: Path, target_config: Any) -> Eagle3Draft:
    """An :class:`Eagle3Draft` from a folder speculators saved (``Eagle3DraftModel.save_pretrained``).

    ``target_config``: the target's HF config (its layer count resolves default aux ids).  Refuses what
    our head does not compute: more than one layer, a non-Llama block, a forward flag set
    (``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``), a draft wider than its
    target's hidden states.  ``embed_tokens.weight`` (speculators' copy of the target's) is dropped.
    """
    folder = Path(folder)
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    if cfg.get("speculators_model_type") != "eagle3":
        raise ExportError(
            f"{folder / CONFIG_FILE}: speculators_model_type {cfg.get('speculators_model_type')!r} "
            f"is not eagle3"
        )
    tl = dict(cfg.get("transformer_layer_config") or {})
    set_flags = [f for f in _FORWARD_FLAGS if cfg.get(f)]
    if set_flags:
        raise ExportError(f"speculators draft sets {set_flags}: draft_align's head computes none of them")
    if int(tl.get("num_hidden_layers", 1)) != 1:
        raise ExportError(
            f"speculators draft has {tl['num_hidden_layers']} layers; draft_align's head has one"
        )
    if tl.get("model_type", "llama") != "llama":
        raise ExportError(f"transformer_layer_config.model_type {tl.get('model_type')!r}: only llama blocks")
    from transformers import LlamaConfig

    shape = block_shape_from_target(LlamaConfig(**{k: v for k, v in tl.items() if k != "model_type"}))
    n_layers = int(target_config.num_hidden_layers)
    aux = tuple(cfg.get("eagle_aux_hidden_state_layer_ids") or default_aux_layer_ids(n_layers))
    hidden = int(shape["hidden_size"])
    target_hidden = int(cfg.get("target_hidden_size") or hidden)
    if int(target_config.hidden_size) != target_hidden:
        raise ExportError(
            f"draft target_hidden_size {target_hidden} != the target's {target_config.hidden_size}"
        )
    draft_vocab = int(cfg.get("draft_vocab_size") or shape["vocab_size"])
    ecfg = Eagle3Config(
        **shape,
        draft_vocab_size=draft_vocab,
        target_hidden_size=target_hidden,
        aux_layer_ids=aux,
        target_num_layers=n_layers,
        torch_dtype=str(tl.get("torch_dtype") or cfg.get("torch_dtype") or "bfloat16"),
    )
    raw = safetensors.torch.load_file(str(folder / WEIGHTS_FILE))
    tensors = {engine_name(k): v for k, v in raw.items() if k not in SPECULATORS_ONLY}
    if "d2t" not in tensors:  # speculators stores no map when the draft vocab is the target's
        tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        tensors["t2d"] = torch.ones(ecfg.vocab_size, dtype=torch.bool)
    check_tensors(tensors, ecfg)
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    with torch.device("meta"):
        draft = Eagle3Draft(ecfg)
    draft.load_state_dict(state, strict=True, assign=True)
    draft.rotary = Rotary(ecfg)
    return draft


def compare_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ between ``a`` and ``b`` (missing on either side included)."""
    out = sorted(set(a) ^ set(b))
    out += sorted(k for k in set(a) & set(b) if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))
    return out
