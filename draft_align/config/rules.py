"""The rules a recipe's values must keep beyond their types: the allowed range of every numeric field
(:data:`RANGES`, declared once per section field and checked by :func:`check_ranges`), the helpers the recipes'
``validate()`` use, and :class:`RecipeError`, the one error every recipe problem is raised as."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any

from draft_align.config.choices import CHOICE_NAMES, AdaptChoice, choice_type
from draft_align.config.sections import (
    DataConfig,
    DraftConfig,
    EvalConfig,
    LoggingConfig,
    LoraAdaptConfig,
    ObjectiveConfig,
    PolicyLoraConfig,
    PushConfig,
    RayConfig,
    RLConfig,
    RLEngineConfig,
    RLGuardConfig,
    RLPolicyConfig,
    RLTaskConfig,
    SidecarBufferConfig,
    SidecarConfig,
    SidecarGateConfig,
    SidecarMonitorConfig,
    SidecarPublishConfig,
    SidecarRecordingConfig,
    SidecarTrainConfig,
    SidecarTriggerConfig,
    TapConfig,
    TrainConfig,
    WireConfig,
)
from draft_align.conventions import (
    MAX_TEMPERATURE,
    MIN_TAP_SEQUENCE_TOKENS,
    MIN_TEMPERATURE,
    RENAMED_VALUES,
    check_loss,
)


class RecipeError(ValueError):
    """A recipe that does not match the schema."""


_INT64 = 2**63 - 1  # every integer field must also fit an int64 (torch, numpy, ZeroMQ options, the wire)


@dataclass(frozen=True)
class Range:
    """The values a numeric field may hold: low ≤ v ≤ high (``open_low``/``open_high``: strict), or one of
    ``also``; None bounds are unbounded.  NaN never holds, ±inf only where ``inf_ok`` (a float field whose
    docs give inf a meaning).  ``note``: the meaning of special values, shown in the error."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    also: tuple[float, ...] = ()
    inf_ok: bool = False
    note: str = ""

    def holds(self, v: float) -> bool:
        if v in self.also:
            return True
        if isinstance(v, float) and (math.isnan(v) or (math.isinf(v) and not self.inf_ok)):
            return False
        if isinstance(v, int) and abs(v) > _INT64:
            return False
        lo_ok = self.low is None or (v > self.low if self.open_low else v >= self.low)
        hi_ok = self.high is None or (v < self.high if self.open_high else v <= self.high)
        return lo_ok and hi_ok

    def text(self) -> str:
        """The range in words: ``≥ 1``, ``> 0``, ``in [0, 1)``, ``0 or in [0.001, 100]``."""
        lo, hi = _num(self.low), _num(self.high)
        if self.low is not None and self.high is not None:
            r = f"in {'(' if self.open_low else '['}{lo}, {hi}{')' if self.open_high else ']'}"
        elif self.low is not None:
            r = f"{'>' if self.open_low else '≥'} {lo}"
        elif self.high is not None:
            r = f"{'<' if self.open_high else '≤'} {hi}"
        else:
            r = "finite"
        if self.also:
            r = f"{' or '.join(_num(a) for a in self.also)} or {r}"
        return f"{r} ({self.note})" if self.note else r


def _num(x: float | None) -> str:
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
ABOVE_0 = Range(0, open_low=True)
FRACTION = Range(0, 1)  # [0, 1]
DROPOUT = Range(0, 1, open_high=True)
SEED = Range(0, 2**32 - 1)  # numpy's and torch's seed range; seed·1000 + epoch still fits an int64
SECONDS = Range(0, 7 * 86400, open_low=True)  # timeouts and periods: more than a week is a typo
# conventions.temperature_ok, the wire's rule too
TEMPERATURE = Range(MIN_TEMPERATURE, MAX_TEMPERATURE, also=(0.0,), note="0: greedy")
TOKENS = Range(1)  # token counts
# learning rates and loss weights: positive, and no larger than any run has a use for (1e300 loads as a float
# and trains NaN; a bound keeps such a typo or a hostile override out of the recipe)
LR = Range(0, 10, open_low=True)
WEIGHT_DECAY = Range(0, 100)
GRAD_CLIP = Range(0, 1e6, open_low=True)
COEF = Range(0, 1e6)  # loss and penalty coefficients
MAX_STRING = 4096  # characters of any string field (a path, a URL, a name)

