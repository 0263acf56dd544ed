"""draft_align.train.losses: soft / hard cross-entropy per TTT step, masks, agreement counts; the blocked
(memory-bounded) forms against the single-block one; the per-sequence cap."""

import copy
import math

import pytest
import torch
from torch import nn

from draft_align.heads import layers
from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.heads.mtp import MTPConfig, MTPDraft
from draft_align.train import losses
from draft_align.train.losses import hard_ce_step, soft_ce_reference, soft_ce_step, step_weights
from draft_align.train.records import Record, collate
from draft_align.train.trainer import DraftTrainer, LossSettings, OptimSettings, ttt_loss


def log_softmax_list(xs: list[float]) -> list[float]:
    z = math.log(sum(math.exp(x) for x in xs))
    return [x - z for x in xs]


def soft(q_logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor):
    """soft_ce_step from a target distribution p [..., Vd]: it takes Σ_x p(x) z(x) and argmax p."""
    return soft_ce_step(q_logits, (p * q_logits).sum(-1), p.argmax(-1), mask)


def test_soft_ce_is_minus_sum_p_log_q_by_hand():
    q = [[0.0, 1.0, 2.0], [3.0, 0.5, -1.0]]
    p = [[0.2, 0.3, 0.5], [0.6, 0.4, 0.0]]
    q_logits = torch.tensor([q])  # [1, 2, 3]
    ce, agree, n = soft(q_logits, torch.tensor([p]), torch.tensor([[True, True]]))
    by_hand = []
    for qr, pr in zip(q, p, strict=True):
        by_hand.append(-sum(pi * lq for pi, lq in zip(pr, log_softmax_list(qr), strict=True)))
    assert ce.item() == pytest.approx(sum(by_hand), rel=1e-6)
    ref = soft_ce_reference(q_logits, torch.log(torch.tensor([p])))  # log 0 = -inf is harmless there
    assert ref[0].tolist() == pytest.approx(by_hand, rel=1e-6)
    # argmax q: (2, 0); argmax p: (2, 0) → both agree
    assert agree.item() == 2.0 and n.item() == 2.0


def test_soft_ce_mask_drops_rows_and_counts():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, generator=g)
    p = torch.softmax(torch.randn(2, 3, 5, generator=g), -1)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    ce, agree, n = soft(q, p, mask)
    per = -(p * torch.log_softmax(q, -1)).sum(-1)
    assert ce.item() == pytest.approx(per[mask].sum().item(), rel=1e-5)
    assert n.item() == 3.0
    want_agree = (q.argmax(-1) == p.argmax(-1))[mask].sum().item()
    assert agree.item() == want_agree
    # changing a masked-out row changes nothing
    q2 = q.clone()
    q2[0, 1] = 100.0
    assert soft(q2, p, mask)[0].item() == pytest.approx(ce.item(), rel=1e-6)


def test_soft_equals_hard_for_one_hot_targets():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 6, generator=g)
    tgt = torch.tensor([[0, 5, 2, 2], [1, 3, 4, 0]])
    p = torch.nn.functional.one_hot(tgt, 6).float()
    mask = torch.tensor([[True, True, False, True], [True, False, True, True]])
    s = soft(q, p, mask)
    hard = hard_ce_step(q, tgt, mask)
    for a, b in zip(s, hard, strict=True):
        assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert s[2].item() == 6.0


def test_hard_ce_by_hand_and_out_of_vocab_targets_masked():
    q = torch.tensor([[[1.0, 2.0, 0.0], [0.0, 0.0, 5.0], [2.0, 1.0, 0.0]]])
    ids = torch.tensor([[1, -1, 2]])  # -1: outside the draft vocab, never scored
    ce, agree, n = hard_ce_step(q, ids, torch.ones(1, 3, dtype=torch.bool))
    want = -log_softmax_list([1.0, 2.0, 0.0])[1] - log_softmax_list([2.0, 1.0, 0.0])[2]
    assert ce.item() == pytest.approx(want, rel=1e-6)
    assert n.item() == 2.0
    assert agree.item() == 1.0  # row 0: argmax 1 == 1; row 2: argmax 0 != 2


