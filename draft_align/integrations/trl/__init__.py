"""draft_align beside Hugging Face TRL's ``GRPOTrainer`` (tested with trl 1.16; docs/trl.md)::

    from draft_align.integrations.trl import DraftAlign

    da = DraftAlign("recipes/trl_smollm2.yaml")
    trainer = GRPOTrainer(..., rollout_func=da.rollout_func)
    trainer.add_callback(da.callback(trainer))
    trainer.train()

The adapter is thin: it maps TRL's hooks onto draft_align's Tap, sidecar and draft source.

- ``session.py``: :class:`DraftAlign`, one draft_align run beside one trainer (sidecar, wire, drafts, Tap, engine);
- ``tap.py``: the Tap on TRL's own log-prob pass; ``callback.py``: the ``TrainerCallback`` that drives it;
- ``checks.py``: TRL configurations refused at start, one line each; ``profile.py``: the step's stage timer;
- ``reward_funcs.py``: draft_align's verifiable task reward and dataset as TRL reward function and rows;
- ``colocate.py``: TRL's colocated vLLM engine with an EAGLE-3 draft (GPU only, not yet run on one).
"""

from draft_align.integrations.trl.checks import TRLConfigError
from draft_align.integrations.trl.session import DraftAlign
from draft_align.integrations.trl.tap import TRLTap, TRLTapError, tapped_pass

__all__ = ["DraftAlign", "TRLConfigError", "TRLTap", "TRLTapError", "tapped_pass"]
