"""draft_align.train.losses: soft / hard cross-entropy per TTT step, masks, agreement counts; the blocked
(memory-bounded) forms against the single-block one; the per-sequence cap."""

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from draft_align.heads import layers
from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.heads.mtp import MTPConfig, MTPDraft
from draft_align.train import losses
from draft_align.train.losses import hard_ce_step, soft_ce_reference, soft_ce_step, step_weights
from draft_align.train.objective import LossSettings, ttt_loss
from draft_align.train.records import Record, collate
from draft_align.train.trainer import DraftTrainer, OptimSettings
from tests.helpers import saved_bytes

pytestmark = pytest.mark.usefixtures("one_thread")


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
SHAPE = dict(
    hidden_size=HID,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)


def eagle3(seed: int) -> tuple[nn.Module, torch.Tensor, int]:
    torch.manual_seed(seed)
    d = Eagle3Draft(
        Eagle3Config(
            **SHAPE, draft_vocab_size=VD, target_hidden_size=H_T, aux_layer_ids=(1, 2, 3), target_num_layers=4
        )
    )
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
        out.append(
            Record(
                ids, mask, torch.randn(t, aux_width, generator=g), torch.randn(t, final_width, generator=g)
            )
        )
    return out


def loss_and_grads(head: str, lengths: list[int], kind: str, monkeypatch, attn_bytes: int, logit_bytes: int):
    monkeypatch.setattr(layers, "ATTN_BLOCK_BYTES", attn_bytes)
    monkeypatch.setattr(losses, "LOGITS_BLOCK_BYTES", logit_bytes)
    monkeypatch.setattr(losses, "FUSED_BLOCK_BYTES", logit_bytes)
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


@pytest.mark.parametrize("path", ["fused", "switched off", "gradient over budget"])
def test_blocked_logits_keep_no_vocab_sized_tensor(path, monkeypatch):
    """Checkpointed blocks: the single block keeps the [N, Vd] logits for backward, blocks keep O(N·H).  The
    fused path (plain nn.Linear head whose [Vd, H] gradient fits FUSED_GRAD_BYTES) keeps O(N·H + Vd·H) with
    one block or many."""
    fused = path == "fused"
    on = path != "switched off"
    monkeypatch.setattr(losses, "FUSED_GRAD_BYTES", 1 << 30 if path != "gradient over budget" else 1024)
    n, h, vd = 256, 8, 2048
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(h, vd, bias=False)
    x = torch.randn(1, n, h, generator=g, requires_grad=True)
    e = torch.randn(1, n, h, generator=g)
    arg = torch.randint(0, vd, (1, n), generator=g)
    mask = torch.ones(1, n, dtype=torch.bool)
    dense = saved_bytes(lambda: losses.soft_ce_head(head, x, e, arg, mask, block_bytes=1 << 40, fused=on))
    blocked = saved_bytes(
        lambda: losses.soft_ce_head(head, x, e, arg, mask, block_bytes=4 * vd * 8, fused=on)
    )
    if fused:
        assert 4 * vd * h <= dense < 4 * n * vd / 8  # the [Vd, H] gradient of W is kept, no logits
    else:
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


@pytest.mark.parametrize("mode", ["probabilistic", "greedy_draft", "greedy"])
def test_blocked_acceptance_keeps_no_vocab_sized_tensor(mode):
    """The acceptance objectives' p and z live one block at a time too: O(N·(H + H_t)) kept for backward."""
    n, h, vd = 64, 8, 2048
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(h, vd, bias=False)
    x = torch.randn(1, n, h, generator=g, requires_grad=True)
    final, rows = torch.randn(1, n, h, generator=g), torch.randn(vd, h, generator=g)

    def run(block_bytes):
        return losses.acceptance_head(head, rows, x, final, mode, 0.5, block_bytes=block_bytes)

    dense = saved_bytes(lambda: run(1 << 40))
    blocked = saved_bytes(lambda: run(4 * losses.ACCEPT_ROW_TENSORS * vd * 8))  # 8 rows a block
    assert dense >= 4 * n * vd  # at least one [N, Vd] fp32 tensor
    assert blocked < 4 * n * vd / 8
    for a, b in zip(run(4 * losses.ACCEPT_ROW_TENSORS * vd * 8), run(1 << 40), strict=True):
        torch.testing.assert_close(a, b)


