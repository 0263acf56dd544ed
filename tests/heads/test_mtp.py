"""draft_align.heads.mtp: unroll == KV-cached steps, a detached trunk, the estimators and the lossless
reference decoder with an MTP head (its layouts and export: tests/publish/test_mtp_format.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from draft_align.heads.draft_head import DraftConfigError
from draft_align.heads.mtp import MTPDraft
from draft_align.hf.capture import HFTap
from draft_align.hf.parts import decoder_parts
from draft_align.publish import export_draft, load_draft
from draft_align.publish.mtp_format import with_layout
from tests.helpers import make_mtp_head, peaky

V, H, L = 48, 32, 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama):
    return peaky(tiny_llama(L, V, H))


def final_hidden(target, ids):
    with torch.no_grad():
        return target(ids, output_hidden_states=True).hidden_states[-1]


# ---------------------------------------------------------------- structure
def test_config_is_eagle3_shaped_for_the_pipeline(target):
    d = make_mtp_head(target)
    c = d.cfg
    assert c.aux_layer_ids == (L,) and c.fc_in_features == H and c.draft_vocab_size == V
    assert torch.equal(d.draft_to_target, torch.arange(V)) and bool(d.t2d.all())
    assert "d2t" not in d.state_dict()  # identity map: not an engine tensor
    with pytest.raises(DraftConfigError, match="depth"):
        dataclasses.replace(c, depth=0)
    with pytest.raises(DraftConfigError, match="layout"):
        dataclasses.replace(c, layout="mimo")


def test_attach_copies_last_layer_and_shares_frozen_head(target):
    d = MTPDraft.attach(target, depth=2)
    last = target.model.layers[-1]
    for mod in d.layers:
        assert torch.equal(mod.self_attn.q_proj.weight, last.self_attn.q_proj.weight)
        assert torch.equal(mod.mlp.down_proj.weight, last.mlp.down_proj.weight)
        assert torch.equal(mod.eh_proj.weight, torch.cat((torch.eye(H), torch.eye(H)), 1))
    assert torch.equal(d.lm_head.weight, target.lm_head.weight)
    assert d.lm_head.weight.data_ptr() != target.lm_head.weight.data_ptr()  # a copy, never the trunk's
    assert not d.lm_head.weight.requires_grad
    assert torch.equal(d.norm.weight, target.model.norm.weight)


# ---------------------------------------------------------------- unroll == KV-cached inference
@pytest.mark.parametrize(
    ("layout", "depth"), [("deepseek_v3", 1), ("deepseek_v3", 2), ("qwen3_next", 1), ("qwen3_next", 3)]
)
def test_unroll_equals_kv_cached_steps(target, layout, depth):
    d = make_mtp_head(target, layout, depth)
    t, k = 12, 4
    ids = torch.randint(0, V, (1, t), generator=torch.Generator().manual_seed(3))
    fin = final_hidden(target, ids)
    emb = decoder_parts(target)[0]
    starts = torch.arange(0, t - 1)[None]
    with torch.no_grad():
        q = d.unroll(
            fin,
            emb,
            ids,
            torch.ones(1, t, dtype=torch.bool),
            starts,
            torch.ones_like(starts, dtype=torch.bool),
            k,
        )
    checked = 0
    for s in range(0, t - 1 - k):
        cache = d.new_cache()
        # committed context in two chunks (as the decoder appends it), then the chain
        lg, h = d.step(
            cache, fin[0, : s // 2 + 1], emb(ids[0, 1 : s // 2 + 2]), torch.arange(s // 2 + 1), True
        )
        if s // 2 + 1 < s + 1:
            lg, h = d.step(
                cache,
                fin[0, s // 2 + 1 : s + 1],
                emb(ids[0, s // 2 + 2 : s + 2]),
                torch.arange(s // 2 + 1, s + 1),
                True,
            )
        torch.testing.assert_close(lg[-1], q[0][0, s], atol=1e-5, rtol=1e-5)
        hh = h[-1:]
        for j in range(1, k):
            lg, hh = d.step(cache, hh, emb(ids[0, s + 1 + j].view(1)), torch.tensor([s + j]), False)
            torch.testing.assert_close(lg[0], q[j][0, s], atol=1e-5, rtol=1e-5)
            checked += 1
        cache.truncate(s + 1)  # a new round: deeper modules forget their chain rows
        assert cache.length == s + 1 and all(c.length == 0 for c in cache.caches[1:])
    assert checked == (t - 1 - k) * (k - 1)


def test_deepseek_zeroes_the_embedding_at_position_0(target):
    """vLLM's DeepSeek MTP zeroes the input embedding at position 0 (Qwen3-Next does not): the first step
    of the chain starting at 0 then cannot depend on x[1]."""
    d = make_mtp_head(target, "deepseek_v3")
    q_ = with_layout(d, "qwen3_next")
    ids = torch.randint(1, V, (1, 10), generator=torch.Generator().manual_seed(4))
    ids2 = ids.clone()
    ids2[0, 1] = (ids[0, 1] + 1) % V
    emb = decoder_parts(target)[0]
    fin = final_hidden(target, ids)  # the same hidden for both: only the token input differs
    starts = torch.zeros(1, 1, dtype=torch.long)

    def first(head, x):
        with torch.no_grad():
            return head.unroll(
                fin,
                emb,
                x,
                torch.ones(1, 10, dtype=torch.bool),
                starts,
                torch.ones(1, 1, dtype=torch.bool),
                1,
            )[0]

    assert torch.equal(first(d, ids), first(d, ids2))
    assert not torch.allclose(first(q_, ids), first(q_, ids2))


# ---------------------------------------------------------------- the trunk never learns
def test_trunk_gets_no_gradient(target):
    tgt = LlamaForCausalLM(target.config)
    tgt.load_state_dict(target.state_dict())
    tgt.train()  # trainable, as a policy would be
    d = MTPDraft.attach(tgt, depth=2)
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(5))
    fin = tgt(ids, output_hidden_states=True).hidden_states[-1]
    assert fin.requires_grad
    starts = torch.arange(0, 8).expand(2, -1)
    q = d.unroll(
        fin,
        tgt.model.embed_tokens,
        ids,
        torch.ones(2, 10, dtype=torch.bool),
        starts,
        torch.ones_like(starts, dtype=torch.bool),
        4,
    )  # module 1 runs steps 1 and 3: its q/k matter
    sum(x.logsumexp(-1).sum() for x in q).backward()
    assert all(p.grad is None for p in tgt.parameters())
    assert d.lm_head.weight.grad is None
    no_grad = [
        n
        for n, p in d.named_parameters()
        if n != "lm_head.weight" and (p.grad is None or not p.grad.abs().sum() > 0)
    ]
    assert not no_grad


# ---------------------------------------------------------------- trainer, estimators, decoder
def trained_head(target, layout="deepseek_v3", depth=1, steps=60, kind="soft"):
    from draft_align.hf.parts import frozen_embedding
    from draft_align.train.objective import LossSettings
    from draft_align.train.records import Record, collate
    from draft_align.train.trainer import DraftTrainer, OptimSettings

    g = torch.Generator().manual_seed(11)
    recs = []
    with torch.no_grad(), HFTap(target, (L,), capture_final=True) as tap:
        ids = torch.randint(0, V, (16, 4), generator=g)
        for _ in range(20):  # the target's own greedy continuations: what the decoder will verify
            nxt = target(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat((ids, nxt), 1)
        target(ids)
        cap = tap.pop()
    for i in range(ids.shape[0]):
        recs.append(Record(ids[i], torch.arange(ids.shape[1]) >= 4, cap.aux[i], cap.final[i]))
    d = MTPDraft.attach(target, depth=depth, layout=layout)
    tr = DraftTrainer(
        d,
        frozen_embedding(target),
        target.lm_head.weight.detach(),
        OptimSettings(lr=3e-3, warmup_steps=2, total_steps=steps),
        LossSettings(ttt_steps=3, step_decay=0.6, kind=kind, autocast_bf16=False),
    )
    head0 = d.lm_head.weight.clone()
    losses = []
    for s in range(steps):
        m = tr.train_step(collate(recs[(s % 4) * 4 : (s % 4) * 4 + 4], 3))
        losses.append(m["loss"] if kind == "hard" else m["acc_0"])
    assert torch.equal(d.lm_head.weight, head0)  # the shared head never trains
    return d.eval(), losses


@pytest.fixture(scope="module")
def good_head(target):
    d, acc = trained_head(target)  # soft CE's floor is the target's entropy: watch argmax agreement
    assert sum(acc[-8:]) / 8 > sum(acc[:4]) / 4 + 0.2, acc
    return d


def test_hard_ce_trains_too(target):
    _, losses = trained_head(target, "qwen3_next", depth=2, steps=16, kind="hard")
    assert sum(losses[-4:]) < sum(losses[:4])


def test_records_estimate_equals_alpha_table(target, good_head):
    from draft_align.monitor.estimator import alpha_table
    from draft_align.monitor.tapped_estimate import record_alpha
    from draft_align.train.records import Record, TappedRecord

    ids = torch.randint(0, V, (16,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), HFTap(target, (L,), capture_final=True) as tap:
        logits = target(ids[None]).logits[0]
        cap = tap.pop()
    rec = TappedRecord(
        Record(ids, torch.arange(16) >= 4, cap.aux[0], cap.final[0]),
        policy_version=0,
        step=0,
        logit_lse=torch.logsumexp(logits, -1),
        topk_ids=logits.topk(2, -1).indices,
    )
    torch.testing.assert_close(cap.aux[0], cap.final[0])  # "aux layer" L is the final post-norm state
    for mode, temp in (("greedy", 0.0), ("greedy_draft", 1.0), ("probabilistic", 1.0)):
        got, valid = record_alpha(
            good_head, decoder_parts(target)[0], target.lm_head.weight, rec, 3, mode, temp
        )
        want, want_valid = alpha_table(target, good_head, ids, 4, 3, mode, temp)
        assert torch.equal(valid, want_valid)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("layout", "depth"), [("deepseek_v3", 1), ("qwen3_next", 2)])
def test_reference_decoder_is_lossless_at_t0(target, good_head, layout, depth):
    from draft_align.engines.reference.specdec import SpecDecoder
    from draft_align.monitor.estimator import estimate

    d = good_head if (layout, depth) == ("deepseek_v3", 1) else make_mtp_head(target, layout, depth)
    prompts = [[3, 17, 5], [40, 2, 9, 11, 30], [7]]
    total_acc = 0.0
    for p in prompts:
        ref = target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None)[
            0, len(p) :
        ]
        for k in (1, 3):
            out, tally = SpecDecoder(target, d, k, "greedy", 0.0).generate(torch.tensor(p), 16)
            assert out.tolist() == ref.tolist(), (p, k)
            total_acc += tally.num_accepted
    if d is good_head:
        assert total_acc > 0  # the acceptance path was exercised
        est = estimate(
            target,
            d,
            [(torch.tensor(p), torch.tensor([1, 2, 3, 4, 5, 6])) for p in prompts],
            3,
            "greedy",
            0.0,
        )
        assert est["acceptance_length_est"] >= 1.0 and est["num_tokens"] == 18


def test_estimator_matches_the_decoder_at_t0(target, good_head):
    """The reference eval with an MTP head: the round-walk estimate equals the decoder's counters at T=0,
    up to each prompt's last round (drafts accepted past the limit: ≤ k per prompt)."""
    from draft_align.engines.reference.reference_eval import evaluate

    prompts = [torch.tensor([5, 17, 33]), torch.tensor([1, 9, 40, 22, 7]), torch.tensor([12, 0, 31, 31])]
    r = evaluate(
        target, None, good_head, prompts, k=3, mode="greedy", temperature=0.0, max_new_tokens=20, seed=0
    )
    assert r["rounds_est"] == r["rounds_measured"]
    gap = (r["acceptance_length_measured"] - r["acceptance_length_est"]) * r["rounds_measured"]
    assert -1e-9 <= gap <= 3 * 3
    assert r["acceptance_length_observed"] == pytest.approx(r["acceptance_length_est"])
    assert r["acceptance_length_measured"] > 1.2  # trained: drafts are accepted


