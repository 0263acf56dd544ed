"""Micro-benchmark: the HF Tap's per-token statistics at every position vs from the response on (``stats_from``).

    .venv/bin/python benchmarks/tap_stats.py [--rows 8] [--prompt 130] [--response 32] [--repeats 5]

Times ``HFPolicyTap.submit(logits=None)`` + ``end_step()`` (TRL's fused-head path: the statistics come from the
captured final state × lm_head, [L, H] × [V = 49152, H]) on SmolLM2-135M-Instruct in float32 with one torch
thread, for ``--rows`` TRL-style rows (a prompt of ``--prompt`` ± 8 tokens left-padded, a response of at most
``--response`` tokens right-padded).  The backbone forward that fills the capture runs before each timed call
and is not timed.  Two arms, interleaved, ``--repeats`` each, medians reported:

- ``all_positions``: the statistics of every position, as the Tap computed them before ``stats_from``
  (``draft_align.tap.hf.stats_start`` patched to 0: the whole row goes through the head);
- ``from_response``: the Tap as it is (statistics from the position before the first response token).

It checks that both arms give the same statistics where ``from_response`` defines them (bit for bit).  Run on a
checkout without ``stats_start`` (the code before the change) it times the one arm that code has.  Writes
``benchmarks/out/tap_stats.json`` (its table in RESULTS.md is written by hand).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draft_align.assets import fetch_smollm2  # noqa: E402
from draft_align.tap import hf as tap_hf  # noqa: E402
from draft_align.tap.hf import HFPolicyTap  # noqa: E402

STATS = ("next_logprob", "logit_lse", "topk_ids", "topk_logprobs")


class KeepSink:
    """Takes every message (the wire's validation already ran in ``end_step``)."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def offer(self, message: Any) -> bool:
        self.messages.append(message)
        return True


def trl_rows(rows: int, prompt: int, response: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    """input_ids, attention_mask, loss_mask [B, P + R]: left-padded prompts of prompt ± 8 tokens, right-padded
    responses of response − 7 .. response tokens (seeded random ids)."""
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(prompt - 8, prompt + 9, (rows,), generator=g).tolist()
    r_lens = torch.randint(response - 7, response + 1, (rows,), generator=g).tolist()
    pw, rw = max(p_lens), max(r_lens)
    ids = torch.zeros(rows, pw + rw, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, (p, r) in enumerate(zip(p_lens, r_lens, strict=True)):
        ids[b, pw - p : pw + r] = torch.randint(1, vocab, (p + r,), generator=g)
        am[b, pw - p : pw + r] = 1
    lm = am.bool() & (torch.arange(pw + rw) >= pw)
    return ids, am, lm


def timed_submit(
    model: torch.nn.Module, batch: tuple[torch.Tensor, ...], aux: tuple[int, ...]
) -> tuple[float, Any]:
    """Seconds of submit(logits=None) + end_step() after an untimed backbone forward; the TapBatch sent."""
    ids, am, lm = batch
    sink = KeepSink()
    tap = HFPolicyTap(model, aux, sink, run_id="bench", tokens_per_step=1 << 20, topk=1)
    with torch.no_grad(), tap.capturing():
        model.model(input_ids=ids, attention_mask=am)  # TRL's fused head: no logits
        t0 = time.perf_counter()
        tap.submit(
            input_ids=ids,
            attention_mask=am,
            loss_mask=lm,
            logits=None,
            policy_version=0,
            step=0,
            temperature=1.0,
        )
        tap.end_step()
        dt = time.perf_counter() - t0
    (msg,) = sink.messages
    return dt, msg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=130)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "tap_stats.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fetch_smollm2(), torch_dtype=torch.float32).eval()
    aux = (2, 15, 27)  # SmolLM2-135M has 30 layers: the EAGLE-3 default (2, L//2, L−3)
    batch = trl_rows(args.rows, args.prompt, args.response, model.config.vocab_size, seed=0)
    has_stats_from = hasattr(tap_hf, "stats_start")
    real_start = getattr(tap_hf, "stats_start", None)
    arms = ["all_positions", "from_response"] if has_stats_from else ["all_positions"]
    times: dict[str, list[float]] = {a: [] for a in arms}
    msgs: dict[str, Any] = {}
    timed_submit(model, batch, aux)  # warm-up (allocator, first-call overheads)
    for _ in range(args.repeats):
        for arm in arms:
            if has_stats_from:
                tap_hf.stats_start = real_start if arm == "from_response" else (lambda response: 0)
            dt, msg = timed_submit(model, batch, aux)
            times[arm].append(dt)
            msgs[arm] = msg
    if has_stats_from:
        tap_hf.stats_start = real_start
    tokens = int(batch[1].sum())
    result: dict[str, Any] = {
        "rows": args.rows,
        "tokens": tokens,
        "response_tokens": int(batch[2].sum()),
        "repeats": args.repeats,
        "threads": 1,
        "dtype": "float32",
        "model": "SmolLM2-135M-Instruct",
        "code": "with stats_from" if has_stats_from else "before stats_from",
        **{f"{a}_s": times[a] for a in arms},
        **{f"{a}_median_s": statistics.median(times[a]) for a in arms},
    }
    if has_stats_from:
        full, cut = msgs["all_positions"], msgs["from_response"]
        assert full.stats_from.tolist() == [0] * args.rows
        rows_with_stats = 0
        for i in range(cut.num_sequences):
            a, b = int(cut.cu_seqlens[i]), int(cut.cu_seqlens[i + 1])
            sf = cut.stats_start(i)
            rows_with_stats += b - a - sf
            for name in STATS:
                x, y = getattr(cut, name)[a + sf : b], getattr(full, name)[a + sf : b]
                assert torch.equal(x, y), (i, name)
        result["statistics_rows"] = {"all_positions": tokens, "from_response": rows_with_stats}
        result["identical_where_defined"] = True
        result["speedup"] = result["all_positions_median_s"] / result["from_response_median_s"]
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
