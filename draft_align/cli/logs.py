"""Logging for the command line: configured here (by :func:`~draft_align.cli.main`) and nowhere else."""

from __future__ import annotations

import logging
import os


def _log_format(rank: int | None = None) -> str:
    prefix = f"[rank {rank}] " if rank is not None else ""
    return f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"


# vLLM configures its own logger (its own handler, at VLLM_LOGGING_LEVEL, on VLLM_LOGGING_STREAM, both read
# once when vllm is imported): at INFO on stdout it prints hundreds of lines per engine start and weight reload
# into the step table.  Its lines go to stderr with ours (stdout keeps the table and results), and without -v
# only its warnings and errors are shown.  What the user set in the environment is kept.
VLLM_QUIET_LEVEL = "WARNING"
VLLM_LOG_STREAM = "ext://sys.stderr"


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format=_log_format(), datefmt="%H:%M:%S"
    )
    for noisy in ("httpx", "urllib3", "filelock", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("VLLM_LOGGING_STREAM", VLLM_LOG_STREAM)  # before anything imports vllm
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", VLLM_QUIET_LEVEL)
        logging.getLogger("vllm").setLevel(logging.WARNING)  # what it logs before configuring its logger


def say_rank(rank: int) -> None:
    """Under torchrun every rank writes to the same console: say which one speaks."""
    for h in logging.getLogger().handlers:
        h.setFormatter(logging.Formatter(_log_format(rank), datefmt="%H:%M:%S"))
