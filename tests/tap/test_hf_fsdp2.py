"""HFPolicyTap under FSDP2 (torch ``fully_shard``) with a fused LM head (``submit(logits=None)``): two CPU ranks
(gloo) whose micro-batches keep different numbers of sequences (rank 1's rows have no response) must issue the
same collectives — the head gather once per submit on every rank — and rank 0's statistics must equal those of
the unsharded model's own logits."""

from __future__ import annotations

import copy
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from draft_align.tap.hf import HFPolicyTap
from tests.helpers import ListSink

V = 50
AUX = (0, 2, 3)
WORLD = 2
MICRO_BATCHES = 3
ROWS = 3
TOKENS_PER_STEP = 40  # rank 0 offers 3 × (7 + 5 + 9) = 63 tokens: the budget keeps only some
GLOO_TIMEOUT_S = 60  # a mismatched collective fails the child after this long instead of hanging it
JOIN_S = 180  # two spawned interpreters importing torch and transformers, plus the gloo timeout


def _model() -> LlamaForCausalLM:
    """The same random Llama on every rank (seed 0), with an lm_head not tied to the embeddings."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        rms_norm_eps=3e-5,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaky next-token distributions: distinct top-k
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


def _micro_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Right-padded (input_ids, attention_mask, loss_mask) [ROWS, 9] per micro-batch; a response after a
    3-token prompt on rank 0, none on rank 1 (every row ``no_response``: that rank keeps nothing)."""
    g = torch.Generator().manual_seed(100 + rank)
    lengths = (7, 5, 9)
    out = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(1, V, (ROWS, max(lengths)), generator=g)
        am = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()
        ids = ids * am
        lm = (
            am.bool() & (torch.arange(max(lengths)) >= 3)
            if rank == 0
            else torch.zeros_like(am, dtype=torch.bool)
        )
        out.append((ids, am, lm))
    return out


def _run_tap(
    model, rank: int, fused: bool
) -> tuple[list[dict[str, torch.Tensor]], dict[str, int], int, dict[str, torch.Tensor]]:
    """The tap over this rank's micro-batches of one step: logits=None (fused) or the model's logits; and the
    HeadSync's norm weight and lm_head rows before it."""
    from torch.distributed.tensor import DTensor

    sink = ListSink()
    tap = HFPolicyTap(
        model, AUX, sink, run_id="r", tokens_per_step=TOKENS_PER_STEP, topk=3, rank=rank, seed=0
    )
    assert tap.head_sync(
        1, torch.arange(0, V, 2)
    )  # on every rank: under FSDP2 the head's gathers are collectives
    (head_msg,) = sink.messages
    head = {f: getattr(head_msg, f) for f in ("norm_weight", "rows")}
    assert not any(isinstance(t, DTensor) for t in head.values())  # plain host tensors, valid on the wire
    sink.messages.clear()
    with torch.no_grad(), tap.capturing():
        for ids, am, lm in _micro_batches(rank):
            out = model(input_ids=ids, attention_mask=am)
            if fused:
                # resharded after the forward: the tap's gather is a real all-gather
                assert isinstance(model.lm_head.weight, DTensor)
            tap.submit(
                input_ids=ids,
                attention_mask=am,
                loss_mask=lm,
                logits=None if fused else out.logits,
                policy_version=1,
                step=1,
                temperature=1.0,
            )
    accepted = tap.end_step()
    fields = (
        "cu_seqlens",
        "input_ids",
        "loss_mask",
        "next_logprob",
        "logit_lse",
        "topk_ids",
        "topk_logprobs",
        "final_hidden",
        "stats_from",
    )
    return [{f: getattr(m, f) for f in fields} for m in sink.messages], tap.stats(), accepted, head


def _worker(rank: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=GLOO_TIMEOUT_S),
    )
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _model()
        reference = copy.deepcopy(model)  # unsharded, run with its own logits
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fused = _run_tap(model, rank, fused=True)
        dist.barrier()  # both ranks got through every submit and end_step
        plain = _run_tap(reference, rank, fused=False)
        torch.save({"fused": fused, "plain": plain}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # ~55 s on 2 shared CPU cores (~26 s CPU): two spawned interpreters import torch and transformers
def test_fused_head_under_fsdp2_with_ranks_keeping_different_rows(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    assert not hung, f"ranks {hung} still running after {JOIN_S} s: mismatched collectives"
    # mismatched collectives: gloo aborts a rank on a size mismatch, or times out after GLOO_TIMEOUT_S
    assert [p.exitcode for p in procs] == [0] * WORLD, "a rank failed (see its traceback above)"

    got = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)}
    # rank 1 kept nothing: every row had no response
    msgs1, stats1, accepted1, _ = got[1]["fused"]
    assert msgs1 == [] and accepted1 == 0
    assert stats1["no_response"] == MICRO_BATCHES * ROWS and stats1["sequences_kept"] == 0
    # rank 0 kept some of its rows under the budget: the same ones, with the same statistics, as the plain run
    msgs0, stats0, accepted0, head0 = got[0]["fused"]
    want_msgs, want_stats, want_accepted, want_head = got[0]["plain"]
    for r in range(WORLD):  # the sharded model's HeadSync on every rank: the unsharded model's, whole
        for name, want in want_head.items():
            assert torch.equal(got[r]["fused"][3][name], want), (r, name)
    assert 2 <= stats0["sequences_kept"] < MICRO_BATCHES * ROWS
    assert stats0 == want_stats and accepted0 == want_accepted and 0 < accepted0 <= TOKENS_PER_STEP
    assert len(msgs0) == len(want_msgs) == 1
    fused_msg, plain_msg = msgs0[0], want_msgs[0]
    for name in ("cu_seqlens", "input_ids", "loss_mask", "topk_ids", "stats_from"):
        assert torch.equal(fused_msg[name], plain_msg[name]), name
    for name in ("next_logprob", "logit_lse", "topk_logprobs", "final_hidden"):
        torch.testing.assert_close(fused_msg[name].float(), plain_msg[name].float(), atol=1e-4, rtol=1e-4)
    assert bool((fused_msg["next_logprob"] < 0).any())  # real log-probs, not the zero buffers