def test_soft_targets_only_at_scored_positions():
    """Soft CE's p is computed at the positions some step scores (not at prompt or padding targets): the same
    values there as over every position, zeros elsewhere, and the loss unchanged."""
    recs = records([14, 9], N_AUX * H_T, H_T, seed=2)  # response from t // 3 on
    batch = collate(recs, steps=3)
    at = losses.scored_positions(losses.scored_steps(batch, 3), batch.input_ids.shape)
    # row 0 (T = 14, response from 4): positions 3..12 predict response tokens 4..13; row 1 (T = 9, from 3): 2..7
    assert at[0].nonzero().squeeze(-1).tolist() == list(range(3, 13))
    assert at[1].nonzero().squeeze(-1).tolist() == list(range(2, 8))
    g = torch.Generator().manual_seed(0)
    rows, w = torch.randn(VD, H_T, generator=g), torch.randn(VD, HID, generator=g)
    every = losses.soft_targets(batch.final, rows, w)
    some = losses.soft_targets(batch.final, rows, w, block_bytes=4 * VD * 3, at=at)
    torch.testing.assert_close(some[0][at], every[0][at])
    assert torch.equal(some[1][at], every[1][at])
    assert some[0][~at].abs().sum() == 0 and some[1][~at].abs().sum() == 0


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
    batch, rows_cut, dropped, shifted = losses.truncate_batch(collate(recs, steps), cap, steps)
    want = collate([cut_record(r, cap) for r in recs], steps)
    for name in ("input_ids", "valid", "loss_mask", "aux", "final", "starts", "starts_valid"):
        assert torch.equal(getattr(batch, name), getattr(want, name)), name
    assert rows_cut == 2  # the 30- and 22-token rows
    assert dropped == int(recs[0].loss_mask[cap:].sum() + recs[2].loss_mask[cap:].sum()) == 14 + 6
    assert shifted == 0  # every row's first 16 positions hold targets
    same, n, k, s = losses.truncate_batch(want, cap, steps)
    assert same is want and n == k == s == 0


def long_prompt(t: int, prompt: int, seed: int) -> Record:
    g = torch.Generator().manual_seed(seed)
    return Record(
        torch.randint(0, VOCAB, (t,), generator=g),
        torch.arange(t) >= prompt,
        torch.randn(t, N_AUX * H_T, generator=g),
        torch.randn(t, H_T, generator=g),
    )


def test_a_cut_that_would_leave_no_target_cuts_the_prompt_side():
    """A 60-token record with a 40-token prompt under a cap of 16: the plain cut keeps no target (the
    trainer died reshaping an empty tensor); the row keeps the window starting at its first chain start."""
    steps, cap = 3, 16
    recs = [
        long_prompt(60, 40, seed=1),
        long_prompt(50, 45, seed=2),
        *records([10], N_AUX * H_T, H_T, seed=3),
    ]
    cut = losses.truncate_batch(collate(recs, steps), cap, steps)
    # first chain start: prompt − 2 − (steps − 1); row 0: 36 → window [36, 52); row 1: 41 > 50 − 16 → [34, 50)
    want = collate(
        [
            cut_record(Record(*(x[o:] for x in dataclasses.astuple(r))), cap)
            for r, o in ((recs[0], 36), (recs[1], 34), (recs[2], 0))
        ],
        steps,
    )
    for name in ("input_ids", "valid", "loss_mask", "aux", "final", "starts", "starts_valid"):
        assert torch.equal(getattr(cut.batch, name), getattr(want, name)), name
    assert cut.batch.starts_valid.any(1).all()  # every row trains
    assert (cut.rows_cut, cut.rows_shifted) == (2, 2)
    assert cut.targets_dropped == (20 - 12) + (5 - 5)  # row 0 keeps response positions 40..51
    with pytest.raises(ValueError, match="max_tokens must be ≥ 3"):
        losses.truncate_batch(collate(recs, steps), 2, steps)


