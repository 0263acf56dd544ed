"""Acceptance monitoring: reads what the other parts produce and never writes back (docs/acceptance.md).

The acceptance math it averages with is ``draft_align.acceptance``; the decoders it scores are the engines'
(``draft_align.engines.reference``, ``draft_align.engines.vllm``): nothing here decodes.

- ``step_profile.py``: :class:`StepProfile`, where an RL step's time goes (NeMo RL's stages), apart from its sinks;
- ``estimator.py``: acceptance predicted from teacher-forced unrolls, without decoding;
- ``tapped_estimate.py``: acceptance estimated on tapped records (no target forward);
- ``evaluate.py``: measured vs estimated acceptance of a draft: an engine's counters beside the estimate on its outputs;
- ``calibrate.py``: an engine's measured acceptance vs the estimate on its own outputs;
- ``logprob_gap.py``: an engine's log-probs of its samples minus the RL job's recomputed ones;
- ``rows.py``: the monitoring row of one RL step; ``sinks.py``: where rows go (JSONL, wandb, Prometheus);
- ``live.py``: following a run as a table; ``report.py``: the end-of-run plot and summary;
- ``fleet_view.py``: the fleet ``draft-align push`` keeps, as ``draft-align monitor --servers`` shows it;
- ``round_cost.py``: measured engine-step times; ``projection.py``: projected speed-up from them;
- ``advise.py``: ``draft-align advise``; ``advise_text.py``: its markdown and report section;
- ``cadence.py``: how often to train and publish, chosen from a run's measured cadence table.
"""
