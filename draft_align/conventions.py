"""Names and defaults that several parts of draft_align must agree on, each defined exactly once.

Everything here is a plain value or a pure function: recipes (``config``), heads, the wire, the
exporters and the engine adapter all import it, and it imports nothing of the project.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

#: The two drafts every RL step's rollouts are split between: the newest published ("adapted") and the starting
#: one ("frozen", the control); rollouts, engines, the TRL integration and the advisor key their numbers by these.
DraftKind = Literal["adapted", "frozen"]
DRAFT_KINDS: tuple[DraftKind, ...] = get_args(DraftKind)

#: How a speculative round verifies the draft's tokens (docs/acceptance.md):
#: ``greedy`` target argmax vs draft argmax; ``greedy_draft`` the draft proposes its argmax and the target
#: accepts it with probability p(x) (vLLM's default draft sampling at T > 0); ``probabilistic`` the draft
#: samples from q and the target accepts with min(1, p/q) (lossless rejection sampling).
VerifyMode = Literal["greedy", "greedy_draft", "probabilistic"]
VERIFY_MODES: tuple[str, ...] = get_args(VerifyMode)
#: What the RL rollouts may verify with (``rl.engine.verify_mode``): a verify mode, or ``auto`` — at T > 0 on vLLM
#: the draft sampling (``greedy_draft`` | ``probabilistic``) with the higher acceptance measured on the engine
#: (draft_align/engines/vllm/verify_choice.py).
AUTO_VERIFY_MODE = "auto"
ROLLOUT_VERIFY_MODES: tuple[str, ...] = (AUTO_VERIFY_MODE, *VERIFY_MODES)

#: The draft's training objectives (``train.objective.loss`` / ``sidecar.train.objective.loss``; formulas in
#: train/losses.py and docs/acceptance.md "Training objectives"): ``soft`` cross-entropy against the target's distribution p
#: (forward KL); ``hard`` cross-entropy on the sampled next tokens; ``tv`` per-step 1 − Σ min(p, q) (what
#: ``probabilistic`` verification rejects); ``greedy_surrogate`` per-step 1 − a smooth α of greedy-draft
#: verification; ``expected_length`` the chain's expected number of accepted drafts Σ_i Π_{j≤i} α_j.
LossKind = Literal["soft", "hard", "tv", "greedy_surrogate", "expected_length"]
LOSS_KINDS: tuple[str, ...] = get_args(LossKind)
#: the objectives on acceptance α, and the verify mode each scores by default
ACCEPTANCE_LOSSES: dict[str, str] = {
    "tv": "probabilistic",
    "greedy_surrogate": "greedy_draft",
    "expected_length": "probabilistic",
}
#: every objective but ``hard`` needs the target's distribution p (its final hidden state and head rows), not
#: only the tokens it produced
DISTRIBUTION_LOSSES: tuple[str, ...] = tuple(k for k in LOSS_KINDS if k != "hard")


def objective_mode(loss: str, accept_mode: str | None) -> str | None:
    """The verify mode whose acceptance α the objective ``loss`` scores (None for ``soft`` and ``hard``):
    ``accept_mode`` where given, else the loss's default (:data:`ACCEPTANCE_LOSSES`).  ValueError, naming the
    field, for a combination that scores nothing or something else than asked."""
    if loss not in LOSS_KINDS:
        raise ValueError(f"loss {loss!r} unknown; expected one of {' | '.join(LOSS_KINDS)}")
    if accept_mode is not None and accept_mode not in VERIFY_MODES:
        raise ValueError(f"accept_mode {accept_mode!r} unknown; expected one of {' | '.join(VERIFY_MODES)}")
    if loss not in ACCEPTANCE_LOSSES:
        if accept_mode is not None:
            raise ValueError(
                f"accept_mode={accept_mode} is for the acceptance objectives "
                f"({' | '.join(ACCEPTANCE_LOSSES)}), not loss={loss}"
            )
        return None
    mode = accept_mode or ACCEPTANCE_LOSSES[loss]
    if loss == "tv" and mode != "probabilistic":
        raise ValueError(
            f"accept_mode={mode}: loss=tv is probabilistic verification's α = 1 − TV; use "
            f"loss=greedy_surrogate or loss=expected_length for {mode}"
        )
    if loss == "greedy_surrogate" and mode == "probabilistic":
        raise ValueError(
            "accept_mode=probabilistic: loss=greedy_surrogate smooths greedy verification (greedy | "
            "greedy_draft); probabilistic verification's α is loss=tv"
        )
    return mode


def check_loss(loss: str, accept_mode: str | None, soft_ce_weight: float, surrogate_tau: float) -> None:
    """The rule on a training objective's settings (the trainer's LossSettings and the recipe's ``train`` /
    ``sidecar`` sections both apply it).  ValueError whose message starts with the offending field's name."""
    objective_mode(loss, accept_mode)
    if not soft_ce_weight >= 0:
        raise ValueError(f"soft_ce_weight must be ≥ 0, got {soft_ce_weight}")
    if soft_ce_weight > 0 and loss not in ACCEPTANCE_LOSSES:
        raise ValueError(
            f"soft_ce_weight={soft_ce_weight} mixes soft CE into an acceptance objective "
            f"({' | '.join(ACCEPTANCE_LOSSES)}), not into loss={loss}"
        )
    if not surrogate_tau > 0:
        raise ValueError(f"surrogate_tau must be > 0, got {surrogate_tau}")


