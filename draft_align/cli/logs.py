"""Logging for the command line: configured here (by :func:`~draft_align.cli.main`) and nowhere else."""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path


def _log_format(rank: int | None = None) -> str:
    prefix = f"[rank {rank}] " if rank is not None else ""
    return f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"


# vLLM configures its own logger unless told not to (its own handler, at VLLM_LOGGING_LEVEL, on
# VLLM_LOGGING_STREAM, read once when vllm is imported): at INFO on stdout it prints hundreds of lines per engine
# start and weight reload into the step table.  Here it is told not to, so its records reach our handlers like
# any library's: at WARNING (INFO with -v), into the run's log file, on the console only with -v.  What the user
# set in the environment is kept (VLLM_CONFIGURE_LOGGING=1 gives vLLM its own handler again, on stderr).
VLLM_QUIET_LEVEL = "WARNING"
VLLM_LOG_STREAM = "ext://sys.stderr"
OUR_LOGGERS = ("draft_align", "bench", "__main__")  # what the console shows without -v (plus any ERROR)
RUN_LOG = "logs"  # <run_dir>/logs/<command>.log


# draft_align loggers whose INFO lines are per-step or per-draft-refresh progress: the console shows their
# warnings only (the live table has a row per RL step and its drf.v column says which draft serves); the run's
# log file keeps every line
WARNINGS_ONLY_ON_CONSOLE = (
    "draft_align.rl.drafts",
    "draft_align.rl.grpo",
    "draft_align.engines.vllm.refresher",
    "draft_align.engines.vllm.vllm_rollouts",
)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == n or name.startswith(n + ".") for n in prefixes)


def ours(record: logging.LogRecord) -> bool:
    """A record the console shows without -v: draft_align's own lines (warnings only from the per-refresh
    loggers), and any library's errors."""
    name = record.name
    if record.levelno < logging.WARNING and _under(name, WARNINGS_ONLY_ON_CONSOLE):
        return False
    return record.levelno >= logging.ERROR or _under(name, OUR_LOGGERS)


class RunLogHandler(logging.Handler):
    """Appends each record to ``path``, opening it per record: a run folder moved aside while the handler is
    attached (``cotrain`` does, for a previous run) keeps what it had, and the new folder gets a new file."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.DEBUG)
        self.path = path
        self.setFormatter(logging.Formatter(_log_format(), datefmt="%Y-%m-%d %H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format=_log_format(), datefmt="%H:%M:%S"
    )
    for noisy in ("httpx", "urllib3", "filelock", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.captureWarnings(
        True
    )  # warnings.warn → the "py.warnings" logger: a library's, so quiet without -v
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # before anything imports vllm
    os.environ.setdefault("VLLM_LOGGING_STREAM", VLLM_LOG_STREAM)
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", VLLM_QUIET_LEVEL)
        # torch's C++ warnings (e.g. vLLM-CPU's NUMA binding notice) are written to file descriptor 2, not
        # logged: without -v only its errors are shown (read when torch is first imported, which is later)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        # wandb's banner and offline run summary are printed, not logged (the run's wandb folder keeps them)
        os.environ.setdefault("WANDB_SILENT", "true")
    logging.getLogger("vllm").setLevel(logging.INFO if verbose else logging.WARNING)


def route_library_logs(run_dir: Path, command: str, verbose: bool) -> Path:
    """Once a run's folder is known: every record also goes to ``<run_dir>/logs/<command>.log``, and without -v
    the console keeps only draft_align's lines (and errors); library warnings, vLLM's among them, are in the
    file.  transformers and datasets print through handlers of their own: they are routed here as well, and
    without -v transformers' progress bars (its "Loading weights" bar) are off.  Returns the log file's path.  (Lines C/C++ code writes to file descriptor 2 are not records: torch's C++
    warnings are off without -v (:func:`setup_logging`), anything else written there still reaches the
    console.)"""
    path = Path(run_dir) / RUN_LOG / f"{command}.log"
    root = logging.getLogger()
    if not any(isinstance(h, RunLogHandler) and h.path == path for h in root.handlers):
        root.addHandler(RunLogHandler(path))
    if not verbose:
        for h in root.handlers:
            if not isinstance(h, RunLogHandler) and ours not in h.filters:
                h.addFilter(ours)
    for lib in ("transformers", "datasets"):
        try:
            mod = importlib.import_module(f"{lib}.utils.logging")
        except ImportError:
            continue
        mod.get_logger()  # a library sets up its own handler on first use: let it, then take it away
        lib_logger = logging.getLogger(lib)
        for h in list(lib_logger.handlers):
            if type(h) is logging.StreamHandler:
                lib_logger.removeHandler(h)
        lib_logger.propagate = True
        if lib == "transformers" and not verbose:
            # its tqdm bars ("Loading weights" in from_pretrained) are not records: off without -v
            mod.disable_progress_bar()
            _bars_off.add(lib)
    return path


_bars_off: set[str] = (
    set()
)  # libraries whose progress bars route_library_logs turned off (release turns them on)


def say_rank(rank: int) -> None:
    """Under torchrun every rank writes to the same console: say which one speaks."""
    for h in logging.getLogger().handlers:
        h.setFormatter(logging.Formatter(_log_format(rank), datefmt="%H:%M:%S"))


def release_run_logs() -> None:
    """Undo :func:`route_library_logs` and the warnings capture (the end of one command in this process)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, RunLogHandler):
            root.removeHandler(h)
        else:
            h.removeFilter(ours)
    logging.captureWarnings(False)
    for lib in sorted(_bars_off):
        importlib.import_module(f"{lib}.utils.logging").enable_progress_bar()
    _bars_off.clear()
