"""draft_align beside Hugging Face TRL's ``GRPOTrainer`` (tested with trl 1.16; docs/trl.md)::

    from draft_align.integrations.trl import DraftAlign

    da = DraftAlign("recipes/trl_smollm2.yaml")
    trainer = GRPOTrainer(..., rollout_func=da.rollout_func)
    trainer.add_callback(da.callback(trainer))
    trainer.train()

The adapter is thin: it maps TRL's hooks onto draft_align's Tap, sidecar and draft source.
"""

from draft_align.integrations.trl.checks import TRLConfigError
from draft_align.integrations.trl.session import DraftAlign
from draft_align.integrations.trl.tap import TRLTap, TRLTapError, tapped_pass

__all__ = ["DraftAlign", "TRLConfigError", "TRLTap", "TRLTapError", "tapped_pass"]
