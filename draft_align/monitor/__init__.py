"""Acceptance monitoring: the acceptance math, a lossless reference speculative decoder, an estimator
that predicts an engine's acceptance from teacher-forced unrolls, and an evaluation that compares them
(docs/acceptance.md)."""
