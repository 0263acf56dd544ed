"""The commands of a run: ``fetch`` (the embedded defaults), ``warmstart``, ``sidecar``, ``cotrain``, ``monitor``
and ``report``.  The process-level choices of each (threads, global seed, signal handlers) are made here."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from draft_align.cli.logs import route_library_logs, say_rank


def check_device(device: str) -> None:
    """RuntimeError (one line) for a CUDA device this machine does not have."""
    import torch

    if not str(device).startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise RuntimeError(f"device={device} but CUDA is not available on this machine (use device=cpu)")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise RuntimeError(f"device={device} but this machine has {torch.cuda.device_count()} CUDA device(s)")


def cmd_fetch(args: argparse.Namespace) -> int:
    from draft_align import assets

    names = ["smollm2-135m", "sharegpt"] if args.what == "all" else [args.what]
    for name in names:
        path = (
            assets.fetch_smollm2(args.force) if name == "smollm2-135m" else assets.fetch_sharegpt(args.force)
        )
        print(f"{name}: {path}")
    return 0


def cmd_warmstart(args: argparse.Namespace) -> int:
    import torch

    from draft_align.config import load_recipe
    from draft_align.monitor.evaluate import format_table
    from draft_align.warmstart import run

    recipe = load_recipe(args.recipe, args.overrides)
    check_device(recipe.device)
    route_library_logs(recipe.run_dir, "warmstart", args.verbose)
    if recipe.train.num_threads:
        torch.set_num_threads(recipe.train.num_threads)
    summary = run(recipe)
    m = summary["metrics"]
    print()
    print(f"draft: {summary['draft']}")
    print(
        f"trained {m['steps']} steps on {m['targets_seen']} target positions in {m['train_seconds']:.0f} s "
        f"({m['targets_per_s']:.0f} positions/s, {m['token_steps_per_s']:.0f} token-steps/s); "
        f"target mass outside the draft vocab {m['vocab_lost_mass']:.4f}, "
        f"out-of-vocab argmax rate {m['vocab_oov_argmax_rate']:.4f}"
    )
    if summary["eval"]:
        print(format_table(summary["eval"]))
    return 0


def _cotrain_recipe(args: argparse.Namespace):
    from draft_align.config import CotrainRecipe, load_recipe

    recipe = load_recipe(args.recipe, args.overrides, CotrainRecipe)
    check_device(recipe.device)
    return recipe


def cmd_sidecar(args: argparse.Namespace) -> int:
    """The sidecar process: its rank (torchrun), threads, global seed and signal handlers are set here."""
    import signal
    import threading

    import torch

    from draft_align.sidecar.launch import run_sidecar
    from draft_align.train.parallel import rank_info_from_env

    info = rank_info_from_env()
    if info.world_size > 1:
        say_rank(info.rank)
    recipe = _cotrain_recipe(args)
    route_library_logs(
        recipe.run_dir, "sidecar" if info.world_size == 1 else f"sidecar_rank{info.rank}", args.verbose
    )
    torch.set_num_threads(recipe.sidecar.num_threads)
    torch.manual_seed(recipe.seed)
    stop = threading.Event()  # SIGTERM / SIGINT: the loop ends, checkpoints and closes
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    state = run_sidecar(
        recipe, args.draft, exit_when_done=args.exit_when_done, max_seconds=args.max_seconds, stop=stop
    )
    if not info.is_lead:
        print(f"sidecar rank {info.rank} stopped: {state.train_steps} train steps (rank 0 publishes)")
        return 0
    print(f"sidecar stopped: {state.train_steps} train steps, {state.published_version} published versions")
    return 0


def cmd_cotrain(args: argparse.Namespace) -> int:
    from draft_align.cotrain import run_cotrain

    recipe = _cotrain_recipe(args)
    log_file = route_library_logs(recipe.run_dir, "cotrain", args.verbose)
    summary = run_cotrain(recipe, args.draft)
    md = Path(summary["report"]["markdown"])
    text = md.read_text(encoding="utf-8")
    print()
    print(text.split("## Steps")[0].strip())  # the summary; the per-step table was printed as it ran
    print(f"\nplot: {summary['report']['png']}\nsidecar exit code: {summary['sidecar_rc']}")
    print(f"log (library warnings included; -v shows them here): {log_file}")
    return 0 if summary["sidecar_rc"] == 0 else 1


def cmd_monitor(args: argparse.Namespace) -> int:
    from draft_align.monitor.live import follow

    try:
        if args.servers:
            return _monitor_servers(Path(args.run_dir), once=args.once, interval_s=args.interval)
        follow(Path(args.run_dir), once=args.once, interval_s=args.interval)
    except KeyboardInterrupt:
        pass
    return 0


def _monitor_servers(run_dir: Path, *, once: bool, interval_s: float) -> int:
    """``draft-align monitor --servers``: the push process's table of the fleet, again whenever it changes."""
    from draft_align.monitor.fleet_view import PUSH_DIR, format_servers, read_push_state

    shown = None
    while True:
        state = read_push_state(run_dir)
        if state is None and once:
            print(f"no push state in {run_dir / PUSH_DIR} (is `draft-align push` running for this run?)")
            return 1
        table = format_servers(state) if state is not None else None
        if table is not None and table != shown:
            print(time.strftime("%H:%M:%S"), f"run {run_dir}", flush=True)
            print(table, flush=True)
            shown = table
        if once:
            return 0
        time.sleep(interval_s)


def cmd_report(args: argparse.Namespace) -> int:
    from draft_align.monitor.advise_text import add_to_report
    from draft_align.monitor.report import write_report

    summary = write_report(Path(args.run_dir))
    add_to_report(args.run_dir)
    print(json.dumps(summary, indent=1, default=str))
    return 0