@pytest.mark.parametrize("head", ["eagle3", "mtp2"])
def test_truncated_loss_is_the_full_rows_loss_on_the_kept_targets(head):
    """Causal attention: cutting at the cap changes nothing for the targets before it."""
    draft, rows, aux_w = HEADS[head](1)
    embed = nn.Embedding(VOCAB, HID).requires_grad_(False)
    recs = records([28, 19], aux_w, rows.shape[1], seed=5)
    cap = 15
    cut = losses.truncate_batch(collate(recs, 3), cap, 3).batch
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
    trainer = DraftTrainer(
        draft,
        embed,
        rows,
        OptimSettings(warmup_steps=1, total_steps=4),
        LossSettings(ttt_steps=3, autocast_bf16=False),
        max_seq_tokens=12,
    )
    recs = records([20, 10], aux_w, H_T, seed=6)
    out = trainer.train_step(collate(recs, 3))
    assert trainer.progress.truncated_sequences == 1
    assert trainer.progress.truncated_targets == int(recs[0].loss_mask[12:].sum()) == 8
    assert out["targets"] == sum(
        int((torch.arange(len(r)) + 2 < len(r)).logical_and(torch.roll(r.loss_mask, -2)).sum())
        for r in (cut_record(recs[0], 12), recs[1])
    )
    trainer.train_step(collate(recs[1:], 3))  # short rows: nothing cut, nothing counted
    assert trainer.progress.truncated_sequences == 1
    assert (
        DraftTrainer(draft, embed, rows, OptimSettings(), LossSettings()).max_seq_tokens
        == losses.MAX_SEQ_TOKENS
    )
    with pytest.raises(ValueError, match="max_seq_tokens must be ≥ 3"):
        DraftTrainer(draft, embed, rows, OptimSettings(), LossSettings(), max_seq_tokens=2)


def test_trainer_trains_a_record_whose_cap_leaves_only_prompt():
    """A 600-token record with a 400-token prompt and max_seq_tokens=256 (sized down 10×): one step trains
    on its response instead of dying on an empty tensor."""
    draft, rows, aux_w = HEADS["eagle3"](2)
    trainer = DraftTrainer(
        draft,
        nn.Embedding(VOCAB, HID),
        rows,
        OptimSettings(warmup_steps=1, total_steps=4),
        LossSettings(ttt_steps=3, autocast_bf16=False),
        max_seq_tokens=26,
    )
    out = trainer.train_step(collate([long_prompt(60, 40, seed=7)], 3))
    assert out["targets"] > 0 and math.isfinite(out["loss"])
    assert trainer.progress.truncated_sequences == trainer.progress.prompt_cut_sequences == 1


@pytest.mark.parametrize("head", ["eagle3", "mtp2"])
def test_fp32_training_on_bf16_taps(head):
    """Without autocast, bf16-stored states, head rows and embedding meet the fp32 draft in fp32: the
    step equals the one on the same states given in fp32 (and does not raise a dtype mismatch)."""
    draft, rows, aux_w = HEADS[head](2)
    recs = records([18, 12], aux_w, rows.shape[1], seed=8)
    bf = [Record(r.input_ids, r.loss_mask, r.aux.bfloat16(), r.final.bfloat16()) for r in recs]
    fp = [
        Record(r.input_ids, r.loss_mask, r.aux.bfloat16().float(), r.final.bfloat16().float()) for r in recs
    ]
    emb = nn.Embedding(VOCAB, HID).bfloat16()
    out = []
    for rs, rw, emb_dtype in (
        (bf, rows.bfloat16(), torch.bfloat16),
        (fp, rows.bfloat16().float(), torch.float32),
    ):
        d = copy.deepcopy(draft)
        embed = copy.deepcopy(emb).to(emb_dtype)
        trainer = DraftTrainer(
            d,
            embed,
            rw,
            OptimSettings(warmup_steps=1, total_steps=4),
            LossSettings(ttt_steps=3, autocast_bf16=False),
        )
        assert trainer.autocast_bf16 is False
        out.append(trainer.train_step(collate(rs, 3))["loss"])
    assert math.isfinite(out[0]) and out[0] == pytest.approx(out[1], rel=1e-5)


