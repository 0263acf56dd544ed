"""LoRA adapters (peft) over a frozen draft head (EAGLE-3 or MTP), merging, and adapter-only deltas.

``apply_lora`` freezes every weight of a warm-started draft and injects peft LoRA layers in place (the
module keeps its class, so ``unroll``/``step`` and the trainer work unchanged): W x becomes
W x + (α/r)·B A x with A [r, in], B [out, r], B = 0 at start.  Engines load plain weights, so publishing
merges: W' = W + (α/r)·B A (:func:`merged`).

An adapter-only delta is a folder::

    adapter.safetensors   the LoRA A/B tensors (float32), named by module path
    manifest.json         format draft_align.lora_delta; the base draft's model.safetensors sha256; the
                          LoRA settings; the sha256 of the merged engine weights the loader must rebuild

:func:`load_adapter` re-hashes the base draft, refuses an adapter made for another base
(:class:`AdapterMismatchError`), rebuilds the merged draft and checks its sha256.
"""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import json
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from draft_align.conventions import LORA_TARGETS
from draft_align.heads.eagle3 import DraftConfigError

DELTA_FORMAT = "draft_align.lora_delta"
DELTA_FORMAT_VERSION = 1
ADAPTER_FILE = "adapter.safetensors"
DEFAULT_TARGETS = LORA_TARGETS


class AdapterMismatchError(ValueError):
    """An adapter-only delta that does not belong to the given base draft, or does not rebuild exactly."""


