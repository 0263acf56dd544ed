"""The recipe fields with a fixed set of values: each is typed by a ``StrEnum`` that OmegaConf checks on load.
Its members are strings: ``recipe.draft.head == "eagle3"`` and ``f"{mode}"`` work as with plain strings; the values
come from their one source (``conventions.py``)."""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from enum import Enum, StrEnum
from typing import Any

from draft_align.conventions import (
    FLOAT_DTYPE_NAMES,
    LOSS_KINDS,
    RECIPE_HEAD_KINDS,
    ROLLOUT_VERIFY_MODES,
    VERIFY_MODES,
    MTPImpl,
    MTPLayout,
)

CHOICE_NAMES: dict[type[Enum], str] = {}  # how a RecipeError names a value of each choice


def _choice(name: str, values: Sequence[str], what: str) -> type[StrEnum]:
    """A choice field's type: the StrEnum of ``values`` (member name = value, so OmegaConf reads the YAML
    string as the member; OmegaConf 2.3 checks Enum fields but has no Literal ones)."""
    enum = StrEnum(name, [(v, v) for v in values], module=__name__, qualname=name)  # type: ignore[misc]
    CHOICE_NAMES[enum] = what
    return enum


# the verify modes, dtypes, head kinds and MTP layouts from their one source
HeadChoice = _choice("HeadChoice", RECIPE_HEAD_KINDS, "draft head")
MTPLayoutChoice = _choice("MTPLayoutChoice", typing.get_args(MTPLayout), "MTP layout")
MTPImplChoice = _choice("MTPImplChoice", typing.get_args(MTPImpl), "native MTP implementation")
MTPInitChoice = _choice("MTPInitChoice", ("last_layer", "random"), "MTP init")
AdaptChoice = _choice("AdaptChoice", ("full", "lora"), "adaptation")  # whole draft | LoRA over a frozen one
LossChoice = _choice("LossChoice", LOSS_KINDS, "loss")  # training objectives (conventions.LossKind)
VerifyModeChoice = _choice("VerifyModeChoice", VERIFY_MODES, "verify mode")
RolloutVerifyChoice = _choice("RolloutVerifyChoice", ROLLOUT_VERIFY_MODES, "rollout verify mode")  # + auto
EngineChoice = _choice("EngineChoice", ("auto", "vllm", "reference", "server"), "rollout engine")
# the RL job's silent-zero guard: its own rollout counters (off its critical path), a synchronous probe decode
# in the engine after each new draft, or none
DraftGuardChoice = _choice("DraftGuardChoice", ("counters", "probe", "none"), "draft guard")
# what generates the self-distillation responses (auto: vLLM when importable, else the HF loop)
GenEngineChoice = _choice("GenEngineChoice", ("auto", "vllm", "hf"), "generation engine")
# when the sidecar trains (sidecar/trigger.py)
TrainTriggerChoice = _choice("TrainTriggerChoice", ("always", "drift"), "training trigger")
ParallelChoice = _choice("ParallelChoice", ("ddp", "fsdp2"), "parallelism")  # draft replicated | sharded
# where the sidecar runs: a child process of the RL job, or an actor (gang) on a Ray cluster (docs/ray.md)
SidecarHostChoice = _choice("SidecarHostChoice", ("process", "ray"), "sidecar host")
# a Ray-hosted sidecar's lifetime: dies with the driver that started it, or outlives it (re-attach by name)
RayLifetimeChoice = _choice("RayLifetimeChoice", ("job", "detached"), "Ray lifetime")
# how `draft-align push` treats a server's requests in flight while it loads a version (docs/servers.md)
PushPauseChoice = _choice("PushPauseChoice", ("none", "keep"), "push pause mode")
WandbModeChoice = _choice("WandbModeChoice", ("offline", "online", "disabled"), "wandb mode")
# the draft_align/* keys TRL's log carries: a handful (integrations/trl/session.py BRIEF_METRICS), or every one
TRLMetricsChoice = _choice("TRLMetricsChoice", ("brief", "full"), "TRL metrics")
DtypeChoice = _choice("DtypeChoice", FLOAT_DTYPE_NAMES, "dtype")


def choice_type(hint: Any) -> type[Enum] | None:
    """The choice enum of a field's type hint (``list[...]``: of its items; ``... | None``: of the other), or
    None."""
    if typing.get_origin(hint) is list:
        (hint,) = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    return hint if hint in CHOICE_NAMES else None