def test_replaced_head_rows_are_used_in_fp32_training():
    """A HeadSync replaces ``trainer.rows``: the fp32 copy the loss uses follows it."""
    draft, rows, aux_w = HEADS["eagle3"](3)
    trainer = DraftTrainer(
        draft,
        nn.Embedding(VOCAB, HID),
        rows.bfloat16(),
        OptimSettings(),
        LossSettings(ttt_steps=2, autocast_bf16=False),
    )
    new = torch.randn_like(rows).bfloat16()
    trainer.rows = new
    assert trainer.rows is not None and torch.equal(trainer.rows, new)
    assert trainer._rows.dtype == torch.float32 and torch.equal(trainer._rows, new.float())


# --------------------------------------------------------------------------------- objectives on acceptance
def softmax_list(xs: list[float], tau: float = 1.0) -> list[float]:
    return [math.exp(v) for v in log_softmax_list([x / tau for x in xs])]


def test_acceptance_step_by_hand():
    """α of each verify mode for an explicit 3-token p and draft logits z."""
    z = [0.0, 1.0, 2.0]
    p = [0.5, 0.3, 0.2]  # argmax p = 0, argmax q = 2
    q = softmax_list(z)  # ≈ [0.090, 0.245, 0.665]
    zt, pt = torch.tensor([z], dtype=torch.float64), torch.tensor([p], dtype=torch.float64)
    arg = pt.argmax(-1)
    tv = losses.acceptance_step(zt, pt, arg, "probabilistic", 0.5)
    assert tv.item() == pytest.approx(sum(min(a, b) for a, b in zip(p, q, strict=True)), rel=1e-12)
    assert tv.item() == pytest.approx(q[0] + q[1] + p[2], rel=1e-12)  # min picks q, q, p
    for tau in (0.5, 1.0, 0.05):
        qt = softmax_list(z, tau)
        gd = losses.acceptance_step(zt, pt, arg, "greedy_draft", tau)
        assert gd.item() == pytest.approx(sum(a * b for a, b in zip(p, qt, strict=True)), rel=1e-12)
        g = losses.acceptance_step(zt, pt, arg, "greedy", tau)
        assert g.item() == pytest.approx(qt[0], rel=1e-12)
    # small τ: the surrogates approach the exact α (p(argmax q) = 0.2; 1[argmax q = argmax p] = 0)
    assert losses.acceptance_step(zt, pt, arg, "greedy_draft", 0.01).item() == pytest.approx(0.2, abs=1e-6)
    assert losses.acceptance_step(zt, pt, arg, "greedy", 0.01).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="unknown verify mode"):
        losses.acceptance_step(zt, pt, arg, "typical", 1.0)  # type: ignore[arg-type]


def test_acceptance_rows_match_the_monitors_formulas():
    """α = 1 − TV and α̃ → p(argmax q) as the monitor's acceptance_prob computes them (its own code)."""
    from draft_align.acceptance import acceptance_prob

    g = torch.Generator().manual_seed(3)
    z, tl = torch.randn(6, 7, generator=g) * 2, torch.randn(6, 7, generator=g) * 2
    ident = torch.arange(7)
    a, ce, agree = losses.acceptance_rows(z, tl, "probabilistic", 1.0)
    torch.testing.assert_close(a, acceptance_prob(tl, z, ident, "probabilistic", 1.0))
    torch.testing.assert_close(ce, soft_ce_reference(z, torch.log_softmax(tl, -1)))
    assert torch.equal(agree, acceptance_prob(tl, z, ident, "greedy", 0.0))
    a, _, _ = losses.acceptance_rows(z, tl, "greedy_draft", 1e-3)
    torch.testing.assert_close(a, acceptance_prob(tl, z, ident, "greedy_draft", 1.0), atol=1e-4, rtol=0)


