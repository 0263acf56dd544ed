"""The EAGLE-3 engine format: the folder vLLM and SGLang load, in the HF or the speculators dialect.

A published draft is one folder (docs/formats.md §4)::

    drafts/v0007/config.json        what vLLM / SGLang read (HF or speculators dialect)
    drafts/v0007/model.safetensors  exactly the engine tensors (:func:`heads.eagle3.expected_shapes`)
    drafts/v0007/manifest.json      sha256 + size of both files, versions, target, metrics,
                                    the full Eagle3Config (``load_draft`` rebuilds from it)

Aux-layer ids.  ``Eagle3Config.aux_layer_ids`` are HF ``output_hidden_states`` indices k (hidden_states[0]
is the embedding output).  Both engines capture the pre-norm residual stream entering decoder layer k, so
for a target of L layers the usable range is 1..L-1.  vLLM reads id k as that same stream; SGLang adds one
to the ids it reads, so it must be given k-1.  When the ids equal the engines' default (2, L//2, L-3) the
config leaves them out and both engines agree without any convention (docs/formats.md §1).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from draft_align.conventions import default_aux_layer_ids
from draft_align.heads.draft_head import DraftConfigError
from draft_align.heads.eagle3 import (
    ARCHITECTURE,
    Eagle3Config,
    Eagle3Draft,
    check_engine_aux_ids,
    expected_shapes,
    full_vocab,
)
from draft_align.heads.layers import Rotary
from draft_align.heads.vocab import check_d2t
from draft_align.publish.config_json import (
    block_config_fields,
    check_config_json,
    check_rope,
    special_token_ids,
)
from draft_align.publish.folder import (
    EAGLE3_FORMAT,
    FORMAT_VERSION,
    RESERVED_KEYS,
    WEIGHTS_FILE,
    CorruptCheckpointError,
    Dialect,
    ExportError,
    ExportRequest,
    check_destination,
    check_finite,
    draft_manifest,
    float_dtype_name,
    publish_folder,
    read_head_config,
    read_weights,
    stored_itemsize,
    verify_file,
)
from draft_align.publish.formats import HeadFormat, TapCapture, check_built_for, check_positions

SPECULATORS_ARCHITECTURE = "Eagle3Speculator"  # speculators' Eagle3SpeculatorConfig.architectures default
# Both engines build fc as Linear(3·target_hidden_size, H): vLLM llama_eagle3.py `target_hidden_size * 3`,
# SGLang llama_eagle3.py `self.hidden_size_in * 3`.


# --------------------------------------------------------------------------------------- aux-layer ids
def aux_id_conventions(aux_layer_ids: tuple[int, ...] | list[int], num_layers: int) -> dict[str, Any]:
    """The same capture points in each convention, and whether config.json must spell them out.

    hf: HF ``hidden_states`` indices k; vllm: k (vLLM captures the stream entering layer k);
    sglang: k-1 (SGLang adds one to the ids it reads); engine_default: ids == (2, L//2, L-3).
    """
    hf = [int(i) for i in aux_layer_ids]
    default = hf == list(default_aux_layer_ids(num_layers))
    return {
        "hf": hf,
        "vllm": list(hf),
        "sglang": [i - 1 for i in hf],
        "engine_default": default,
        "in_config": not default,
    }


def _check_aux_ids(ids: tuple[int, ...], num_layers: int) -> None:
    try:
        check_engine_aux_ids(ids, num_layers)
    except DraftConfigError as e:
        raise ExportError(str(e)) from e


# --------------------------------------------------------------------------------------- validation
_QKV = {f"midlayer.self_attn.{p}_proj.weight" for p in "qkv"}


def check_tensors(tensors: Mapping[str, torch.Tensor], cfg: Eagle3Config) -> None:
    """Names exactly the engine set, shapes consistent with ``cfg``, finite floats, a valid vocab map."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ExportError(
            f"tensor names differ from the engine set: missing {missing}, unexpected {unexpected}"
        )
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got == shape:
            continue
        if name == "fc.weight":
            raise ExportError(
                f"fc width mismatch: fc.weight is {list(got)}, expected {list(shape)} = [hidden_size, "
                f"len(aux_layer_ids)·target_hidden_size = {len(cfg.aux_layer_ids)}·{cfg.target_hidden_size}]"
            )
        if name in _QKV:
            raise ExportError(
                f"{name} is {list(got)}, expected {list(shape)} (q/k/v read 2·hidden_size inputs)"
            )
        if name == "lm_head.weight":
            raise ExportError(
                f"lm_head.weight is {list(got)}, expected [draft_vocab_size, hidden_size] = {list(shape)}"
            )
        raise ExportError(f"{name} has shape {list(got)}, expected {list(shape)}")
    for name, t in tensors.items():
        check_finite(name, t)
    if "d2t" not in expected:  # a full-vocabulary draft: the identity, not stored
        return
    try:
        check_d2t(tensors["d2t"].cpu(), tensors["t2d"].cpu())
    except ValueError as e:
        raise ExportError(f"d2t/t2d: {e}") from e