@dataclass(frozen=True)
class LoraSettings:
    """Adapter shape: rank r, scale α/r, the Linear module names (last path component) that get adapters."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.rank < 1:
            raise DraftConfigError(f"LoRA rank {self.rank} must be ≥ 1")
        if self.alpha <= 0:
            raise DraftConfigError(f"LoRA alpha {self.alpha} must be > 0")
        if not self.target_modules:
            raise DraftConfigError("LoRA target_modules is empty")
        if not 0.0 <= self.dropout < 1.0:
            raise DraftConfigError(f"LoRA dropout {self.dropout} must be in [0, 1)")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d


def _lora_layer_type() -> type:
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def is_lora(draft: nn.Module) -> bool:
    """Whether ``draft`` carries injected LoRA layers."""
    if "peft" not in sys.modules:  # nothing was injected, and peft's import is not paid for a plain draft
        return False
    kind = _lora_layer_type()
    return any(isinstance(m, kind) for m in draft.modules())


def apply_lora(draft: nn.Module, settings: LoraSettings, seed: int = 0) -> nn.Module:
    """Freeze ``draft`` and inject LoRA adapters into its ``settings.target_modules`` (in place; returned).

    A shared, frozen target head (MTP's ``lm_head``) cannot be adapted.  Raises DraftConfigError when a
    target name matches no Linear of the draft.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if is_lora(draft):
        raise DraftConfigError("the draft already carries LoRA adapters")
    if draft.shares_target_head and "lm_head" in settings.target_modules:
        raise DraftConfigError("an MTP head's lm_head is the target's (shared, frozen): it cannot take an adapter")
    linear_names = {name.rsplit(".", 1)[-1] for name, m in draft.named_modules() if isinstance(m, nn.Linear)}
    unknown = sorted(set(settings.target_modules) - linear_names)
    if unknown:
        raise DraftConfigError(f"LoRA target_modules {unknown} match no Linear of the draft (has {sorted(linear_names)})")
    for p in draft.parameters():
        p.requires_grad_(False)
    cfg = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, target_modules=list(settings.target_modules),
        lora_dropout=settings.dropout, bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(cfg, draft)
    for name, p in draft.named_parameters():
        p.requires_grad_("lora_" in name)
    draft.lora_settings = settings  # type: ignore[assignment]  # read back by export_adapter
    return draft


def lora_state_dict(draft: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only: ``<module path>.lora_A.weight`` / ``.lora_B.weight`` (float32, detached)."""
    out = {}
    for name, t in draft.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            out[name.replace(".default.", ".")] = t.detach().to("cpu", torch.float32).contiguous()
    return out


def load_lora_state_dict(draft: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (as :func:`lora_state_dict` names them) into ``draft``; names and shapes must
    match exactly (AdapterMismatchError otherwise)."""
    own = lora_state_dict(draft)
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise AdapterMismatchError(f"adapter tensors differ from the draft's: missing {missing}, unexpected {unexpected}")
    params = dict(draft.named_parameters())
    with torch.no_grad():
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise AdapterMismatchError(f"{name} is {list(t.shape)}, the draft's adapter is {list(own[name].shape)}")
            a, b = name.rsplit(".lora_", 1)
            p = params[f"{a}.lora_{b.split('.', 1)[0]}.default.{b.split('.', 1)[1]}"]
            p.copy_(t.to(p.device, p.dtype))


def merged(draft: nn.Module) -> nn.Module:
    """A plain copy of ``draft`` with every adapter merged into its base weight: W' = W + (α/r)·B A.

    The copy has the draft's class and no peft modules; ``draft`` itself is left untouched.
    """
    kind = _lora_layer_type()
    out = copy.deepcopy(draft)
    with torch.no_grad():
        for name, mod in list(out.named_modules()):
            if not isinstance(mod, kind):
                continue
            mod.merge()
            base = mod.get_base_layer()
            parent_name, _, child = name.rpartition(".")
            parent = out.get_submodule(parent_name) if parent_name else out
            setattr(parent, child, base)
    if hasattr(out, "lora_settings"):
        del out.lora_settings
    for p in out.parameters():
        p.requires_grad_(True)
    if out.shares_target_head:
        out.lm_head.weight.requires_grad_(False)
    return out


# --------------------------------------------------------------------------------------- engine bytes
def engine_tensors(draft: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Exactly the tensors a publish of this (plain) draft writes to model.safetensors."""
    if is_lora(draft):
        raise DraftConfigError("merge the adapters first (engine tensors are plain weights)")
    if draft.shares_target_head:
        from draft_align.publish.mtp_export import to_layout

        return {k: v.detach().to("cpu", dtype).contiguous() for k, v in to_layout(draft).items()}  # type: ignore[arg-type]
    from draft_align.publish.export import _engine_tensors

    return _engine_tensors(draft, dtype, "hf")  # type: ignore[arg-type]


def engine_sha256(draft: nn.Module, dtype: torch.dtype = torch.bfloat16) -> str:
    """sha256 of the model.safetensors a publish of ``draft`` writes (same serializer and metadata)."""
    data = safetensors.torch.save(engine_tensors(draft, dtype), metadata={"format": "pt"})
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------- deltas
def _base_sha(base_dir: Path) -> tuple[str, dict[str, Any]]:
    from draft_align.publish.export import WEIGHTS_FILE, read_manifest

    man = read_manifest(Path(base_dir), verify=True)  # re-hashes the base files
    return man["files"][WEIGHTS_FILE]["sha256"], man


def _rebuild(base_dir: Path, settings: LoraSettings, tensors: dict[str, torch.Tensor]) -> nn.Module:
    from draft_align.publish.export import load_draft

    base, _ = load_draft(Path(base_dir), verify=False)
    apply_lora(base, settings)
    load_lora_state_dict(base, tensors)
    return merged(base)


@dataclass
class DeltaInfo:
    """What :func:`export_adapter` wrote."""

    path: Path
    base_sha256: str
    merged_sha256: str
    bytes: int
    extra: dict[str, Any] = field(default_factory=dict)


def export_adapter(
    draft: nn.Module,
    out_dir: Path,
    base_dir: Path,
    *,
    draft_version: int,
    policy_version: int,
    dtype: torch.dtype = torch.bfloat16,
    metrics: dict[str, Any] | None = None,
) -> DeltaInfo:
    """Write the adapters of ``draft`` (trained over the draft published at ``base_dir``) as a delta folder.

    The base's weights must be the ones the adapters were trained over: the draft's frozen base weights,
    cast to ``dtype``, must equal the base folder's (AdapterMismatchError otherwise, nothing written).
    The recorded merged sha256 is that of base folder + adapters, rebuilt as :func:`load_adapter` does.
    """
    if not is_lora(draft):
        raise DraftConfigError("the draft carries no LoRA adapters")
    settings: LoraSettings = draft.lora_settings  # type: ignore[assignment]
    base_sha, base_man = _base_sha(base_dir)
    unmerged = copy.deepcopy(draft)
    _strip_adapters(unmerged)
    mine = engine_tensors(unmerged, dtype)
    theirs = safetensors.torch.load_file(str(Path(base_dir) / "model.safetensors"))
    if set(mine) != set(theirs) or any(not torch.equal(mine[k], theirs[k].to(mine[k].dtype)) for k in mine):
        raise AdapterMismatchError(
            f"the adapters were trained over another base than {base_dir} (its weights differ from the draft's "
            f"frozen base): not written"
        )
    tensors = lora_state_dict(draft)
    merged_sha = engine_sha256(_rebuild(base_dir, settings, tensors), dtype)
    manifest = {
        "format": DELTA_FORMAT,
        "format_version": DELTA_FORMAT_VERSION,
        "base": {"sha256": base_sha, "draft_version": base_man.get("draft_version"), "format": base_man["format"]},
        "lora": settings.to_dict(),
        "merged_sha256": merged_sha,
        "dtype": str(dtype).removeprefix("torch."),
        "draft_version": int(draft_version),
        "policy_version": int(policy_version),
        "metrics": metrics or {},
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "files": {},
    }
    from draft_align.publish.export import publish_folder

    out_dir = Path(out_dir)
    publish_folder(out_dir, tensors, manifest, weights_file=ADAPTER_FILE)
    size = manifest["files"][ADAPTER_FILE]["bytes"]
    return DeltaInfo(out_dir, base_sha, merged_sha, size)


def _strip_adapters(draft: nn.Module) -> None:
    """Replace every LoRA layer of ``draft`` by its (unmerged) base layer, in place."""
    kind = _lora_layer_type()
    for name, mod in list(draft.named_modules()):
        if isinstance(mod, kind):
            parent_name, _, child = name.rpartition(".")
            parent = draft.get_submodule(parent_name) if parent_name else draft
            setattr(parent, child, mod.get_base_layer())
    if hasattr(draft, "lora_settings"):
        del draft.lora_settings


def read_delta_manifest(delta_dir: Path) -> dict[str, Any]:
    """The delta's manifest, with its adapter file re-hashed (AdapterMismatchError when it differs)."""
    from draft_align.publish.export import _digest

    delta_dir = Path(delta_dir)
    try:
        man = json.loads((delta_dir / "manifest.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise AdapterMismatchError(f"{delta_dir}: no readable manifest.json ({e})") from e
    if man.get("format") != DELTA_FORMAT or man.get("format_version") != DELTA_FORMAT_VERSION:
        raise AdapterMismatchError(f"{delta_dir}: not a {DELTA_FORMAT} v{DELTA_FORMAT_VERSION} folder")
    info = man["files"][ADAPTER_FILE]
    sha, size = _digest(delta_dir / ADAPTER_FILE)
    if sha != info["sha256"] or size != info["bytes"]:
        raise AdapterMismatchError(f"{delta_dir / ADAPTER_FILE}: sha256/size differ from the manifest (corrupt)")
    return man


def load_adapter(delta_dir: Path, base_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the merged draft of an adapter-only delta over the draft published at ``base_dir``.

    Raises AdapterMismatchError when the base's sha256 is not the one the delta records (an adapter for
    another base), or when the rebuilt merged weights' sha256 differs from the recorded one.
    """
    man = read_delta_manifest(delta_dir)
    base_sha, _ = _base_sha(base_dir)
    if base_sha != man["base"]["sha256"]:
        raise AdapterMismatchError(
            f"adapter {delta_dir} was trained over base draft sha256 {man['base']['sha256'][:16]}…, but "
            f"{base_dir} has {base_sha[:16]}…: refusing to merge it"
        )
    lora = dict(man["lora"])
    settings = LoraSettings(**lora)
    tensors = safetensors.torch.load_file(str(Path(delta_dir) / ADAPTER_FILE))
    out = _rebuild(base_dir, settings, tensors)
    dtype = getattr(torch, man.get("dtype", "bfloat16"))
    got = engine_sha256(out, dtype)
    if got != man["merged_sha256"]:
        raise AdapterMismatchError(
            f"merged weights rebuilt from {delta_dir} hash to {got[:16]}…, the delta records "
            f"{man['merged_sha256'][:16]}…"
        )
    return out, man


def publish_adapter(
    delta_dir: Path, base_dir: Path, out_dir: Path, *, target_config: Any, target_name: str,
    tokenizer_fingerprint: str, metrics: dict[str, Any] | None = None,
) -> Path:
    """Rebuild the merged draft of a delta (:func:`load_adapter`) and publish it as a plain engine-format
    folder; its model.safetensors must hash to the delta's merged sha256 (else the folder is removed)."""
    from draft_align.publish.export import WEIGHTS_FILE, export_draft

    draft, man = load_adapter(delta_dir, base_dir)
    out = export_draft(
        draft, Path(out_dir), target_config=target_config, target_name=target_name, metrics=metrics or {},  # type: ignore[arg-type]
        draft_version=int(man["draft_version"]), policy_version=int(man["policy_version"]),
        tokenizer_fingerprint=tokenizer_fingerprint, dtype=getattr(torch, man.get("dtype", "bfloat16")),
        extra_manifest={"lora_delta": {"base_sha256": man["base"]["sha256"], "merged_sha256": man["merged_sha256"]}},
    )
    written = json.loads((out / "manifest.json").read_text())["files"][WEIGHTS_FILE]["sha256"]
    if written != man["merged_sha256"]:
        shutil.rmtree(out, ignore_errors=True)
        raise AdapterMismatchError(f"published weights hash to {written[:16]}…, expected {man['merged_sha256'][:16]}…")
    return out


def lora_settings(cfg: Any) -> LoraSettings:
    """LoraSettings from a recipe's ``lora`` section (``config.LoraAdaptConfig``)."""
    return LoraSettings(rank=int(cfg.rank), alpha=float(cfg.alpha), target_modules=tuple(cfg.target_modules),
                        dropout=float(cfg.dropout))
