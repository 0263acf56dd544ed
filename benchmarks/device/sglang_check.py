"""Device check (GPU machine with ``pip install sglang==0.5.23`` done): export a tiny random EAGLE-3 draft
in the HF dialect, load it through SGLang's own ``LlamaForCausalLMEagle3.load_weights`` and assert that every
tensor we wrote lands in a parameter, nothing of SGLang's stays unwritten (bar the shared embedding),
``hot_token_id == d2t + arange`` and the aux ids in ``eagle_config`` are ours minus one.

    python benchmarks/device/sglang_check.py [--out /tmp/sglang_check]

Prints one JSON line and exits 1 on any problem.  Not run on this project's CPU machines (SGLang does not
import there: docs/engines.md, "Which client read which format").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.publish import export_draft
from draft_align.publish.sglang_client import sglang_available, sglang_load

AUX = (1, 2, 3)  # explicit ids: config.json carries eagle_config ids (0, 1, 2) for SGLang


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/sglang_check")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    why = sglang_available()
    if why:
        print(json.dumps({"ran": False, "why": why}))
        return 1
    tc = SimpleNamespace(
        num_hidden_layers=8,
        hidden_size=64,
        vocab_size=128,
        max_position_embeddings=256,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    cfg = Eagle3Config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        draft_vocab_size=32,
        target_hidden_size=64,
        aux_layer_ids=AUX,
        target_num_layers=8,
        max_position_embeddings=256,
    )
    d = Eagle3Draft(cfg)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    d.set_vocab(torch.arange(5, 101, 3))
    out = export_draft(
        d,
        Path(args.out) / "hf",
        target_config=tc,
        target_name="tiny",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="fp",
        overwrite=True,
    )
    rep = sglang_load(out, device=args.device)
    problems = [f"dropped {n}" for n in rep["dropped"]] + [f"unloaded {n}" for n in rep["unloaded"]]
    if not rep["hot_token_id_ok"]:
        problems.append("hot_token_id != d2t + arange")
    if rep["aux_ids_sglang"] != [k - 1 for k in AUX]:
        problems.append(f"eagle_config ids {rep['aux_ids_sglang']} != {[k - 1 for k in AUX]}")
    print(json.dumps({"ran": True, "problems": problems, **rep}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