@pytest.mark.slow
def test_smollm2_attach_decode_and_round_trip(tmp_path):
    """A fresh MTP head on the real SmolLM2-135M: the lossless decoder, and both layouts round-trip."""
    from draft_align import assets
    from draft_align.engines.reference.specdec import SpecDecoder

    target, _ = assets.load_target(str(assets.fetch_smollm2()), torch.float32, "cpu")
    d = MTPDraft.attach(target).eval()
    assert d.cfg.aux_layer_ids == (30,) and d.cfg.hidden_size == 576
    prompt = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018])
    ref = target.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None)[
        0, prompt.numel() :
    ]
    out, _ = SpecDecoder(target, d, 3, "greedy", 0.0).generate(prompt, 12)
    assert out.tolist() == ref.tolist()
    for layout in ("deepseek_v3", "qwen3_next"):
        h = with_layout(d, layout)
        back, _ = load_draft(
            export_draft(
                h,
                tmp_path / layout,
                target_config=target.config,
                target_name="smollm2",
                metrics={},
                draft_version=1,
                policy_version=0,
                tokenizer_fingerprint="fp",
                dtype=torch.float32,
            )
        )
        for k, v in h.engine_state_dict().items():
            assert torch.equal(v, back.engine_state_dict()[k]), (layout, k)