#: Every numeric field's range, by section (a list field: each item's).  A new numeric field without an entry
#: fails tests/test_config.py; ``None`` values of an optional field are always allowed.
RANGES: dict[type, dict[str, Range]] = {
    DataConfig: {
        "max_conversations": Range(1, note="null: all"),
        "heldout": AT_LEAST_1,
        "split_seed": SEED,
        "max_prompt_tokens": TOKENS,
        "max_seq_len": Range(2),
        "gen_temperature": TEMPERATURE,
        "gen_max_new_tokens": TOKENS,
        "gen_batch_size": AT_LEAST_1,
        "gen_time_budget_s": Range(0, note="null: no limit"),
        "extra_original_conversations": AT_LEAST_0,
        "capture_batch_tokens": TOKENS,
    },
    LoraAdaptConfig: {
        "rank": AT_LEAST_1,
        "alpha": Range(0, 1e6, open_low=True),
        "dropout": DROPOUT,
        "lr": LR,
        "weight_decay": WEIGHT_DECAY,
        "warmup_steps": AT_LEAST_0,
    },
    DraftConfig: {
        "mtp_depth": Range(1, 64),
        "aux_layer_ids": Range(0, 4096),  # HF hidden_states indices
        "draft_vocab_size": Range(2),
    },
    ObjectiveConfig: {  # train.objective and sidecar.train.objective
        "ttt_steps": Range(1, 64),
        "step_decay": Range(0, open_low=True, note="null: the head's default"),
        "soft_ce_weight": COEF,
        "surrogate_tau": Range(0, 1e3, open_low=True),
        "lr": LR,
        "min_lr_ratio": FRACTION,
        "weight_decay": WEIGHT_DECAY,
        "warmup_steps": AT_LEAST_0,
        "grad_clip": GRAD_CLIP,
    },
    TrainConfig: {
        "batch_tokens": TOKENS,
        "epochs": AT_LEAST_1,
        "max_steps": Range(1, note="null: the epochs decide"),
        "time_budget_s": Range(0, open_low=True, note="null: no limit"),
        "checkpoint_every": AT_LEAST_1,
        "max_consecutive_nonfinite": AT_LEAST_1,
        "num_threads": Range(1, 1024, note="null: torch's default"),
    },
    EvalConfig: {
        "k": Range(1, 64),
        "prompts": AT_LEAST_1,
        "max_new_tokens": TOKENS,
        "temperatures": TEMPERATURE,
        "seed": SEED,
    },
    LoggingConfig: {"log_every": AT_LEAST_1},
    WireConfig: {
        "max_message_mb": Range(1, 65536),  # ≤ 64 GiB
        "max_tokens": TOKENS,
        "queue_messages": AT_LEAST_1,
        "queue_mb": Range(1, 65536),
        "send_timeout_s": Range(0, 3600, open_low=True),
    },
    TapConfig: {
        "tokens_per_step": Range(MIN_TAP_SEQUENCE_TOKENS),  # conventions.check_tap_budgets
        "topk": Range(0, 4096),
        "max_tokens_per_message": Range(MIN_TAP_SEQUENCE_TOKENS),
    },
    SidecarConfig: {
        "ranks": Range(1, 4096),
        "collective_timeout_s": SECONDS,
        "num_threads": Range(1, 1024),
    },
    SidecarBufferConfig: {
        "tokens": Range(1, 2**40),
        "min_tokens": AT_LEAST_0,
        "recency_half_life": Range(0, open_low=True, inf_ok=True, note="inf: uniform sampling"),
        "holdout_records": AT_LEAST_1,
        "holdout_every": AT_LEAST_1,
        "max_replay_ratio": Range(0, 1e6, open_low=True),
    },
    SidecarTrainConfig: {
        "batch_tokens": TOKENS,
        "lr_ramp_tokens": Range(0, note="0: off"),
        "anchor_decay": Range(0, 1e6, note="0: off"),
        "max_seq_tokens": Range(3, 1_048_576, note="at most the wire's tokens per message"),
        "max_consecutive_nonfinite": AT_LEAST_1,
        "checkpoint_every_s": SECONDS,
    },
    SidecarTriggerConfig: {
        "drift_tolerance": Range(0, 1, open_low=True, open_high=True),
        "drift_head_threshold": Range(0, 1e3, open_low=True),
        "drift_window": AT_LEAST_1,
        "drift_min_gain": Range(0, 1e3),
    },
    SidecarGateConfig: {
        "tolerance": Range(0, 64, note="sidecar.gate.k or more publishes every candidate"),
        "k": Range(1, 64),
        "temperature": TEMPERATURE,
    },
    SidecarPublishConfig: {
        "min_train_steps": AT_LEAST_0,
        "every_s": Range(0, 7 * 86400),
        "keep_versions": Range(2, 10_000),
    },
    SidecarMonitorConfig: {
        "log_every": AT_LEAST_1,
        "prometheus_port": Range(0, 65535, note="0: any free port; null: off"),
        "max_log_mb": Range(1, 1 << 20),
    },
    SidecarRecordingConfig: {
        "max_mb": AT_LEAST_1,
        "reserve_mb": AT_LEAST_0,
    },
    RLConfig: {
        "steps": AT_LEAST_1,
        "num_threads": Range(1, 1024),
        "wait_for_draft_s": Range(0, 7 * 86400),
    },
    RLTaskConfig: {
        "prompts_per_step": AT_LEAST_1,
        "group_size": Range(2, note="GRPO normalises within a group"),
        "max_new_tokens": TOKENS,
        "temperature": TEMPERATURE,
        "max_prompt_tokens": TOKENS,
        "first_prompt": AT_LEAST_0,
    },
    RLPolicyConfig: {
        "lr": LR,
        "clip_eps": Range(0, 100, open_low=True),
        "kl_coef": COEF,
        "kl_prompts": AT_LEAST_1,
        "grad_clip": GRAD_CLIP,
        "micro_batch": AT_LEAST_1,
        "save_merged_at": AT_LEAST_1,  # RL steps
    },
    PolicyLoraConfig: {
        "rank": AT_LEAST_1,
        "alpha": AT_LEAST_1,
        "dropout": DROPOUT,
    },
    RLEngineConfig: {
        "kv_cache_gb": Range(0, 4096, open_low=True),
        "max_model_len": Range(2),
        "spec_k": Range(1, 64),
        "verify_recheck_every": Range(0, note="0: measure the verify mode once"),
        "frozen_fraction": FRACTION,
    },
    RLGuardConfig: {
        "probe_prompts": Range(0, note="0: the probe guard off"),
        "probe_tokens": Range(2, note="one token gives no draft round"),
        "min_ratio": Range(0, 1, open_low=True, note="to turn the guard off: rl.guard.kind=none"),
    },
    PushConfig: {
        "poll_interval_s": Range(0.01, 3600),
        "retry_min_s": Range(0.01, 3600),
        "retry_max_s": Range(0.01, 86400),
        "timeout_s": Range(0.1, 3600),
        "prometheus_port": Range(0, 65535, note="0: any free port"),
        "row_every_s": Range(0.1, 86400),
    },
    RayConfig: {
        "num_cpus": Range(0, 1e6),
        "num_gpus": Range(0, 1e6),
        "max_restarts": Range(0, 10_000),
        "max_failures": Range(0, 10_000),
        "ready_timeout_s": SECONDS,
        "call_timeout_s": SECONDS,
    },
}