def test_step_and_chain_objectives_by_hand():
    # K = 3 steps, one row, three chains: all steps count | step 1 masked (the chain ends there) | step 0 masked
    alpha = torch.tensor([[[0.5, 0.9, 0.3]], [[0.4, 0.2, 0.7]], [[0.9, 0.6, 0.8]]])  # [K, B=1, M=3]
    mask = torch.tensor([[[True, True, False]], [[True, False, True]], [[True, True, True]]])
    loss, accepted = losses.chain_objective(alpha, mask)
    chain0 = 0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.9  # Σ_i Π_{j≤i} α_j = 0.88
    chain1 = 0.9  # only draft 0 scores: draft 1's target is masked
    # chain 2 has no valid first step: it is not a chain the engine drafts (N_0 = 2)
    assert accepted.item() == pytest.approx((chain0 + chain1) / 2)
    assert loss.item() == pytest.approx(((3 - chain0) + (1 - chain1)) / 2)
    w = [1.0, 0.8, 0.64]
    per_step = [
        ((1 - 0.5) + (1 - 0.9)) / 2,
        ((1 - 0.4) + (1 - 0.7)) / 2,
        ((1 - 0.9) + (1 - 0.6) + (1 - 0.8)) / 3,
    ]
    got = losses.step_objective(alpha, mask, w)
    assert got.item() == pytest.approx(sum(a * b for a, b in zip(w, per_step, strict=True)))
    none = torch.zeros_like(mask)
    assert (
        losses.chain_objective(alpha, none)[0].item() == 0.0
        and losses.step_objective(alpha, none, w).item() == 0.0
    )


