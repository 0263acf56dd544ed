"""Which vLLM-CPU MTP drafters serve a model family: a tiny random-weight checkpoint of the family (transformers'
config class, N = 2 trunk layers, one MTP layer saved under the released checkpoints' names), then
``vllm.LLM(..., speculative_config={"method": "mtp", "num_speculative_tokens": K})`` on it (the checkpoints:
``benchmarks/common/mtp_checkpoints.py``, shared with the tests), 16 greedy tokens for
two prompts, and vLLM's spec-decode counters.  One family per process (vLLM's state is process-wide)::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 nice -n 19 .venv/bin/python benchmarks/mtp_families.py FAMILY [K] [OUT_DIR]

FAMILY: mimo, glm4_moe, deepseek_v3, qwen3_next, qwen3_5, ernie, glm4_moe_lite.  It prints ``RESULT {json}``
(start seconds, output tokens, drafts, accepted) or the error vLLM raised; docs/mtp.md records the outcome
per family.
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ.update(
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    VLLM_CPU_KVCACHE_SPACE="1",
    VLLM_CPU_OMP_THREADS_BIND="nobind",
)
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.mtp_checkpoints import FAMILIES, mtp_names, save_checkpoint  # noqa: E402


def serve(out: Path, k: int):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(
        model=str(out),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
        disable_log_stats=False,
        seed=0,
    )
    t1 = time.time()
    sp = SamplingParams(temperature=0, max_tokens=16, detokenize=False, ignore_eos=True)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9]), TokensPrompt(prompt_token_ids=[11, 3, 40])], sp
    )
    toks = [list(o.outputs[0].token_ids) for o in outs]
    from draft_align.engines.vllm.counters import SpecCounters

    c = SpecCounters.snapshot(llm)
    print(
        "RESULT",
        json.dumps(
            dict(
                start_s=round(t1 - t0, 1),
                toks=toks,
                drafts=c.num_drafts,
                accepted=c.num_accepted_tokens,
                per_pos=c.accepted_per_pos,
            )
        ),
        flush=True,
    )


if __name__ == "__main__":
    import shutil
    import tempfile

    torch.set_num_threads(1)
    fam, k = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    root = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.mkdtemp(prefix="mtp-families-"))
    out = root / f"ckpt-{fam}"
    shutil.rmtree(out, ignore_errors=True)
    if fam not in FAMILIES:
        raise SystemExit(f"unknown family {fam!r}: expected one of {FAMILIES}")
    _, tensors = save_checkpoint(fam, out)
    print("MTP tensors", sorted(mtp_names(fam, tensors)), flush=True)
    serve(out, k)
