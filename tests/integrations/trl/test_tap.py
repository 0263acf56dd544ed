"""The Tap on TRL's log-prob pass: the same TapBatch as the HF Tap on the same sequences (left+right padding,
TRL's fused LM head, a LoRA policy), tapped once per generation batch and never on the reference pass, a
later num_iterations pass or a gradient-checkpointing recompute."""

from __future__ import annotations

import itertools

import pytest
import torch

from draft_align.integrations.trl.tap import TRLTap, policy_model, tapped_pass
from draft_align.tap.hf import HFPolicyTap

AUX = (1, 2, 3)
pytestmark = pytest.mark.usefixtures("one_thread")


class ListSink:
    def __init__(self) -> None:
        self.messages: list = []

    def offer(self, message) -> bool:
        self.messages.append(message)
        return True


def _tap(trainer, sink, syncs, topk=3):
    hf = HFPolicyTap(policy_model(trainer), AUX, sink, run_id="r", tokens_per_step=100_000, topk=topk)
    d2t = torch.arange(10)
    return TRLTap(trainer, hf, lambda v: syncs.append(v) or hf.head_sync(v, d2t))


def _batches(sink):
    from draft_align.wire.messages import TapBatch

    return [m for m in sink.messages if isinstance(m, TapBatch)]


def _sequences(msg):
    cu = msg.cu_seqlens.tolist()
    for i, (a, b) in enumerate(itertools.pairwise(cu)):
        seq = {
            k: (None if getattr(msg, k) is None else getattr(msg, k)[a:b])
            for k in (
                "input_ids",
                "loss_mask",
                "aux_hidden",
                "final_hidden",
                "next_logprob",
                "logit_lse",
                "topk_ids",
                "topk_logprobs",
            )
        }
        yield {**seq, "stats_from": msg.stats_start(i)}


def _hf_reference(trainer, inputs, topk=3):
    """The HF Tap on the same sequences, right-padded, from the model's own logits (not the fused head)."""
    sink = ListSink()
    model = policy_model(trainer)
    hf = HFPolicyTap(model, AUX, sink, run_id="r", tokens_per_step=100_000, topk=topk)
    p_ids, p_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    c_ids, c_mask = inputs["completion_ids"], inputs["completion_mask"]
    rows, resp = [], []
    for b in range(p_ids.shape[0]):
        p = p_ids[b][p_mask[b].bool()]
        c = c_ids[b][c_mask[b].bool()]
        rows.append(torch.cat([p, c]))
        resp.append(len(p))
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, : len(r)], am[b, : len(r)] = r, 1
    lm = am.bool() & (torch.arange(width)[None, :] >= torch.tensor(resp)[:, None])
    model.eval()
    with torch.no_grad(), hf.capturing():
        logits = model(input_ids=ids, attention_mask=am).logits  # TRL's patched forward, unfused
        hf.submit(
            input_ids=ids,
            attention_mask=am,
            loss_mask=lm,
            logits=logits,
            policy_version=0,
            step=0,
            temperature=1.0,
        )
    hf.end_step()
    return [s for m in _batches(sink) for s in _sequences(m)]


def _same(got, want):
    key = lambda s: s["input_ids"].tolist()  # noqa: E731
    got, want = sorted(got, key=key), sorted(want, key=key)
    assert [key(s) for s in got] == [key(s) for s in want]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g["loss_mask"], w["loss_mask"])
        assert (g["topk_ids"] is None and w["topk_ids"] is None) or torch.equal(g["topk_ids"], w["topk_ids"])
        # statistics from the position before the first response token on (TRL's left-padded prompt or not)
        assert g["stats_from"] == w["stats_from"] == int(w["loss_mask"].to(torch.int8).argmax()) - 1
        for name in ("aux_hidden", "final_hidden", "next_logprob", "logit_lse", "topk_logprobs"):
            if w[name] is None:
                assert g[name] is None, name
                continue
            torch.testing.assert_close(g[name].float(), w[name].float(), atol=2e-2, rtol=1e-2)


def _generate(trainer):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()
    batch = [{"prompt": p} for p in trainer.train_dataset["prompt"][: trainer.args.generation_batch_size]]
    batch = [x for x in batch for _ in range(1)]
    return trainer._generate_and_score_completions(batch)


