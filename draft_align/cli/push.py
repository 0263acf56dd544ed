"""``draft-align push``: the push process beside a fleet of vLLM servers (docs/servers.md)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from draft_align.cli.logs import route_library_logs

log = logging.getLogger(__name__)


def push_recipe(target: str, overrides: list[str]) -> Any:
    """The co-training recipe of ``target``: a recipe YAML, or a run folder (its resolved recipe)."""
    from draft_align.config import RESOLVED_RECIPE, CotrainRecipe, load_recipe

    path = Path(target)
    if path.is_dir():
        path = path / RESOLVED_RECIPE
        if not path.is_file():
            raise SystemExit(
                f"draft-align push: {target} is a folder without {RESOLVED_RECIPE}: give the recipe YAML"
            )
    return load_recipe(path, overrides, CotrainRecipe)


def _v(version: int | None, none: str) -> str:
    return f"v{version:04d}" if version is not None else none


def state_line(state: dict[str, Any], acceptance: bool = True) -> str:
    """One console line of the fleet: the newest version, then each server's version, lag and trouble."""
    newest = state["newest"]
    cells = [time.strftime("%H:%M:%S"), f"newest {_v(newest, '—')}"]
    for url, s in state["servers"].items():
        host = url.split("://", 1)[-1]
        if not s["up"]:
            cells.append(f"{host} DOWN ({s['last_error'][:60]})")
            continue
        cell = f"{host} {_v(s['serving'], 'start-up')}"
        if s["lag_s"] and acceptance:
            cell += f" lag {s['lag_s']:.1f}s"
        if s["refusals"]:
            cell += f" refused {','.join(sorted(s['refusals']))}"
        if s["sleeping"]:
            cell += " asleep"
        if acceptance and s["acceptance_since_push"] is not None:
            cell += f" L {s['acceptance_since_push']:.2f}"
        cells.append(cell)
    return " | ".join(cells)


def cmd_push(args: argparse.Namespace) -> int:
    from draft_align.push.loop import PUSH_DIR, build_push_loop
    from draft_align.rl.build import draft_notifications
    from draft_align.wire import channel

    recipe = push_recipe(args.recipe, args.overrides)
    cfg = recipe.push
    run_dir = recipe.run_dir
    route_library_logs(run_dir, "push", args.verbose)
    try:
        key = channel.resolve_key(recipe.wire.key_file, run_dir, create=False)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"draft-align push: no wire key for run {run_dir} ({e}); start the sidecar first"
        ) from None
    notify = None
    if not args.no_notifications:
        notify = draft_notifications(recipe.wire, run_dir, key)
    loop = build_push_loop(
        run_dir,
        cfg,
        key,
        key_file=recipe.wire.key_file,
        notifications=notify,
        servers=list(args.server or []),
        servers_file=args.servers_file,
        pause=args.pause,
    )
    if not loop.servers.urls() and loop.servers.file is None:
        raise SystemExit(
            "draft-align push: no server: give --server URL (repeatable), --servers-file or push.servers"
        )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(
        f"draft-align push: run {run_dir}, pause mode {loop.fleet.pause}; state in {run_dir / PUSH_DIR}",
        flush=True,
    )
    shown: list[str] = []

    def show(state: dict[str, Any]) -> None:  # one line whenever a server's version or health changes
        health = state_line(state, acceptance=False).split(" | ", 1)[-1]
        if not shown or health != shown[-1]:
            print(state_line(state), flush=True)
            shown[:] = [health]

    try:
        loop.run(stop, max_seconds=args.max_seconds, on_state=show)
    finally:
        loop.close()
        if notify is not None:
            notify.close()
    sys.stdout.flush()
    return 0