def test_all_masked_gives_zero_sums():
    q = torch.randn(1, 2, 4)
    ce, agree, n = soft(q, torch.softmax(q, -1), torch.zeros(1, 2, dtype=torch.bool))
    assert ce.item() == 0.0 and agree.item() == 0.0 and n.item() == 0.0


def test_step_weights():
    assert step_weights(4, 0.8) == pytest.approx([1.0, 0.8, 0.64, 0.512])
    assert step_weights(1, 0.5) == [1.0]


# --------------------------------------------------------------------------------- blocked forms
# Logits, soft targets and TTT attention in row/query blocks (each checkpointed) must give the same loss,
# stats and gradients as the single-block computation, for both heads, at several lengths and block sizes.
H_T, N_AUX, VOCAB, VD, HID = 24, 3, 50, 20, 32
SHAPE = dict(hidden_size=HID, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             vocab_size=VOCAB, max_position_embeddings=128)


def eagle3(seed: int) -> tuple[nn.Module, torch.Tensor, int]:
    torch.manual_seed(seed)
    d = Eagle3Draft(Eagle3Config(**SHAPE, draft_vocab_size=VD, target_hidden_size=H_T, aux_layer_ids=(1, 2, 3),
                                 target_num_layers=4))
    for p in d.parameters():
        nn.init.normal_(p, std=0.3)
    d.set_vocab(torch.arange(0, 2 * VD, 2))
    return d, torch.randn(VD, H_T) * 0.5, N_AUX * H_T


def mtp(seed: int, depth: int) -> tuple[nn.Module, torch.Tensor, int]:
    torch.manual_seed(seed)
    d = MTPDraft(MTPConfig(**SHAPE, target_num_layers=4, depth=depth))
    for p in d.parameters():
        nn.init.normal_(p, std=0.3)
    d.set_head(torch.randn(VOCAB, HID) * 0.5)
    return d, torch.randn(VOCAB, HID) * 0.5, HID


HEADS = {"eagle3": eagle3, "mtp1": lambda s: mtp(s, 1), "mtp2": lambda s: mtp(s, 2)}


def records(lengths: list[int], aux_width: int, final_width: int, seed: int) -> list[Record]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in lengths:
        ids = torch.randint(0, VOCAB, (t,), generator=g)
        mask = torch.arange(t) >= t // 3
        out.append(Record(ids, mask, torch.randn(t, aux_width, generator=g), torch.randn(t, final_width, generator=g)))
    return out


def loss_and_grads(head: str, lengths: list[int], kind: str, monkeypatch, attn_bytes: int, logit_bytes: int):
    monkeypatch.setattr(layers, "ATTN_BLOCK_BYTES", attn_bytes)
    monkeypatch.setattr(losses, "LOGITS_BLOCK_BYTES", logit_bytes)
    draft, rows, aux_w = HEADS[head](0)
    embed = nn.Embedding(VOCAB, HID)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(VOCAB, HID, generator=torch.Generator().manual_seed(9)))
    embed.requires_grad_(False)
    batch = collate(records(lengths, aux_w, rows.shape[1], seed=sum(lengths)), steps=3)
    loss, stats = ttt_loss(draft, embed, rows, batch, LossSettings(ttt_steps=3, kind=kind))
    params = [p for p in draft.parameters() if p.requires_grad]
    return loss, stats, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("lengths", [[9], [23, 14], [31, 12, 20]])