@pytest.mark.parametrize("topk", [3, 0])  # 0: the statistics from TRL's own log-probs
def test_training_forward_is_tapped_like_the_hf_tap(make_trainer, topk):
    """No old pass (no vLLM): the first training forward; not the reference pass (β > 0, adapter disabled),
    not the second num_iterations pass, not the gradient-checkpointing recompute."""
    trainer = make_trainer(
        beta=0.1,
        num_iterations=2,
        gradient_accumulation_steps=2,
        steps_per_generation=1,
        gradient_checkpointing=True,
    )
    assert tapped_pass(trainer) == "train"
    sink, syncs = ListSink(), []
    tap = _tap(trainer, sink, syncs, topk=topk)
    assert tap.uses_trl_logprobs == (topk == 0)
    inputs = _generate(trainer)  # the reference pass runs in here
    assert tap.tapped_calls == 0 and tap.tap.stats()["sequences_seen"] == 0
    trainer._step = 0
    loss = trainer.compute_loss(trainer.model, inputs)
    assert tap.tapped_calls == 1 and syncs == [0]
    seen = tap.tap.stats()["sequences_seen"]
    assert seen == inputs["prompt_ids"].shape[0]
    loss.backward()  # with gradient checkpointing: the layers run again, the hooks are gone
    trainer._step = 1  # the second of num_iterations passes over the same batch
    trainer.compute_loss(trainer.model, inputs)
    assert tap.tapped_calls == 1 and tap.tap.stats()["sequences_seen"] == seen
    tap.tap.end_step()
    got = [s for m in _batches(sink) for s in _sequences(m)]
    assert len(got) == seen and inputs["prompt_mask"][:, 0].eq(0).any()  # some rows were left-padded
    assert sum(1 for m in sink.messages if type(m).__name__ == "HeadSync") == 1
    _same(got, _hf_reference(trainer, inputs, topk=topk))
    tap.uninstall()
    assert trainer._get_per_token_logps_and_entropies == type(
        trainer
    )._get_per_token_logps_and_entropies.__get__(trainer)


def test_old_logprob_pass_is_tapped_not_the_reference_pass(make_trainer):
    """Generation not aligned with optimizer steps: TRL computes old log-probs; that no-grad pass is tapped,
    the reference pass after it and the training forward are not."""
    trainer = make_trainer(beta=0.1, steps_per_generation=2, gradient_accumulation_steps=1)
    assert tapped_pass(trainer) == "old"
    sink, syncs = ListSink(), []
    tap = _tap(trainer, sink, syncs)
    inputs = _generate(trainer)
    assert "old_per_token_logps" in inputs and "ref_per_token_logps" in inputs
    assert tap.tapped_calls == 1
    seen = tap.tap.stats()["sequences_seen"]
    trainer._step = 0
    trainer.compute_loss(trainer.model, inputs)
    assert tap.tapped_calls == 1 and tap.tap.stats()["sequences_seen"] == seen
    tap.tap.end_step()
    _same([s for m in _batches(sink) for s in _sequences(m)], _hf_reference(trainer, inputs))


def test_trl_logprobs_replace_the_head_pass(make_trainer, monkeypatch):
    """T = 1 and topk = 0: the statistics come from TRL's own fused-head log-probs (no [L, V] product in the
    Tap: head_logit_stats is never called) and equal the HF Tap's from the model's logits."""
    from draft_align.tap import hf as tap_hf

    trainer = make_trainer(beta=0.1, steps_per_generation=2, gradient_accumulation_steps=1)
    sink, syncs = ListSink(), []
    tap = _tap(trainer, sink, syncs, topk=0)
    assert tap.uses_trl_logprobs

    def no_head_pass(*a, **k):
        raise AssertionError("the Tap ran the lm_head over whole rows")

    monkeypatch.setattr(tap_hf, "head_logit_stats", no_head_pass)
    inputs = _generate(trainer)
    assert tap.tapped_calls == 1
    tap.tap.end_step()
    got = [s for m in _batches(sink) for s in _sequences(m)]
    assert got and all(s["topk_ids"] is None for s in got)
    monkeypatch.undo()
    _same(got, _hf_reference(trainer, inputs, topk=0))


def test_tempered_trl_logprobs_are_not_used(make_trainer):
    """TRL's log-probs at T ≠ 1 are tempered: the Tap computes the statistics from the head instead."""
    trainer = make_trainer(temperature=0.7)
    assert not _tap(trainer, ListSink(), [], topk=0).uses_trl_logprobs
    assert not _tap(make_trainer(), ListSink(), [], topk=1).uses_trl_logprobs