@pytest.mark.parametrize("mode", ["probabilistic", "greedy_draft", "greedy"])
def test_acceptance_gradients_match_finite_differences(mode):
    g = torch.Generator().manual_seed(5)
    z = (torch.randn(4, 6, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    tl = torch.randn(4, 6, generator=g, dtype=torch.float64) * 1.5
    assert torch.autograd.gradcheck(lambda x: losses.acceptance_rows(x, tl, mode, 0.7)[0], (z,))
    assert torch.autograd.gradcheck(lambda x: losses.acceptance_rows(x, tl, mode, 0.7)[1], (z,))


def test_chain_objective_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(6)
    alpha = torch.rand(3, 2, 4, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.rand(3, 2, 4, generator=g) > 0.3
    assert torch.autograd.gradcheck(lambda a: losses.chain_objective(a, mask)[0], (alpha,))
    assert torch.autograd.gradcheck(lambda a: losses.step_objective(a, mask, [1.0, 0.8, 0.64]), (alpha,))


@pytest.mark.parametrize("block_bytes", [1, 1 << 40])
@pytest.mark.parametrize("mode", ["probabilistic", "greedy_draft", "greedy"])
def test_acceptance_head_gradients_match_finite_differences(block_bytes, mode):
    """Through the checkpointed row blocks too: d/dx and d/dW of the per-row α and CE of z = W x."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    f = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    rows = torch.randn(6, 4, generator=g, dtype=torch.float64)

    def fn(xx, ww):
        a, ce, _ = losses.acceptance_head(
            lambda h: h @ ww.t(), rows, xx, f, mode, 0.8, block_bytes=block_bytes
        )
        return a, ce

    assert torch.autograd.gradcheck(fn, (x, w))


# --------------------------------------------------------------------------------- the acceptance objectives in TTT
ACCEPT_SETTINGS = {
    "tv": dict(kind="tv"),
    "tv+ce": dict(kind="tv", soft_ce_weight=0.3),
    "greedy_surrogate": dict(kind="greedy_surrogate", surrogate_tau=0.7),
    "greedy_surrogate_t0": dict(kind="greedy_surrogate", accept_mode="greedy"),
    "expected_length": dict(kind="expected_length"),
    "expected_length_greedy_draft+ce": dict(
        kind="expected_length", accept_mode="greedy_draft", soft_ce_weight=0.5
    ),
}


def ttt_parts(head: str, lengths: list[int], seed: int = 0, dtype=torch.float32):
    draft, rows, aux_w = HEADS[head](seed)
    embed = nn.Embedding(VOCAB, HID)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(VOCAB, HID, generator=torch.Generator().manual_seed(9)))
    embed.requires_grad_(False)
    recs = records(lengths, aux_w, rows.shape[1], seed=sum(lengths))
    return draft.to(dtype), embed.to(dtype), rows.to(dtype), collate(recs, steps=3)


def settings_loss(draft, embed, rows, batch, name: str):
    return ttt_loss(draft, embed, rows, batch, LossSettings(ttt_steps=3, **ACCEPT_SETTINGS.get(name, {})))


@pytest.mark.parametrize("name", sorted(ACCEPT_SETTINGS))
@pytest.mark.parametrize("head", ["eagle3", "mtp2"])
def test_blocked_acceptance_loss_equals_one_block(head, name, monkeypatch):
    out = []
    for attn_bytes, logit_bytes in ((1 << 40, 1 << 40), (1, 1), (700, 2500)):
        monkeypatch.setattr(layers, "ATTN_BLOCK_BYTES", attn_bytes)
        monkeypatch.setattr(losses, "LOGITS_BLOCK_BYTES", logit_bytes)
        draft, embed, rows, batch = ttt_parts(head, [23, 14])
        loss, stats = settings_loss(draft, embed, rows, batch, name)
        out.append(
            (loss, stats, torch.autograd.grad(loss, [p for p in draft.parameters() if p.requires_grad]))
        )
    whole = out[0]
    assert whole[0].item() > 0 and all(g.abs().sum() > 0 for g in whole[2][-1:])
    for blocked in out[1:]:
        torch.testing.assert_close(blocked[0], whole[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(blocked[1].__dict__.values(), whole[1].__dict__.values(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(blocked[2], whole[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head", ["eagle3", "mtp2"])
def test_acceptance_objectives_report_the_soft_ce_stats(head):
    """StepStats (soft CE, agreement, counts) are the soft objective's whatever is optimised: the p gathered at
    each step's scored positions is the one soft CE uses."""
    draft, embed, rows, batch = ttt_parts(head, [19, 30, 11])
    with torch.no_grad():
        _, want = ttt_loss(draft, embed, rows, batch, LossSettings(ttt_steps=3))
        for name in ACCEPT_SETTINGS:
            _, got = settings_loss(draft, embed, rows, batch, name)
            for a, b in zip(got.__dict__.values(), want.__dict__.values(), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_tv_objective_is_one_minus_the_monitors_alpha_by_hand():
    """loss=tv over one step (K = 1) is the mean of 1 − Σ min(p, q) over the response targets, computed here
    from the draft's logits with the monitor's acceptance_prob."""
    from draft_align.acceptance import acceptance_prob

    draft, embed, rows, batch = ttt_parts("eagle3", [17, 12])
    with torch.no_grad():
        loss, stats = ttt_loss(draft, embed, rows, batch, LossSettings(ttt_steps=1, kind="tv"))
        xs = draft.unroll_hidden(
            batch.aux, embed, batch.input_ids, batch.valid, batch.starts, batch.starts_valid, 1
        )
        alphas = []
        for b in range(batch.input_ids.shape[0]):
            n = int(batch.valid[b].sum())
            for m in range(batch.starts.shape[1]):
                s = int(batch.starts[b, m])
                if batch.starts_valid[b, m] and s + 2 < n and batch.loss_mask[b, s + 2]:
                    z = draft.lm_head(xs[0][b, m])[None]
                    tl = batch.final[b, s + 1][None].float() @ rows.t()
                    alphas.append(acceptance_prob(tl, z, torch.arange(rows.shape[0]), "probabilistic", 1.0))
    assert len(alphas) == int(stats.count[0]) > 5
    assert loss.item() == pytest.approx(1 - torch.cat(alphas).mean().item(), rel=1e-5)


@pytest.mark.parametrize("name", sorted(ACCEPT_SETTINGS) + ["soft"])
def test_unscored_targets_change_nothing_and_scored_ones_do(name):
    """Prompt and padding targets are masked: the target's state where the next token is a prompt token or
    padding never reaches the loss; at a response target it does."""
    draft, embed, rows, batch = ttt_parts("eagle3", [21, 13])
    with torch.no_grad():
        base, _ = settings_loss(draft, embed, rows, batch, name)
        nxt_scored = torch.zeros_like(batch.loss_mask)
        nxt_scored[:, :-1] = (
            batch.loss_mask[:, 1:] & batch.valid[:, 1:]
        )  # position t predicts a response token
        poked = batch.final.clone()
        poked[~nxt_scored] = torch.randn_like(poked[~nxt_scored]) * 5
        assert (~nxt_scored[1]).sum() > 8  # row 1's prompt and its padding
        same, _ = settings_loss(draft, embed, rows, dataclasses.replace(batch, final=poked), name)
        assert same.item() == pytest.approx(base.item(), rel=1e-6)
        scored = batch.final.clone()
        t = int(nxt_scored[0].nonzero()[3])
        scored[0, t] = scored[0, t] + 3
        moved, _ = settings_loss(draft, embed, rows, dataclasses.replace(batch, final=scored), name)
        assert abs(moved.item() - base.item()) > 1e-4


@pytest.mark.parametrize("name", sorted(ACCEPT_SETTINGS))
def test_ttt_acceptance_gradient_matches_finite_differences(name, monkeypatch):
    """ttt_loss's objective (gathers, masks, step weights or chain products, the soft-CE mix, row blocks) in
    float64 by gradcheck, with respect to the unroll's hidden states and the lm_head weight (the unroll itself
    runs in float32 inside: its states are fixed here and given as inputs)."""
    monkeypatch.setattr(losses, "LOGITS_BLOCK_BYTES", 3000)  # several blocks
    draft, embed, rows, batch = ttt_parts("eagle3", [15, 11], seed=3)
    with torch.no_grad():
        xs = draft.unroll_hidden(
            batch.aux, embed, batch.input_ids, batch.valid, batch.starts, batch.starts_valid, 3
        )
    xs = [x.double().requires_grad_() for x in xs]
    w = draft.lm_head.weight.detach().double().requires_grad_()
    batch = dataclasses.replace(batch, final=batch.final.double())

    def fn(x0, x1, x2, ww):
        fixed = SimpleNamespace(unroll_hidden=lambda *_: [x0, x1, x2], lm_head=lambda h: h @ ww.t())
        return settings_loss(fixed, embed, rows.double(), batch, name)[0]

    assert fn(*xs, w).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (*xs, w), fast_mode=True)


@pytest.mark.parametrize("fused", [True, False])
def test_ttt_loss_takes_the_soft_ce_path_its_settings_name(fused, monkeypatch):
    """LossSettings.fused_soft_ce (train.objective.fused_soft_ce / sidecar.train.objective.fused_soft_ce) decides the soft-CE path of
    ttt_loss: the fused log-sum-exp when on, checkpointed blocks (no masked_lse_sum call) when off."""
    calls = []
    real = losses.masked_lse_sum

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(losses, "masked_lse_sum", counted)
    draft, rows, aux_w = HEADS["eagle3"](0)
    embed = nn.Embedding(VOCAB, HID)
    embed.requires_grad_(False)
    batch = collate(records([9, 14], aux_w, rows.shape[1], seed=5), steps=3)
    ttt_loss(draft, embed, rows, batch, LossSettings(ttt_steps=3, kind="soft", fused_soft_ce=fused))
    assert bool(calls) is fused