def validate_draft(draft: Eagle3Draft, target_config: Any) -> None:
    """Raise ExportError unless ``draft`` is a loadable EAGLE-3 head for ``target_config``.

    Checks: aux ids (distinct, ascending, three, capturable), target hidden/vocab/layers, RoPE equal to the
    target's, ``max_position_embeddings`` ≥ the target's, engine tensor names and shapes, finite weights,
    d2t/t2d semantics.
    """
    cfg = draft.cfg
    n_layers = int(target_config.num_hidden_layers)
    _check_aux_ids(tuple(cfg.aux_layer_ids), n_layers)
    if cfg.target_hidden_size != int(target_config.hidden_size):
        raise ExportError(
            f"hidden size mismatch: draft target_hidden_size {cfg.target_hidden_size} != target hidden_size "
            f"{target_config.hidden_size}"
        )
    if cfg.vocab_size != int(target_config.vocab_size):
        raise ExportError(
            f"vocab size mismatch: draft vocab_size {cfg.vocab_size} != target vocab_size {target_config.vocab_size}"
        )
    if cfg.target_num_layers != n_layers:
        raise ExportError(
            f"num layers mismatch: draft was built for a {cfg.target_num_layers}-layer target, this target has "
            f"{n_layers}"
        )
    check_positions(cfg.max_position_embeddings, target_config, ": acceptance collapses past it")
    check_rope(cfg.rope_parameters, target_config)
    if cfg.hidden_act != "silu":
        raise ExportError(f"hidden_act {cfg.hidden_act!r}: engines run silu")
    if full_vocab(cfg):  # its mapping is folded into lm_head's row order on export: it must be a permutation
        try:
            check_d2t(draft.d2t.cpu(), draft.t2d.cpu())
        except ValueError as e:
            raise ExportError(f"d2t/t2d: {e}") from e
    check_tensors(draft.engine_state_dict(), cfg)


# --------------------------------------------------------------------------------------- config.json
def llama_fields(cfg: Eagle3Config, target_config: Any, dtype_name: str) -> dict[str, Any]:
    """The Llama decoder-layer fields both dialects carry (top level for HF, transformer_layer_config else)."""
    fields: dict[str, Any] = {
        "model_type": "llama",
        "num_hidden_layers": 1,
        **block_config_fields(cfg),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        **special_token_ids(target_config),
    }
    return fields


def hf_config(cfg: Eagle3Config, req: ExportRequest, dtype_name: str) -> dict[str, Any]:
    """config.json in the HF dialect that vLLM and SGLang load as ``LlamaForCausalLMEagle3``.

    Non-default aux ids are written twice, each where and how its engine reads them (checked in source):
    - vLLM ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py::get_eagle3_aux_layers_from_config`` reads the
      top-level ``hf_config.eagle_aux_hidden_state_layer_ids`` (id k = HF hidden_states[k]); a nested
      ``eagle_config`` is consulted only for ``layer_ids`` / ``use_aux_hidden_state``, never for these ids.
    - SGLang ``srt/model_executor/model_runner.py`` reads
      ``draft hf_config.eagle_config["eagle_aux_hidden_state_layer_ids"]`` and its models'
      ``set_eagle3_layers_to_capture`` add one to each id ("for the ith layer, it takes the output of the
      (i-1)th layer"), so the nested copy holds k-1.
    """
    aux = aux_id_conventions(cfg.aux_layer_ids, cfg.target_num_layers)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        **llama_fields(cfg, req.target_config, dtype_name),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
    }
    if aux["in_config"]:
        out["eagle_aux_hidden_state_layer_ids"] = aux["vllm"]
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux["sglang"]}
    return out


