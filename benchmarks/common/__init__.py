"""Helpers the benchmark scripts share (not scripts themselves):

- ``results_md``: replace one script's section of ``benchmarks/RESULTS.md``; repository-relative paths.
- ``arms``: same-tokens, same-wall-clock comparisons (options, shared data, one arm's draft).
- ``pooled``: measured acceptance pooled over RL steps.
- ``mtp_checkpoints``: tiny random-weight checkpoints of model families with MTP layers (also the tests').
"""
