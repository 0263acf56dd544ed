"""HFPolicyTap: what it taps from an HF causal LM, how it samples under the budget, ships and syncs the head."""

import itertools
import math
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draft_align.hf.capture import TapError
from draft_align.tap.budget import generator_for
from draft_align.tap.hf import HFPolicyTap
from draft_align.tap.protocol import PolicyTapError
from tests.helpers import ListSink

V = 50
AUX = (0, 2, 3)  # embedding output, layer-1 and layer-2 outputs of a 4-layer target


def _config(layers: int = 4, hidden: int = 32) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        rms_norm_eps=3e-5,
        tie_word_embeddings=False,
    )


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaky next-token distributions: distinct top-k
        model.model.norm.weight.uniform_(0.5, 1.5)  # a norm weight that is not all ones
    return model


def make_batch(seqs: list[list[int]], prompt_lens: list[int], pad: int = 0):
    """Right-padded [B, T] input_ids, attention_mask (long), loss_mask (bool: positions ≥ prompt length)."""
    b, t = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((b, t), pad, dtype=torch.long)
    am = torch.zeros(b, t, dtype=torch.long)
    lm = torch.zeros(b, t, dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        am[i, : len(s)] = 1
        lm[i, p : len(s)] = True
    return ids, am, lm


def tap_forward(
    tap, model, seqs, prompt_lens, *, forward=None, step=0, policy_version=0, temperature=1.0, grad=False
):
    ids, am, lm = make_batch(seqs, prompt_lens)
    with torch.set_grad_enabled(grad), tap.capturing():
        out = (forward or model)(input_ids=ids, attention_mask=am)
        tap.submit(
            input_ids=ids,
            attention_mask=am,
            loss_mask=lm,
            logits=out.logits,
            policy_version=policy_version,
            step=step,
            temperature=temperature,
        )
    return out


def unpack(msg) -> list[dict]:
    """Per-sequence slices of a TapBatch."""
    cu = msg.cu_seqlens.tolist()
    out = []
    for a, b in itertools.pairwise(cu):
        d = {"input_ids": msg.input_ids[a:b], "loss_mask": msg.loss_mask[a:b], "aux": msg.aux_hidden[a:b]}
        for name in ("final_hidden", "next_logprob", "logit_lse", "topk_ids", "topk_logprobs"):
            t = getattr(msg, name)
            d[name] = None if t is None else t[a:b]
        out.append(d)
    return out


def random_seqs(n: int, lengths, seed: int) -> list[list[int]]:
    """Distinct sequences (first token = 1 + index, so a sequence is identified by its first token)."""
    rng = random.Random(seed)
    return [
        [1 + i] + [rng.randrange(1, V) for _ in range(length - 1)]
        for i, length in zip(range(n), lengths, strict=True)
    ]


# -- what is tapped -------------------------------------------------------------------------------------


@pytest.mark.parametrize("topk", [1, 3])
def test_kept_sequences_equal_single_sequence_forward(tiny_lm, topk):
    sink = ListSink()
    tap = HFPolicyTap(tiny_lm, AUX, sink, run_id="r", tokens_per_step=1000, topk=topk, rank=2)
    seqs = random_seqs(3, [7, 4, 10], seed=1)
    prompts = [3, 2, 4]
    tap_forward(tap, tiny_lm, seqs, prompts, step=5, policy_version=3, temperature=0.7)
    assert tap.end_step() == 21
    assert len(sink.messages) == 1
    msg = sink.messages[0]
    assert (msg.run_id, msg.policy_version, msg.source_rank, msg.batch_id, msg.step) == ("r", 3, 2, 0, 5)
    assert (
        tuple(msg.aux_layer_ids) == AUX and msg.final_norm == "post" and msg.temperature == pytest.approx(0.7)
    )
    assert (msg.hidden_size, msg.vocab_size) == (32, V)
    assert msg.cu_seqlens.tolist() == [0, 7, 11, 21]
    assert msg.aux_hidden.dtype == torch.bfloat16 and msg.final_hidden.dtype == torch.bfloat16
    assert msg.input_ids.dtype == torch.int64 and msg.loss_mask.dtype == torch.bool
    assert msg.next_logprob.dtype == torch.float32 and msg.topk_logprobs.dtype == torch.float32
    # statistics from the position predicting the first response token on, 0 before it
    assert msg.stats_from.dtype == torch.int32 and msg.stats_from.tolist() == [p - 1 for p in prompts]
    for s, p, got in zip(seqs, prompts, unpack(msg), strict=True):
        x = torch.tensor([s])
        with torch.no_grad():
            ref = tiny_lm(x, output_hidden_states=True)  # the sequence alone, no padding
        assert got["input_ids"].tolist() == s
        assert got["loss_mask"].tolist() == [t >= p for t in range(len(s))]
        aux = torch.cat([ref.hidden_states[i][0] for i in AUX], dim=-1)
        torch.testing.assert_close(got["aux"].float(), aux, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(
            got["final_hidden"].float(), ref.hidden_states[-1][0], atol=2e-2, rtol=1e-2
        )
        lg = ref.logits[0].double()
        lp = torch.log_softmax(lg, dim=-1)
        nxt = torch.zeros(len(s), dtype=torch.float64)
        nxt[:-1] = lp[torch.arange(len(s) - 1), x[0, 1:]]
        sf = p - 1
        for name in ("next_logprob", "logit_lse", "topk_ids", "topk_logprobs"):
            assert not got[name][:sf].any(), name
        torch.testing.assert_close(got["next_logprob"][sf:].double(), nxt[sf:], atol=1e-4, rtol=0)
        assert got["next_logprob"][-1].item() == 0.0
        torch.testing.assert_close(
            got["logit_lse"][sf:].double(), torch.logsumexp(lg, -1)[sf:], atol=1e-4, rtol=0
        )
        top_lp, top_ids = lp.topk(topk, dim=-1)
        assert torch.equal(got["topk_ids"][sf:], top_ids[sf:])
        torch.testing.assert_close(got["topk_logprobs"][sf:].double(), top_lp[sf:], atol=1e-4, rtol=0)
    st = tap.stats()
    assert st["tokens_seen"] == st["tokens_kept"] == st["tokens_offered"] == 21
    assert (st["sequences_seen"], st["messages_offered"], st["messages_dropped"]) == (3, 1, 0)


@pytest.mark.parametrize("send_final", [True, False])
def test_fused_head_and_left_padding_give_the_same_batch(tiny_lm, send_final):
    """logits=None (a fused LM head): statistics from the captured final state × lm_head; rows a left-padded
    prompt then a right-padded response (one block each): the same TapBatch as right-padded rows with logits."""
    seqs = random_seqs(3, [7, 4, 10], seed=4)
    prompts = [3, 2, 4]
    right, left = ListSink(), ListSink()
    kw = dict(run_id="r", tokens_per_step=1000, topk=3, send_final=send_final)
    ref_tap = HFPolicyTap(tiny_lm, AUX, right, **kw)
    tap_forward(ref_tap, tiny_lm, seqs, prompts)
    ref_tap.end_step()
    tap = HFPolicyTap(tiny_lm, AUX, left, **kw)
    pw = max(prompts)
    cw = max(len(s) - p for s, p in zip(seqs, prompts, strict=True))
    ids = torch.zeros(3, pw + cw, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
        ids[i, pw - p : pw - p + len(s)] = torch.tensor(s)
        am[i, pw - p : pw - p + len(s)] = 1
    lm = am.bool() & (torch.arange(pw + cw) >= pw)
    with torch.no_grad(), tap.capturing():
        tiny_lm.model(input_ids=ids, attention_mask=am)  # the backbone only: no logits exist
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
    for want, got in zip(unpack(right.messages[0]), unpack(left.messages[0]), strict=True):
        assert torch.equal(want["input_ids"], got["input_ids"]) and torch.equal(
            want["loss_mask"], got["loss_mask"]
        )
        assert torch.equal(want["topk_ids"], got["topk_ids"])
        for name in ("aux", "final_hidden", "next_logprob", "logit_lse", "topk_logprobs"):
            if want[name] is None:
                assert got[name] is None
                continue
            torch.testing.assert_close(got[name].float(), want[name].float(), atol=2e-2, rtol=1e-2)
    with pytest.raises(PolicyTapError, match="do not multiply"):
        from draft_align.tap.logit_stats import head_logit_stats

        head_logit_stats(torch.zeros(3, 32), torch.zeros(0), None, torch.zeros(3, dtype=torch.long), 1)


def _left_padded(seqs, prompts):
    """TRL-style rows: each prompt left-padded to the longest, then its response right-padded."""
    pw = max(prompts)
    cw = max(len(s) - p for s, p in zip(seqs, prompts, strict=True))
    ids = torch.zeros(len(seqs), pw + cw, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
        ids[i, pw - p : pw - p + len(s)] = torch.tensor(s)
        am[i, pw - p : pw - p + len(s)] = 1
    return ids, am, am.bool() & (torch.arange(pw + cw) >= pw)


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("fused", [False, True])
def test_statistics_from_the_response_equal_the_full_statistics(tiny_lm, padding, fused):
    """Statistics only from the position before the first response token (``stats_from``): there and after
    equal to the statistics of every position (``logit_stats`` / ``head_logit_stats`` of the whole
    sequence, as the Tap computed them before; bit for bit from logits, within 1 ulp from the head), 0 before."""
    from draft_align.tap.logit_stats import head_logit_stats, logit_stats

    seqs = random_seqs(4, [9, 5, 12, 7], seed=21)
    prompts = [6, 1, 4, 5]  # prompt 1: stats_from 0 (nothing to skip)
    sink = ListSink()
    tap = HFPolicyTap(tiny_lm, AUX, sink, run_id="r", tokens_per_step=1000, topk=3)
    ids, am, lm = make_batch(seqs, prompts) if padding == "right" else _left_padded(seqs, prompts)
    with torch.no_grad(), tap.capturing():
        if fused:
            final = tiny_lm.model(input_ids=ids, attention_mask=am).last_hidden_state  # no logits exist
            logits = None
        else:
            logits = tiny_lm(input_ids=ids, attention_mask=am).logits
        tap.submit(
            input_ids=ids,
            attention_mask=am,
            loss_mask=lm,
            logits=logits,
            policy_version=0,
            step=0,
            temperature=1.0,
        )
    tap.end_step()
    (msg,) = sink.messages
    assert msg.stats_from.tolist() == [max(p - 1, 0) for p in prompts]
    w, bias = tiny_lm.lm_head.weight.detach(), None
    for b, (got, p) in enumerate(zip(unpack(msg), prompts, strict=True)):
        valid = am[b].bool()
        if fused:
            full = head_logit_stats(final[b][valid], w, bias, ids[b][valid], 3)
        else:
            full = logit_stats(logits[b][valid], ids[b][valid], 3)
        sf = max(p - 1, 0)
        for name, want in zip(("next_logprob", "logit_lse", "topk_ids", "topk_logprobs"), full, strict=True):
            if fused and name != "topk_ids":
                # fewer rows through the [L, H] × [V, H]ᵀ matmul: the same sums, blocked differently (≤ 1 ulp)
                torch.testing.assert_close(got[name][sf:], want[sf:], atol=2e-6, rtol=0, msg=f"{b} {name}")
            else:
                assert torch.equal(got[name][sf:], want[sf:].to(got[name].dtype)), (b, name)
            assert not got[name][:sf].any(), (b, name)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_job_logprobs_give_the_head_statistics(tiny_lm, padding):
    """next_logprob (the job's own next-token log-probs, as TRL's fused head returns them) with topk=0: the same
    next_logprob and logit_lse as the head pass over the same sequences, no top-k, 0 before stats_from; the
    positions the sequence's statistics never read (before stats_from, after its last token) may hold
    anything."""
    seqs = random_seqs(4, [9, 5, 12, 7], seed=22)
    prompts = [6, 1, 4, 5]
    ids, am, lm = make_batch(seqs, prompts) if padding == "right" else _left_padded(seqs, prompts)
    with torch.no_grad():
        logits = tiny_lm(input_ids=ids, attention_mask=am).logits
    job = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].float()
    job = torch.nn.functional.pad(job, (0, 1))
    job[~lm.roll(-1, 1)] = float("nan")  # only positions scoring a response token are read
    got_sink, want_sink = ListSink(), ListSink()
    for sink, nxt in ((got_sink, job), (want_sink, None)):
        tap = HFPolicyTap(tiny_lm, AUX, sink, run_id="r", tokens_per_step=1000, topk=0)
        with torch.no_grad(), tap.capturing():
            tiny_lm.model(input_ids=ids, attention_mask=am)  # a fused head: no logits
            tap.submit(
                input_ids=ids,
                attention_mask=am,
                loss_mask=lm,
                logits=None,
                policy_version=0,
                step=0,
                temperature=1.0,
                next_logprob=nxt,
            )
        tap.end_step()
    (got,), (want,) = got_sink.messages, want_sink.messages
    assert got.topk_ids is None and got.stats_from.tolist() == want.stats_from.tolist()
    for g, w in zip(unpack(got), unpack(want), strict=True):
        assert torch.equal(g["input_ids"], w["input_ids"])
        for name in ("next_logprob", "logit_lse"):
            torch.testing.assert_close(g[name], w[name], atol=1e-5, rtol=1e-5)
        assert g["next_logprob"][-1] == 0


def test_job_logprobs_errors(tiny_lm):
    ids, am, lm = make_batch(random_seqs(2, [5, 3], seed=8), [1, 1])
    for topk, logits, nxt, match in (
        (1, None, torch.zeros(2, 5), "topk=0"),
        (0, torch.zeros(2, 5, V), torch.zeros(2, 5), "logits=None"),
        (0, None, torch.zeros(2, 4), r"next_logprob must be \[B, T\]"),
    ):
        tap = HFPolicyTap(tiny_lm, AUX, ListSink(), run_id="r", tokens_per_step=100, topk=topk)
        with torch.no_grad(), tap.capturing(), pytest.raises(PolicyTapError, match=match):
            tiny_lm.model(input_ids=ids, attention_mask=am)
            tap.submit(
                input_ids=ids,
                attention_mask=am,
                loss_mask=lm,
                logits=logits,
                policy_version=0,
                step=0,
                temperature=1.0,
                next_logprob=nxt,
            )
        assert tap.stats()["sequences_seen"] == 0


def test_no_final_no_topk(tiny_lm):
    sink = ListSink()
    tap = HFPolicyTap(tiny_lm, (1, 4), sink, run_id="r", tokens_per_step=100, send_final=False, topk=0)
    seqs = random_seqs(2, [5, 6], seed=2)
    out = tap_forward(tap, tiny_lm, seqs, [1, 1])
    tap.end_step()
    msg = sink.messages[0]
    assert msg.final_hidden is None and msg.final_norm is None
    assert msg.topk_ids is None and msg.topk_logprobs is None
    # hidden_states index 4 of a 4-layer target is the final post-norm state
    with torch.no_grad():
        ref = tiny_lm(torch.tensor([seqs[0]]), output_hidden_states=True)
    torch.testing.assert_close(
        unpack(msg)[0]["aux"][:, 32:].float(), ref.hidden_states[4][0], atol=2e-2, rtol=1e-2
    )
    assert out.logits.shape == (2, 6, V)


def test_peft_lora_model(tiny_lm):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    base = LlamaForCausalLM(_config()).eval()
    base.load_state_dict(tiny_lm.state_dict())
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )  # random B: the adapter changes the outputs
    pm = peft.get_peft_model(base, cfg).eval()
    inner = pm.base_model.model
    sink = ListSink()
    tap = HFPolicyTap(inner, AUX, sink, run_id="lora", tokens_per_step=100, topk=2)
    seqs = random_seqs(2, [6, 8], seed=4)
    out = tap_forward(tap, inner, seqs, [2, 3], forward=pm, grad=True)  # a training pass: autograd intact
    out.logits.logsumexp(-1).mean().backward()
    lora_grads = [p.grad for n, p in pm.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)
    pm.zero_grad(set_to_none=True)
    assert tap.end_step() == 14
    assert not sink.messages[0].aux_hidden.requires_grad
    got = unpack(sink.messages[0])[1]
    x = torch.tensor([seqs[1]])
    with torch.no_grad():
        ref = pm(input_ids=x, output_hidden_states=True)
        with pm.disable_adapter():
            plain = pm(input_ids=x, output_hidden_states=True)
    aux = torch.cat([ref.hidden_states[i][0] for i in AUX], dim=-1)
    plain_aux = torch.cat([plain.hidden_states[i][0] for i in AUX], dim=-1)
    assert (aux - plain_aux).abs().max() > 0.1  # the LoRA path is live
    torch.testing.assert_close(got["aux"].float(), aux, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got["final_hidden"].float(), ref.hidden_states[-1][0], atol=2e-2, rtol=1e-2)
    sf = sink.messages[0].stats_start(1)  # prompt 3: statistics from position 2 on
    assert sf == 2
    torch.testing.assert_close(
        got["logit_lse"][sf:], torch.logsumexp(ref.logits[0], -1)[sf:], atol=1e-4, rtol=0
    )
    assert tap.head_sync(1, torch.tensor([4, 0, 9]))
    torch.testing.assert_close(sink.messages[-1].rows, tiny_lm.lm_head.weight[[4, 0, 9]].to(torch.bfloat16))


# -- sampling under the budget ----------------------------------------------------------------------------


def test_tap_selection_follows_the_seeded_keys(tiny_lm, prefix_keep):
    """The tap keeps exactly the prefix rule's choice for the keys its (seed, rank) generator draws, across
    micro-batches, and splits the step into messages of ≤ max_tokens_per_message tokens."""
    sink = ListSink()
    budget = 24
    tap = HFPolicyTap(
        tiny_lm, AUX, sink, run_id="r", tokens_per_step=budget, max_tokens_per_message=9, seed=7, rank=1
    )
    lengths = [5, 3, 9, 4, 6, 2, 7, 3, 5, 4, 10, 3]  # 10 tokens: over the message limit, never kept
    seqs = random_seqs(12, lengths, seed=3)
    gen = generator_for(7, 1)
    keys: list[float] = []
    for i in range(0, 12, 4):
        tap_forward(tap, tiny_lm, seqs[i : i + 4], [1] * 4, step=1)
        keys += torch.rand(4, generator=gen, dtype=torch.float64).tolist()
        # only the currently kept sequences hold copies; evicted ones were released
        assert len(tap._sample.pending) == len(prefix_keep(lengths[: i + 4], keys, budget, max_len=9))
    expect = prefix_keep(lengths, keys, budget, max_len=9)
    offered = tap.end_step()
    got = [s for m in sink.messages for s in unpack(m)]
    assert {s["input_ids"][0].item() - 1 for s in got} == expect
    assert offered == sum(lengths[i] for i in expect) <= budget
    assert all(int(m.cu_seqlens[-1]) <= 9 for m in sink.messages)
    assert [m.batch_id for m in sink.messages] == list(range(len(sink.messages)))
    st = tap.stats()
    assert st["too_long"] == 1 and st["tokens_kept"] == offered and st["tokens_seen"] == sum(lengths)
    assert st["messages_offered"] == len(sink.messages) >= 3
    assert len(tap._sample.pending) == 0  # evicted and shipped sequences are released


def test_tap_inclusion_frequencies():
    """Through the tap: 4 equal-length sequences, a budget that fits 2 → each kept in half the steps."""
    torch.manual_seed(2)
    small = LlamaForCausalLM(_config(layers=2, hidden=16)).eval()
    sink = ListSink()
    tap = HFPolicyTap(small, (1, 2), sink, run_id="r", tokens_per_step=10, topk=0)
    seqs = random_seqs(4, [5] * 4, seed=5)
    steps, counts = 250, [0] * 4
    for step in range(steps):
        tap_forward(tap, small, seqs[:3], [1] * 3, step=step)
        tap_forward(tap, small, seqs[3:], [1], step=step)
        assert tap.end_step() == 10
    for m in sink.messages:
        for s in unpack(m):
            counts[s["input_ids"][0].item() - 1] += 1
    assert sum(counts) == 2 * steps
    for c in counts:
        assert abs(c / steps - 0.5) < 0.12, counts


def test_too_long_short_and_no_response_are_counted(tiny_lm):
    sink = ListSink()
    tap = HFPolicyTap(tiny_lm, AUX, sink, run_id="r", tokens_per_step=8)
    seqs = random_seqs(4, [9, 1, 6, 5], seed=6)
    tap_forward(tap, tiny_lm, seqs, [1, 0, 6, 2])  # 9 > budget; 1 token; no response token; kept
    assert tap.end_step() == 5
    st = tap.stats()
    assert (st["too_long"], st["too_short"], st["no_response"]) == (1, 1, 1)
    assert (st["sequences_seen"], st["tokens_seen"], st["tokens_kept"]) == (4, 21, 5)
    assert unpack(sink.messages[0])[0]["input_ids"].tolist() == seqs[3]
    # a new step starts implicitly; an empty step sends nothing
    assert tap.end_step() == 0 and len(sink.messages) == 1
    tap_forward(tap, tiny_lm, seqs[3:], [2], step=1)
    assert tap.end_step() == 5 and sink.messages[1].step == 1 and sink.messages[1].batch_id == 1


def test_sink_refusal_is_counted_not_raised(tiny_lm):
    sink = ListSink(capacity=1)
    tap = HFPolicyTap(tiny_lm, AUX, sink, run_id="r", tokens_per_step=100, max_tokens_per_message=10)
    tap_forward(tap, tiny_lm, random_seqs(3, [6, 7, 8], seed=7), [1, 1, 1])
    assert tap.end_step() == 6  # first message (6 tokens) accepted, the other two refused
    st = tap.stats()
    assert (st["messages_offered"], st["messages_dropped"], st["tokens_dropped"]) == (1, 2, 15)
    assert (st["tokens_kept"], st["tokens_offered"]) == (21, 6)
    assert tap.head_sync(0, torch.tensor([1, 2])) is False
    assert tap.stats()["head_syncs"] == 0 and tap.stats()["head_syncs_dropped"] == 1


def test_nan_logits_are_counted_not_raised(tiny_lm):
    sink = ListSink()
    tap = HFPolicyTap(tiny_lm, AUX, sink, run_id="r", tokens_per_step=100)
    ids, am, lm = make_batch(random_seqs(2, [4, 5], seed=9), [1, 1])
    with torch.no_grad(), tap.capturing():
        out = tiny_lm(input_ids=ids, attention_mask=am)
        tap.submit(
            input_ids=ids,
            attention_mask=am,
            loss_mask=lm,
            logits=torch.full_like(out.logits, math.nan),
            policy_version=0,
            step=0,
            temperature=1.0,
        )
    assert tap.end_step() == 0 and sink.messages == []
    st = tap.stats()
    assert (st["messages_invalid"], st["tokens_dropped"], st["messages_offered"]) == (1, 9, 0)


def test_messages_split_by_policy_version_and_survive_the_wire(tiny_lm):
    from draft_align.wire.codec import encode
    from draft_align.wire.messages import decode

    sink = ListSink()
    tap = HFPolicyTap(tiny_lm, AUX, sink, run_id="r", tokens_per_step=100, topk=2)
    seqs = random_seqs(3, [4, 6, 5], seed=10)
    tap_forward(tap, tiny_lm, seqs[:2], [1, 2], policy_version=1, step=3)
    tap_forward(tap, tiny_lm, seqs[2:], [2], policy_version=2, step=3, temperature=0.5)
    assert tap.end_step() == 15
    assert [(m.policy_version, m.temperature, m.cu_seqlens.tolist()) for m in sink.messages] == [
        (1, 1.0, [0, 4, 10]),
        (2, 0.5, [0, 5]),
    ]
    key = b"k" * 32
    for m in sink.messages:
        back = decode(encode(m, key), key)
        for name, t in m.tensors().items():
            assert torch.equal(getattr(back, name), t), name


# -- HeadSync ---------------------------------------------------------------------------------------------


def test_head_sync_contents(tiny_lm):
    sink = ListSink()
    tap = HFPolicyTap(tiny_lm, AUX, sink, run_id="hs", tokens_per_step=10)
    d2t = torch.tensor([7, 3, 0, 49, 12])
    assert tap.head_sync(4, d2t) is True
    msg = sink.messages[0]
    assert (msg.run_id, msg.policy_version, msg.hidden_size, msg.vocab_size) == ("hs", 4, 32, V)
    assert msg.norm_eps == pytest.approx(3e-5)
    assert msg.norm_weight.dtype == torch.float32 and torch.equal(msg.norm_weight, tiny_lm.model.norm.weight)
    assert msg.draft_to_target.dtype == torch.int64 and msg.draft_to_target.tolist() == d2t.tolist()
    assert msg.rows.dtype == torch.bfloat16
    assert torch.equal(msg.rows, tiny_lm.lm_head.weight.detach()[d2t].to(torch.bfloat16))
    assert tap.stats()["head_syncs"] == 1
    for bad, match in [
        (torch.tensor([1, 1]), "distinct"),
        (torch.tensor([0, V]), "outside"),
        (torch.tensor([[1, 2]]), "1-D"),
        (torch.tensor([0.5]), "integer"),
    ]:
        with pytest.raises(PolicyTapError, match=match):
            tap.head_sync(5, bad)
    with pytest.raises(PolicyTapError, match="policy_version"):
        tap.head_sync(-1, d2t)


# -- errors -----------------------------------------------------------------------------------------------


def test_constructor_errors(tiny_lm):
    sink = ListSink()
    with pytest.raises(PolicyTapError, match="topk"):
        HFPolicyTap(tiny_lm, AUX, sink, run_id="r", tokens_per_step=10, topk=V + 1)
    with pytest.raises(PolicyTapError, match="tokens_per_step"):
        HFPolicyTap(tiny_lm, AUX, sink, run_id="r", tokens_per_step=1)
    with pytest.raises(PolicyTapError, match="max_tokens_per_message"):
        HFPolicyTap(tiny_lm, AUX, sink, run_id="r", tokens_per_step=10, max_tokens_per_message=1)
    with pytest.raises(PolicyTapError, match="run_id"):
        HFPolicyTap(tiny_lm, AUX, sink, run_id="", tokens_per_step=10)
    with pytest.raises(PolicyTapError, match="offer"):
        HFPolicyTap(tiny_lm, AUX, object(), run_id="r", tokens_per_step=10)
    with pytest.raises(TapError, match="outside"):
        HFPolicyTap(tiny_lm, (1, 5), sink, run_id="r", tokens_per_step=10)
    # the options every tap forwards to TapBase stay strict: a misspelt or missing one is refused
    with pytest.raises(TypeError, match="token_per_step"):
        HFPolicyTap(tiny_lm, AUX, sink, run_id="r", token_per_step=10)
    with pytest.raises(TypeError, match="tokens_per_step"):
        HFPolicyTap(tiny_lm, AUX, sink, run_id="r")


def test_submit_errors(tiny_lm):
    tap = HFPolicyTap(tiny_lm, AUX, ListSink(), run_id="r", tokens_per_step=100)
    ids, am, lm = make_batch(random_seqs(2, [5, 3], seed=8), [1, 1])
    logits = torch.zeros(2, 5, V)
    kw = dict(policy_version=0, step=0, temperature=1.0)

    def submit_after_forward(**over):
        args = dict(input_ids=ids, attention_mask=am, loss_mask=lm, logits=logits, **kw)
        args.update(over)
        with torch.no_grad(), tap.capturing():
            tiny_lm(input_ids=ids, attention_mask=am)
            tap.submit(**args)

    with pytest.raises(PolicyTapError, match="inside"):
        tap.submit(input_ids=ids, attention_mask=am, loss_mask=lm, logits=logits, **kw)
    with tap.capturing(), pytest.raises(PolicyTapError, match="without a captured forward"):
        tap.submit(input_ids=ids, attention_mask=am, loss_mask=lm, logits=logits, **kw)
    with tap.capturing(), pytest.raises(PolicyTapError, match="reentrant"):
        with tap.capturing():
            pass
    with pytest.raises(PolicyTapError, match="attention_mask has shape"):
        submit_after_forward(attention_mask=am[:, :4])
    with pytest.raises(PolicyTapError, match="model vocab"):
        submit_after_forward(logits=torch.zeros(2, 5, V + 1))
    with pytest.raises(PolicyTapError, match=r"logits must be \[B, T, V\]"):
        submit_after_forward(logits=torch.zeros(2, 4, V))
    on_pad = lm.clone()
    on_pad[1, 4] = True
    with pytest.raises(PolicyTapError, match="padding"):
        submit_after_forward(loss_mask=on_pad)
    holed = am.clone()
    holed[0, 2] = 0  # two blocks of valid tokens in row 0
    with pytest.raises(PolicyTapError, match="one contiguous block"):
        submit_after_forward(attention_mask=holed, loss_mask=lm & holed.bool())
    with pytest.raises(PolicyTapError, match="0/1"):
        submit_after_forward(attention_mask=am * 2)
    with pytest.raises(PolicyTapError, match="outside"):
        submit_after_forward(input_ids=ids.masked_fill(am.bool(), V))
    with pytest.raises(PolicyTapError, match="integer"):
        submit_after_forward(input_ids=ids.float())
    for t in (-1.0, 1e308, 5e-324, float("nan")):  # what the wire would refuse is refused at submit
        with pytest.raises(PolicyTapError, match=r"temperature must be 0 \(greedy\) or in \[0\.001, 100\]"):
            submit_after_forward(temperature=t)
    with pytest.raises(PolicyTapError, match="step"):
        submit_after_forward(step=-1)
    with pytest.raises(PolicyTapError, match="same batch"):  # forward on another batch than submitted
        with torch.no_grad(), tap.capturing():
            tiny_lm(input_ids=ids[:1])
            tap.submit(input_ids=ids, attention_mask=am, loss_mask=lm, logits=logits, **kw)
    assert tap.stats()["sequences_seen"] == 0  # nothing was half-submitted
    assert not tap._tap._handles  # hooks removed after every capturing()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_match_cpu(tiny_lm):
    """On CUDA the kept rows are copied non-blocking into pinned host memory; values equal the CPU tap's."""
    gpu_lm = LlamaForCausalLM(_config()).eval()
    gpu_lm.load_state_dict(tiny_lm.state_dict())
    gpu_lm = gpu_lm.cuda()
    seqs = random_seqs(3, [7, 4, 10], seed=1)
    results = []
    for model in (tiny_lm, gpu_lm):
        sink = ListSink()
        tap = HFPolicyTap(model, AUX, sink, run_id="r", tokens_per_step=1000, topk=2)
        ids, am, lm = make_batch(seqs, [3, 2, 4])
        dev = model.lm_head.weight.device
        ids, am, lm = ids.to(dev), am.to(dev), lm.to(dev)
        with torch.no_grad(), tap.capturing():
            out = model(input_ids=ids, attention_mask=am)
            tap.submit(
                input_ids=ids,
                attention_mask=am,
                loss_mask=lm,
                logits=out.logits,
                policy_version=0,
                step=0,
                temperature=1.0,
            )
        assert tap.end_step() == 21
        results.append(sink.messages[0])
    cpu, gpu = results
    assert gpu.aux_hidden.device.type == "cpu" and gpu.next_logprob.device.type == "cpu"
    torch.testing.assert_close(gpu.aux_hidden.float(), cpu.aux_hidden.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(gpu.final_hidden.float(), cpu.final_hidden.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(gpu.next_logprob, cpu.next_logprob, atol=1e-3, rtol=0)
    torch.testing.assert_close(gpu.logit_lse, cpu.logit_lse, atol=1e-3, rtol=0)
    assert torch.equal(gpu.input_ids, cpu.input_ids) and torch.equal(gpu.loss_mask, cpu.loss_mask)


def _messages_by_seq(sink) -> dict[tuple[int, ...], dict]:
    """Every shipped sequence keyed by its token ids, with its message's temperature."""
    out = {}
    for msg in sink.messages:
        for seq in unpack(msg):
            seq["temperature"] = float(msg.temperature)
            out[tuple(seq["input_ids"].tolist())] = seq
    return out


@pytest.mark.parametrize("logits", [True, False])
def test_packed_forward_ships_what_the_padded_forward_ships(tiny_lm, logits):
    """One packed row (position ids restart per sequence, no attention mask, no KV cache: transformers then
    keeps attention within each sequence) gives the same kept sequences
    as the right-padded batch of the same sequences, with per-row temperatures kept apart."""
    seqs = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16, 17]]
    prompts = [2, 1, 3]
    temps = [1.0, 0.7, 1.0]
    sinks = []
    for packed in (False, True):
        sink = ListSink()
        tap = HFPolicyTap(tiny_lm, AUX, sink, run_id="r", tokens_per_step=10_000, topk=2)
        with torch.no_grad(), tap.capturing():
            if packed:
                ids = torch.tensor([sum(seqs, [])])
                pos = torch.tensor([sum((list(range(len(s))) for s in seqs), [])])
                lm = torch.tensor(
                    [sum(([0] * p + [1] * (len(s) - p) for s, p in zip(seqs, prompts, strict=True)), [])]
                )
                out = tiny_lm(input_ids=ids, position_ids=pos, use_cache=False)  # as verl calls it
                cu = torch.tensor([0, 6, 10, 15])
                tap.submit_packed(
                    input_ids=ids,
                    cu_seqlens=cu,
                    loss_mask=lm,
                    logits=out.logits if logits else None,
                    policy_version=2,
                    step=2,
                    temperature=torch.tensor(temps),
                )
            else:
                ids, am, lm = make_batch(seqs, prompts)
                out = tiny_lm(input_ids=ids, attention_mask=am)
                tap.submit(
                    input_ids=ids,
                    attention_mask=am,
                    loss_mask=lm,
                    logits=out.logits if logits else None,
                    policy_version=2,
                    step=2,
                    temperature=temps,
                )
        tap.end_step()
        assert sorted({m.temperature for m in sink.messages}) == pytest.approx(
            [0.7, 1.0]
        )  # one per temperature
        sinks.append(_messages_by_seq(sink))
    padded, packed = sinks
    assert padded.keys() == packed.keys() == {tuple(s) for s in seqs}
    for key, ref in padded.items():
        got = packed[key]
        assert got["temperature"] == ref["temperature"]
        for name, t in ref.items():
            if isinstance(t, torch.Tensor):
                torch.testing.assert_close(got[name].float(), t.float(), atol=2e-2, rtol=2e-2, msg=name)


def test_submit_packed_refuses_bad_boundaries(tiny_lm):
    tap = HFPolicyTap(tiny_lm, AUX, ListSink(), run_id="r", tokens_per_step=1000)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad(), tap.capturing():
        tiny_lm(input_ids=ids)
        with pytest.raises(PolicyTapError, match="cu_seqlens must rise strictly from 0 to N = 4"):
            tap.submit_packed(
                input_ids=ids,
                cu_seqlens=[0, 3],
                loss_mask=torch.ones_like(ids),
                logits=None,
                policy_version=0,
                step=0,
                temperature=1.0,
            )
    with torch.no_grad(), tap.capturing():
        tiny_lm(input_ids=ids)
        with pytest.raises(PolicyTapError, match="temperature holds 3 values for 2 rows"):
            tap.submit_packed(
                input_ids=ids,
                cu_seqlens=[0, 2, 4],
                loss_mask=torch.ones_like(ids),
                logits=None,
                policy_version=0,
                step=0,
                temperature=[1.0, 1.0, 1.0],
            )
