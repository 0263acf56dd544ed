"""Names and defaults that several parts of draft_align must agree on, each defined exactly once.

Everything here is a plain value or a pure function: recipes (``config``), heads, the wire, the
exporters and the engine adapter all import it, and it imports nothing of the project.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

#: How a speculative round verifies the draft's tokens (docs/acceptance.md):
#: ``greedy`` target argmax vs draft argmax; ``greedy_draft`` the draft proposes its argmax and the target
#: accepts it with probability p(x) (vLLM's default draft sampling at T > 0); ``probabilistic`` the draft
#: samples from q and the target accepts with min(1, p/q) (lossless rejection sampling).
VerifyMode = Literal["greedy", "greedy_draft", "probabilistic"]
VERIFY_MODES: tuple[str, ...] = get_args(VerifyMode)

#: Draft head architectures (and so export formats): EAGLE-3 heads and multi-token-prediction (MTP) heads.
HeadKind = Literal["eagle3", "mtp"]
#: The MTP tensor layouts draft_align imports and exports (docs/formats.md §3).
MTPLayout = Literal["deepseek_v3", "qwen3_next"]

#: The shortest sequence a Tap ships: one token and the next one it predicts.
MIN_TAP_SEQUENCE_TOKENS = 2

#: dtype names as written in recipes, manifests and wire headers.
DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "int32": torch.int32,
    "int64": torch.int64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
FloatDtypeName = Literal["bfloat16", "float16", "float32"]
FLOAT_DTYPE_NAMES: tuple[str, ...] = get_args(FloatDtypeName)
_NAMES = {v: k for k, v in DTYPES.items()}

#: Modules of a Llama-style decoder block that LoRA adapts by default (policy and draft alike).
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def float_dtype(name: str) -> torch.dtype:
    """The torch dtype of a floating-point dtype name; ValueError names the allowed ones."""
    if name not in FLOAT_DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} not supported: use one of {list(FLOAT_DTYPE_NAMES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a dtype in :data:`DTYPES`; ValueError for any other dtype."""
    if dtype not in _NAMES:
        raise ValueError(f"dtype {dtype} not supported: use one of {list(DTYPES)}")
    return _NAMES[dtype]


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The engines' default EAGLE-3 capture points, as HF ``hidden_states`` indices: (2, L//2, L-3)
    (vLLM and SGLang use the same layers, each in its own indexing; docs/formats.md)."""
    return (2, num_layers // 2, num_layers - 3)


def check_tap_budgets(tokens_per_step: int, max_tokens_per_message: int) -> None:
    """The rule on a tap's budgets (the Tap's constructor and the recipe's ``tap`` section both apply it): each
    must hold one :data:`MIN_TAP_SEQUENCE_TOKENS`-token sequence.  ValueError names the bound."""
    for name, value in (("max_tokens_per_message", max_tokens_per_message), ("tokens_per_step", tokens_per_step)):
        if int(value) < MIN_TAP_SEQUENCE_TOKENS:
            raise ValueError(f"{name} must be ≥ {MIN_TAP_SEQUENCE_TOKENS}, got {value}")
