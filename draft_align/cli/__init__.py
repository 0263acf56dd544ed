"""``draft-align`` command line: the parser (``parser.py``), logging (``logs.py``, configured here and nowhere
else), the commands of a run (``runs.py``: fetch, warmstart, sidecar, cotrain, monitor, report), of a published
draft (``draft_commands.py``: eval, export), ``advise`` (``advise_command.py``), ``ray`` (``ray.py``: a sidecar on a Ray cluster) and ``push``
(``push.py``: a fleet of vLLM servers kept on the newest draft); :func:`main` runs one and turns the errors a
user can cause into one line and exit status 2.
"""

from __future__ import annotations

import logging

from draft_align.cli.logs import release_run_logs, setup_logging
from draft_align.cli.parser import build_parser

log = logging.getLogger("draft_align")

# what a user's input, files, disk, ports or environment can cause: one line ``error: ...`` (exit 2), the
# traceback only with -v; anything else is a bug and keeps its traceback
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (ValueError, RuntimeError, OSError, ImportError)


def _is_expected(e: BaseException) -> bool:
    # pyzmq's errors (a socket that cannot bind) are not imported here: pyzmq lives in wire/channel.py
    return isinstance(e, EXPECTED_ERRORS) or type(e).__module__.split(".")[0] == "zmq"


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    if getattr(args, "heldout_seed", None) == -1:
        args.heldout_seed = None
    try:
        return int(args.fn(args) or 0)
    except Exception as e:
        if not _is_expected(e):
            raise
        if args.verbose:
            log.exception("error: %s", _one_line(e))
        else:
            log.error("error: %s", _one_line(e))
        return 2
    finally:
        release_run_logs()


__all__ = ["EXPECTED_ERRORS", "build_parser", "main"]