def _item_type(hint: Any) -> Any:
    """The scalar type of a field's hint: ``X | None`` → X, ``list[X]`` → X (``int | float`` stays a union)."""
    for _ in range(2):
        if typing.get_origin(hint) is list:
            (hint,) = typing.get_args(hint)
        elif typing.get_origin(hint) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            hint = args[0] if len(args) == 1 else hint
    return hint


def numeric_fields(cls: type, prefix: str = "") -> list[tuple[str, type, str]]:
    """``(dotted key, declaring dataclass, field name)`` of every int/float field (also optional, or a list of
    them) of the dataclass ``cls`` and its sections, in field order."""
    out: list[tuple[str, type, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += numeric_fields(hint, f"{prefix}{f.name}.")  # type: ignore[arg-type]
            continue
        if _item_type(hint) in (int, float):
            owner = next(k for k in cls.__mro__ if f.name in getattr(k, "__annotations__", {}))
            out.append((f"{prefix}{f.name}", owner, f.name))
    return out


def range_of(owner: type, name: str) -> Range:
    """The declared range of field ``name`` of the dataclass ``owner`` (KeyError when undeclared)."""
    return RANGES[owner][name]


def check_ranges(recipe: Any) -> None:
    """RecipeError, one line naming the key, its allowed range and the value, for the first numeric field of
    ``recipe`` outside its range (a list: the first bad item)."""
    for key, owner, name in numeric_fields(type(recipe)):
        value, rng = _get(recipe, key), range_of(owner, name)
        items = (
            [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
        )
        for k, v in items:
            if v is not None and (isinstance(v, bool) or not rng.holds(v)):
                raise RecipeError(f"{k} must be {rng.text()}, got {v}")


def check_strings(obj: Any, prefix: str = "") -> None:
    """RecipeError unless every string of the dataclass ``obj`` (and of its sections and lists) is at most
    :data:`MAX_STRING` characters with no control character: a path, URL or name with a newline or NUL in it is
    a mistake or an attack, and it would reach a file name, a log line or a socket address as it is."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_strings(value, f"{key}.")
            continue
        items = (
            [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
        )
        for k, v in items:
            if not isinstance(v, str) or isinstance(v, Enum):
                continue
            if len(v) > MAX_STRING:
                raise RecipeError(f"{k} is {len(v)} characters long; at most {MAX_STRING}")
            bad = next((c for c in v if ord(c) < 32 or ord(c) == 127), None)
            if bad is not None:
                raise RecipeError(f"{k} {v[:60]!r} holds the control character {bad!r}")


def check_run_name(run: str) -> None:
    """RecipeError unless ``run`` is one plain folder name: everything a run writes stays under output_dir."""
    if len(run.encode()) > 200:  # a file name holds 255 bytes; the run's own suffixes need the rest
        raise RecipeError(f"run is {len(run.encode())} bytes long; a run name holds at most 200")
    if not run or run in (".", "..") or "/" in run or "\\" in run or "\x00" in run or run.strip() != run:
        raise RecipeError(
            f"run {run!r} must be one plain folder name (no '/', '..', absolute path or surrounding spaces): "
            "the run folder is output_dir/run; to write elsewhere set output_dir"
        )


def check_lora(where: str, adapt: AdaptChoice, lora: LoraAdaptConfig) -> None:
    """The LoRA section's rule beyond its ranges, when ``adapt`` is ``lora``: some module to adapt."""
    if adapt == "lora" and not lora.target_modules:
        raise RecipeError(f"{where}.lora.target_modules must name at least one module")


def check_loss_section(where: str, section: ObjectiveConfig) -> None:
    """The objective's rule (conventions.check_loss) on an objective section (``train.objective``,
    ``sidecar.train.objective``: ``where``)."""
    try:
        check_loss(section.loss, section.accept_mode, section.soft_ce_weight, section.surrogate_tau)
    except ValueError as e:
        raise RecipeError(f"{where}.{e}") from e


def _get(recipe: Any, dotted: str) -> Any:
    obj = recipe
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_choices(obj: Any, prefix: str) -> None:
    """RecipeError unless every choice field of the dataclass ``obj`` (and of its sections) holds one of its
    values (loading checks that already; this is for a recipe built in code)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, choice, key = getattr(obj, f.name), choice_type(hints[f.name]), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{key}.")
        elif choice is not None:
            items = (
                [(f"{key}[{i}]", v) for i, v in enumerate(value)]
                if isinstance(value, list)
                else [(key, value)]
            )
            for k, v in items:
                if v is not None and v not in {m.value for m in choice}:  # None: an optional choice unset
                    raise choice_error(k, v, choice)


def choice_error(key: str, value: Any, choice: type[Enum]) -> RecipeError:
    """One line naming the key, the bad value and the allowed ones (a renamed value: its new name)."""
    new = RENAMED_VALUES.get((CHOICE_NAMES[choice], str(value)))
    if new is not None:
        return RecipeError(
            f"{key}: {CHOICE_NAMES[choice]} {str(value)!r} was renamed {new!r} (it is a Llama decoder block, not a "
            f"DeepSeek-V3 or Qwen3-Next layer; a model's own MTP layers: 'native_mtp')"
        )
    return RecipeError(
        f"{key}: unknown {CHOICE_NAMES[choice]} {str(value)!r}; expected one of "
        f"{' | '.join(m.value for m in choice)}"
    )


def check_push(push: Any) -> None:
    """``push``'s cross-field rules: each server an http(s) URL, backoff bounds in order."""
    for url in push.servers:
        if not str(url).startswith(("http://", "https://")):
            raise RecipeError(f"push.servers: {url!r} is not an http://host:port (or https://) URL")
    if push.retry_min_s > push.retry_max_s:
        raise RecipeError(f"push.retry_min_s {push.retry_min_s} > push.retry_max_s {push.retry_max_s}")
