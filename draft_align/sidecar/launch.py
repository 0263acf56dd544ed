"""Starting a sidecar: the draft it starts from, the torchrun world it joins, and the process entry point.

``draft-align sidecar RECIPE`` (``cli/runs.py``) sets the process up (threads, global seed, signal handlers that
set a stop event) and calls :func:`run_sidecar`; tests and other programs build a
:class:`~draft_align.sidecar.loop.Sidecar` themselves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draft_align.config import CotrainRecipe, WarmstartRecipe, load_recipe, recipe_to_dict
from draft_align.publish.folder import ExportError
from draft_align.publish.versions import resolve_draft_dir
from draft_align.sidecar.layout import SIDECAR_DIR, TRAINER_DIR, lock_name
from draft_align.sidecar.lock import RunLock
from draft_align.sidecar.loop import Sidecar
from draft_align.sidecar.state import SidecarState
from draft_align.train.checkpoint import checkpoint_exists
from draft_align.train.parallel import join_ranks, rank_info_from_env

log = logging.getLogger(__name__)


class SidecarError(RuntimeError):
    """The sidecar cannot start (no starting draft, …)."""


def starting_draft(
    recipe: CotrainRecipe,
    path: str | None = None,
    *,
    warm_start: Callable[[WarmstartRecipe], object] | None = None,
) -> Path:
    """The folder of the draft co-training starts from: ``path``, ``recipe.draft`` (a draft folder or a run
    folder with ``latest``), else the warm-start recipe's published draft.  When neither is named and the
    warm-start has published nothing yet, a launcher's ``warm_start`` (``warmstart.run_in_process``) runs the
    warm-start recipe first; without one, or when a named draft is missing, a :class:`SidecarError` says what to
    run."""
    given = path or recipe.draft
    ws: WarmstartRecipe | None = None
    if given is None:
        ws = load_recipe(recipe.warmstart_recipe)
        given = str(ws.run_dir)
    try:
        return resolve_draft_dir(Path(given))
    except ExportError as e:
        if ws is None or warm_start is None:
            raise SidecarError(
                f"no starting draft at {given} ({e}): run the warm-start first (draft-align warmstart "
                f"{recipe.warmstart_recipe}) or set `draft:` to a published draft folder"
            ) from e
    log.info("no warm-started draft yet: running %s", recipe.warmstart_recipe)
    warm_start(ws)
    return starting_draft(recipe)


def world_config(recipe: CotrainRecipe, start_draft: Path, local: tuple[str, ...] = ()) -> dict[str, Any]:
    """What every rank must agree on, flattened to dotted keys: the resolved recipe and the starting draft;
    ``local``: dotted keys each rank sets for itself, left out."""
    flat: dict[str, Any] = {"start_draft": str(Path(start_draft).resolve())}

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = x

    walk("", recipe_to_dict(recipe))
    return {k: v for k, v in flat.items() if k not in local}


def run_sidecar(
    recipe: CotrainRecipe,
    start: str | None = None,
    *,
    exit_when_done: bool = False,
    max_seconds: float | None = None,
    stop: threading.Event | None = None,
    on_ready: Callable[[Sidecar], None] | None = None,
    rank_local: tuple[str, ...] = (),
) -> SidecarState:
    """One sidecar process: find the starting draft, join the other ranks under torchrun, set up and run.

    ``stop``: set it (e.g. from a signal handler) to end the loop; it then checkpoints and closes.
    ``on_ready``: called with the set-up sidecar (its sockets bound) before its loop starts (a host that
    reports the bound endpoints, e.g. ``integrations/ray``).  ``rank_local``: recipe keys each rank sets for
    itself (e.g. ``wire.endpoint`` on its own node), not compared between ranks."""
    start_dir = starting_draft(recipe, start)
    sc = recipe.sidecar
    # the run's lock before rank 0 touches the checkpoint below (a live sidecar may be saving it)
    info = rank_info_from_env()
    sidecar_dir = recipe.run_dir / SIDECAR_DIR
    sidecar_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock.acquire(sidecar_dir / lock_name(info.rank if info.world_size > 1 else None))
    try:
        # None unless torchrun started several ranks; rank 0 first restores a checkpoint a killed save left aside
        with join_ranks(
            ranks=sc.ranks,
            device=recipe.device,
            timeout_s=sc.collective_timeout_s,
            config=world_config(recipe, start_dir, rank_local),
            lead_first=lambda: checkpoint_exists(sidecar_dir / TRAINER_DIR),
        ) as ranks:
            sidecar = Sidecar(
                recipe, start_dir, exit_when_done=exit_when_done, ranks=ranks, stop=stop, lock=lock
            ).setup()
            if on_ready is not None:
                try:
                    on_ready(sidecar)
                except BaseException:
                    sidecar.close()
                    raise
            return sidecar.run(max_seconds=max_seconds)
    finally:
        lock.release()
