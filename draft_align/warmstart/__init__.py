"""Offline warm-start of a draft from chat data: :mod:`.preparation` (data, self-distillation, capture) and
:mod:`.pipeline` (build, train, publish, evaluate); ``run(recipe)`` is the whole warm-start (``run_in_process``: with
the recipe's thread count, for a launcher that needs the draft first)."""

from draft_align.warmstart.pipeline import (
    build_draft,
    evaluate_draft,
    load_init_draft,
    run,
    run_in_process,
    train,
    vocab_report,
)
from draft_align.warmstart.preparation import Prepared, WarmstartError, capture, heldout_prompts, prepare

__all__ = [
    "Prepared",
    "WarmstartError",
    "build_draft",
    "capture",
    "evaluate_draft",
    "heldout_prompts",
    "load_init_draft",
    "prepare",
    "run",
    "run_in_process",
    "train",
    "vocab_report",
]