#: Draft head architectures (and so export formats): EAGLE-3 heads, a Llama decoder block as a multi-token-
#: prediction (MTP) head for a model that ships none (``llama_block_mtp``: heads/mtp.py; formerly ``mtp``) and a
#: model's own MTP layers (``native_mtp``: heads/native_mtp.py, loaded from the target checkpoint).
HeadKind = Literal["eagle3", "llama_block_mtp", "native_mtp"]
#: Recipe values that were renamed: (field, old value) → the new value (a one-line error names it).
RENAMED_VALUES: dict[tuple[str, str], str] = {("draft head", "mtp"): "llama_block_mtp"}
#: The head kinds a recipe's ``draft.head`` may name.
RECIPE_HEAD_KINDS: tuple[str, ...] = get_args(HeadKind)
#: The MTP tensor layouts draft_align imports and exports (docs/formats.md §3).
MTPLayout = Literal["deepseek_v3", "qwen3_next"]
#: Whose modules build a ``native_mtp`` head's layers: transformers' decoder layer (heads/native_mtp.py) or
#: megatron-core's ``MultiTokenPredictionLayer`` (heads/megatron_mtp.py); the same math, names and export.
MTPImpl = Literal["transformers", "megatron"]

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
    for name, value in (
        ("max_tokens_per_message", max_tokens_per_message),
        ("tokens_per_step", tokens_per_step),
    ):
        if int(value) < MIN_TAP_SEQUENCE_TOKENS:
            raise ValueError(f"{name} must be ≥ {MIN_TAP_SEQUENCE_TOKENS}, got {value}")


#: Sampling temperatures draft_align accepts anywhere (recipes, Taps, the wire): 0 (greedy) or a finite T in
#: [MIN_TEMPERATURE, MAX_TEMPERATURE].  Below the floor z/T overflows float32 for ordinary logits (inf − inf =
#: NaN in a softmax); above the ceiling every distribution is uniform to float precision, so each draft would
#: "match" the target and acceptance would read k + 1.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0


def temperature_ok(t: float) -> bool:
    """True iff ``t`` is 0 or in [MIN_TEMPERATURE, MAX_TEMPERATURE] (NaN and ±inf are not)."""
    return t == 0.0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE


def temperature_rule() -> str:
    """The rule of :func:`temperature_ok` in words, for error messages."""
    return f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"


#: The largest draft or policy version (and wire sequence number): the wire's ints are int64.  Every version
#: arithmetic (an RL restart's policy-version offset, the next published version) must stay at or below it.
MAX_VERSION = 2**63 - 1