def speculators_config(cfg: Eagle3Config, req: ExportRequest, dtype_name: str) -> dict[str, Any]:
    """config.json in the speculators dialect (vLLM loads it natively), verifier ``req.target_name``, default
    proposal length ``req.speculative_tokens``.

    Field names checked against vLLM ``transformers_utils/configs/speculators/base.py`` (requires
    ``speculators_model_type``, ``transformer_layer_config`` dict, ``speculators_config.proposal_methods[0]
    .speculative_tokens``, ``speculators_config.verifier.name_or_path``) and ``.../algos.py::update_eagle3``
    (reads top-level ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` and
    ``norm_before_residual`` — defaulting the latter to True, hence written explicitly), and against
    speculators ``models/eagle3/config.py`` (``architectures: ["Eagle3Speculator"]``) / ``config.py``
    (``algorithm``, ``proposal_methods``, ``default_proposal_method``, ``verifier{name_or_path,
    architectures}``; greedy proposals carry ``speculative_tokens``, ``verifier_accept_k``,
    ``accept_tolerance``).
    """
    aux = aux_id_conventions(cfg.aux_layer_ids, cfg.target_num_layers)
    out: dict[str, Any] = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama_fields(cfg, req.target_config, dtype_name),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(req.speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": req.target_name,
                "architectures": list(getattr(req.target_config, "architectures", None) or []),
            },
        },
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": False,
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": dtype_name,
    }
    if aux["in_config"]:
        out["eagle_aux_hidden_state_layer_ids"] = aux["vllm"]
    return out


# --------------------------------------------------------------------------------------- dialects
@dataclass(frozen=True)
class ConfigDialect:
    """One EAGLE-3 dialect: the config.json it writes and the prefix of the decoder layer's tensor names."""

    config: Callable[[Eagle3Config, ExportRequest, str], dict[str, Any]]
    layer_prefix: str


#: what each dialect writes: ``hf`` for vLLM and SGLang, ``speculators`` for vLLM and the speculators library
DIALECTS: dict[str, ConfigDialect] = {
    "hf": ConfigDialect(hf_config, "midlayer."),
    "speculators": ConfigDialect(speculators_config, "layers.0."),
}


# --------------------------------------------------------------------------------------- tensors
def engine_tensors(
    draft: Eagle3Draft, dtype: torch.dtype, dialect: Dialect = "hf"
) -> dict[str, torch.Tensor]:
    """The tensors model.safetensors holds: floats cast to ``dtype`` (and checked finite), d2t int64, t2d bool;
    the decoder layer's names under the dialect's prefix (``midlayer.*``, speculators' ``layers.0.*``)."""
    prefix = DIALECTS[dialect].layer_prefix
    out = {}
    for name, t in draft.engine_state_dict().items():
        t = t.detach().to("cpu")
        if name == "d2t":
            t = t.to(torch.long)
        elif name == "t2d":
            t = t.to(torch.bool)
        else:
            t = t.to(dtype)
            check_finite(name, t, dtype)
        if name.startswith("midlayer."):
            name = prefix + name[len("midlayer.") :]
        out[name] = t.contiguous()
    return out


def engine_name(name: str) -> str:
    """speculators' ``layers.0.*`` → our ``midlayer.*``."""
    return "midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name


# --------------------------------------------------------------------------------------- write / load
_AUX_NOTE = (
    "hf = HF hidden_states indices = vLLM ids; SGLang reads ids k-1 (it adds one). "
    "in_config false: config.json omits them and both engines use their default (2, L//2, L-3)."
)


def write_eagle3(draft: Eagle3Draft, out_dir: Path, req: ExportRequest) -> dict[str, Any]:
    """Write the plain (LoRA-merged) EAGLE-3 ``draft`` at ``out_dir`` in ``req.dialect``; returns the manifest
    as written.  Everything is validated before anything is written; the folder appears atomically (temp +
    rename)."""
    out_dir, dialect = Path(out_dir), DIALECTS.get(req.dialect)
    if dialect is None:
        raise ExportError(f"unknown dialect {req.dialect!r}: expected {' or '.join(map(repr, DIALECTS))}")
    dtype_name = float_dtype_name(req.dtype)
    check_destination(out_dir, req.overwrite, req.extra_manifest, RESERVED_KEYS)
    validate_draft(draft, req.target_config)

    cfg = dataclasses.replace(draft.cfg, torch_dtype=dtype_name)
    config = dialect.config(cfg, req, dtype_name)
    tensors = engine_tensors(draft, req.dtype, req.dialect)
    aux = aux_id_conventions(cfg.aux_layer_ids, cfg.target_num_layers)
    manifest = draft_manifest(
        {"format": EAGLE3_FORMAT, "format_version": FORMAT_VERSION, "dialect": req.dialect},
        req,
        architecture=config["architectures"][0],
        aux_layer_ids={**aux, "note": _AUX_NOTE},
        draft_vocab_size=cfg.draft_vocab_size,
        head_config={"eagle3_config": cfg.to_dict()},
    )
    publish_folder(out_dir, tensors, manifest, config=config, overwrite=req.overwrite)
    return manifest