@pytest.mark.parametrize("attn_bytes,logit_bytes", [(1, 1), (700, 500), (3000, 2500)])
def test_blocked_ttt_loss_equals_one_block(head, lengths, attn_bytes, logit_bytes, monkeypatch):
    """Blocks of 1 query / 1 row, and of a few: loss, per-step sums and every gradient as in one block."""
    whole = loss_and_grads(head, lengths, "soft", monkeypatch, 1 << 40, 1 << 40)
    blocked = loss_and_grads(head, lengths, "soft", monkeypatch, attn_bytes, logit_bytes)
    torch.testing.assert_close(blocked[0], whole[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(blocked[1].__dict__.values(), whole[1].__dict__.values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(blocked[2]) == len(whole[2]) > 0
    for a, b in zip(blocked[2], whole[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head", ["eagle3", "mtp2"])
def test_blocked_hard_loss_equals_one_block(head, monkeypatch):
    whole = loss_and_grads(head, [17, 25], "hard", monkeypatch, 1 << 40, 1 << 40)
    blocked = loss_and_grads(head, [17, 25], "hard", monkeypatch, 1, 1)
    torch.testing.assert_close(blocked[0], whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(blocked[1].count, whole[1].count)
    for a, b in zip(blocked[2], whole[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while ``fn`` runs (checkpointed blocks keep only their inputs)."""
    seen: dict[int, int] = {}

    def pack(x):
        seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(seen.values())


def test_blocked_logits_keep_no_vocab_sized_tensor():
    """With Vd ≫ H the single block keeps the [N, Vd] logits for backward; blocks keep O(N·H)."""
    n, h, vd = 64, 8, 2048
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(h, vd, bias=False)
    x = torch.randn(1, n, h, generator=g, requires_grad=True)
    e = torch.randn(1, n, h, generator=g)
    arg = torch.randint(0, vd, (1, n), generator=g)
    mask = torch.ones(1, n, dtype=torch.bool)
    dense = saved_bytes(lambda: losses.soft_ce_head(head, x, e, arg, mask, block_bytes=1 << 40))
    blocked = saved_bytes(lambda: losses.soft_ce_head(head, x, e, arg, mask, block_bytes=4 * vd * 8))
    assert dense >= 4 * n * vd  # the fp32 logits
    assert blocked < 4 * n * vd / 8
    final, rows = torch.randn(1, n, h, generator=g), torch.randn(vd, h, generator=g)
    dense = saved_bytes(lambda: losses.soft_targets(final, rows, head.weight, block_bytes=1 << 40))
    blocked = saved_bytes(lambda: losses.soft_targets(final, rows, head.weight, block_bytes=4 * vd * 8))
    assert dense >= 4 * n * vd and blocked < 4 * n * vd / 8
    whole = losses.soft_targets(final, rows, head.weight, block_bytes=1 << 40)
    parts = losses.soft_targets(final, rows, head.weight, block_bytes=4 * vd * 8)
    torch.testing.assert_close(parts[0], whole[0])
    assert torch.equal(parts[1], whole[1])


def test_row_blocks_cover_every_row_once():
    assert losses.row_blocks(10, 4, 12) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert losses.row_blocks(10, 100, 1) == [(i, i + 1) for i in range(10)]  # at least one row per block
    assert losses.row_blocks(5, 4, 1 << 20) == [(0, 5)]
    assert losses.row_blocks(0, 4, 12) == [(0, 0)]


# --------------------------------------------------------------------------------- the per-sequence cap
def cut_record(r: Record, cap: int) -> Record:
    return Record(r.input_ids[:cap], r.loss_mask[:cap], r.aux[:cap], r.final[:cap])


def test_truncate_batch_is_the_collate_of_the_cut_records():
    recs = records([30, 11, 22], N_AUX * H_T, H_T, seed=4)
    cap, steps = 16, 3
    batch, rows_cut, dropped = losses.truncate_batch(collate(recs, steps), cap, steps)
    want = collate([cut_record(r, cap) for r in recs], steps)
    for name in ("input_ids", "valid", "loss_mask", "aux", "final", "starts", "starts_valid"):
        assert torch.equal(getattr(batch, name), getattr(want, name)), name
    assert rows_cut == 2  # the 30- and 22-token rows
    assert dropped == int(recs[0].loss_mask[cap:].sum() + recs[2].loss_mask[cap:].sum()) == 14 + 6
    same, n, k = losses.truncate_batch(want, cap, steps)
    assert same is want and n == k == 0


@pytest.mark.parametrize("head", ["eagle3", "mtp2"])
def test_truncated_loss_is_the_full_rows_loss_on_the_kept_targets(head):
    """Causal attention: cutting at the cap changes nothing for the targets before it."""
    draft, rows, aux_w = HEADS[head](1)
    embed = nn.Embedding(VOCAB, HID).requires_grad_(False)
    recs = records([28, 19], aux_w, rows.shape[1], seed=5)
    cap = 15
    cut, _, _ = losses.truncate_batch(collate(recs, 3), cap, 3)
    masked = [Record(r.input_ids, r.loss_mask & (torch.arange(len(r)) < cap), r.aux, r.final) for r in recs]
    settings = LossSettings(ttt_steps=3)
    with torch.no_grad():
        a_loss, a = ttt_loss(draft, embed, rows, cut, settings)
        b_loss, b = ttt_loss(draft, embed, rows, collate(masked, 3), settings)
    torch.testing.assert_close(a_loss, b_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.count, b.count) and torch.equal(a.correct, b.correct)


def test_trainer_cuts_long_rows_and_counts_them():
    draft, rows, aux_w = HEADS["eagle3"](2)
    embed = nn.Embedding(VOCAB, HID)
    trainer = DraftTrainer(draft, embed, rows, OptimSettings(warmup_steps=1, total_steps=4),
                           LossSettings(ttt_steps=3, autocast_bf16=False), max_seq_tokens=12)
    recs = records([20, 10], aux_w, H_T, seed=6)
    out = trainer.train_step(collate(recs, 3))
    assert trainer.progress.truncated_sequences == 1
    assert trainer.progress.truncated_targets == int(recs[0].loss_mask[12:].sum()) == 8
    assert out["targets"] == sum(int((torch.arange(len(r)) + 2 < len(r)).logical_and(
        torch.roll(r.loss_mask, -2)).sum()) for r in (cut_record(recs[0], 12), recs[1]))
    trainer.train_step(collate(recs[1:], 3))  # short rows: nothing cut, nothing counted
    assert trainer.progress.truncated_sequences == 1
    assert DraftTrainer(draft, embed, rows, OptimSettings(), LossSettings()).max_seq_tokens == losses.MAX_SEQ_TOKENS
    with pytest.raises(ValueError, match="max_seq_tokens must be ≥ 2"):
        DraftTrainer(draft, embed, rows, OptimSettings(), LossSettings(), max_seq_tokens=1)


@pytest.mark.parametrize("head", ["eagle3", "mtp2"])
def test_fp32_training_on_bf16_taps(head):
    """Without autocast, bf16-stored states, head rows and embedding meet the fp32 draft in fp32: the
    step equals the one on the same states given in fp32 (and does not raise a dtype mismatch)."""
    draft, rows, aux_w = HEADS[head](2)
    recs = records([18, 12], aux_w, rows.shape[1], seed=8)
    bf = [Record(r.input_ids, r.loss_mask, r.aux.bfloat16(), r.final.bfloat16()) for r in recs]
    fp = [Record(r.input_ids, r.loss_mask, r.aux.bfloat16().float(), r.final.bfloat16().float()) for r in recs]
    emb = nn.Embedding(VOCAB, HID).bfloat16()
    out = []
    for rs, rw, emb_dtype in ((bf, rows.bfloat16(), torch.bfloat16), (fp, rows.bfloat16().float(), torch.float32)):
        d = copy.deepcopy(draft)
        embed = copy.deepcopy(emb).to(emb_dtype)
        trainer = DraftTrainer(d, embed, rw, OptimSettings(warmup_steps=1, total_steps=4),
                               LossSettings(ttt_steps=3, autocast_bf16=False))
        assert trainer.autocast_bf16 is False
        out.append(trainer.train_step(collate(rs, 3))["loss"])
    assert math.isfinite(out[0]) and out[0] == pytest.approx(out[1], rel=1e-5)


def test_replaced_head_rows_are_used_in_fp32_training():
    """A HeadSync replaces ``trainer.rows``: the fp32 copy the loss uses follows it."""
    draft, rows, aux_w = HEADS["eagle3"](3)
    trainer = DraftTrainer(draft, nn.Embedding(VOCAB, HID), rows.bfloat16(), OptimSettings(),
                           LossSettings(ttt_steps=2, autocast_bf16=False))
    new = torch.randn_like(rows).bfloat16()
    trainer.rows = new
    assert trainer.rows is not None and torch.equal(trainer.rows, new)
    assert trainer._rows.dtype == torch.float32 and torch.equal(trainer._rows, new.float())