def weights_data_bytes(path: Path, manifest: Mapping[str, Any]) -> int:
    """The tensor bytes model.safetensors holds for the manifest's ``eagle3_config`` and ``dtype``: the engine
    tensors' elements at the stored float size, d2t int64, t2d bool."""
    cfg = read_head_config(path, manifest, "eagle3_config", Eagle3Config.from_dict)
    item = stored_itemsize(path, manifest)
    sizes = {"d2t": 8, "t2d": 1}
    return sum(math.prod(shape) * sizes.get(name, item) for name, shape in expected_shapes(cfg).items())


def load_eagle3(
    path: Path,
    manifest: Mapping[str, Any],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> Eagle3Draft:
    """Rebuild the EAGLE-3 draft saved at ``path`` (either dialect) from its (already read) ``manifest``
    (``weights``: model.safetensors' tensors as the caller parsed them from the bytes it verified; None: read).

    The module is built on the ``meta`` device and the checkpoint tensors are assigned to it (float
    tensors cast to ``dtype``; d2t int64, t2d bool), then moved to ``device``.
    """
    path = Path(path)
    cfg = read_head_config(path, manifest, "eagle3_config", Eagle3Config.from_dict)
    tensors = {engine_name(k): v for k, v in (read_weights(path) if weights is None else weights).items()}
    check_tensors(tensors, cfg)
    check_config_json(
        path, cfg, {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size}
    )
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    if full_vocab(cfg):
        state.update(Eagle3Draft.identity_vocab(cfg))
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    draft.load_state_dict(state, strict=True, assign=True)
    draft.rotary = Rotary(cfg)  # non-persistent RoPE buffers were built on meta; recompute them for real
    draft.to(device)
    return draft


# --------------------------------------------------------------------------------------- against a target
def check_target(manifest: Mapping[str, Any], target_config: Any) -> None:
    """ExportError unless the EAGLE-3 draft ``manifest`` describes fits ``target_config``: hidden size, vocab
    size, max_position_embeddings, aux layers capturable on this target's depth (and, when config.json relies on
    the engines' default ids, that the default for this depth is what the draft was trained on)."""
    target = manifest["target"]
    check_built_for(
        "draft trained for",
        (
            ("hidden size", target["hidden_size"], int(target_config.hidden_size)),
            ("vocab size", target["vocab_size"], int(target_config.vocab_size)),
        ),
    )
    check_positions(manifest["eagle3_config"]["max_position_embeddings"], target_config)
    n_layers = int(target_config.num_hidden_layers)
    aux = manifest["aux_layer_ids"]
    ids = [int(i) for i in aux["hf"]]
    bad = [i for i in ids if not 1 <= i <= n_layers - 1]
    if bad:
        raise ExportError(
            f"num layers mismatch: aux_layer_ids {ids} out of range for a {n_layers}-layer target "
            f"(capturable: 1..{n_layers - 1})"
        )
    default = list(default_aux_layer_ids(n_layers))
    if not aux["in_config"] and default != ids:
        raise ExportError(
            f"num layers mismatch: config.json relies on the engines' default aux layers, which for a "
            f"{n_layers}-layer target are {default}, but the draft was trained on {ids}"
        )


# --------------------------------------------------------------------------------------- what a Tap captures
def tap_capture(path: Path, manifest: Mapping[str, Any]) -> TapCapture:
    """The aux layers of ``eagle3_config`` and ``d2t + arange`` from model.safetensors, whose sha256 and size are
    verified first (CorruptCheckpointError otherwise); only the one ``d2t`` tensor is read (``safe_open``)."""
    cfg = Eagle3Config.from_dict(dict(manifest["eagle3_config"]))
    verify_file(path, WEIGHTS_FILE, manifest["files"][WEIGHTS_FILE])
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            if full_vocab(cfg) and "d2t" not in f.keys():  # stored in target order, no map (heads/eagle3.py)
                d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
            else:
                d2t = f.get_tensor("d2t").to(torch.long)
    except Exception as e:  # safetensors raises its own error types
        raise CorruptCheckpointError(f"{WEIGHTS_FILE}: no readable d2t ({e})") from e
    if d2t.shape != (cfg.draft_vocab_size,):
        raise CorruptCheckpointError(
            f"{WEIGHTS_FILE}: d2t is {list(d2t.shape)}, expected [{cfg.draft_vocab_size}]"
        )
    return tuple(cfg.aux_layer_ids), d2t + torch.arange(d2t.numel())


FORMAT = HeadFormat(
    name=EAGLE3_FORMAT,
    kind="eagle3",
    head=Eagle3Draft,
    write_head=write_eagle3,
    head_tensors=engine_tensors,
    load=load_eagle3,
    weights_data_bytes=weights_data_bytes,
    check_target=check_target,
    tap_capture=tap_capture,
)
