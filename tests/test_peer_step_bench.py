"""benchmarks/peer_step.py: speculators' EAGLE-3 model built there is draft_align's draft (same trainable and
frozen tensors, same draft logits at every TTT step), its packed batch holds the same records, one step of
each side trains the same parameters, and render_peer renders what measure_peer returns."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("speculators", reason="speculators not installed (pip install -e '.[speculators]')")

from benchmarks.peer_step import (  # noqa: E402
    SpeculatorsStep,
    build_draft_align,
    build_speculators,
    render_peer,
    speculators_batch,
    speculators_name,
)

K, SEQ, TOKENS = 2, 24, 48  # 2 records of 24 tokens


def speculators_step_logits(
    model, aux: torch.Tensor, input_ids: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Draft logits of speculators' forward at every TTT step, fed our ``x[i + 1]`` as its ``input_ids[i]``
    (its teacher forcing pads with 0 where our unroll clamps: compare positions < T − 1 − j only)."""
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach()))
    try:
        shifted = torch.cat((input_ids[:, 1:], input_ids.new_zeros(1, 1)), dim=1)
        with torch.no_grad():
            model(
                hidden_states=aux,
                input_ids=shifted,
                document_ids=torch.zeros_like(input_ids),
                ttt_steps=steps,
            )
    finally:
        hook.remove()
    return logits


@pytest.fixture(scope="module")
def built():
    torch.set_num_threads(1)
    trainer, batch, cfg = build_draft_align(K, SEQ, TOKENS)
    model = build_speculators(trainer, cfg, K, "sdpa")
    return trainer, batch, cfg, model


def test_same_draft_same_trainable_tensors(built) -> None:
    trainer, _, _, model = built
    ours = {speculators_name(n): p for n, p in trainer.draft.named_parameters() if p.requires_grad}
    theirs = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(ours) == set(theirs) and "lm_head.weight" not in ours  # both freeze the head
    assert "layers.0.self_attn.q_proj.weight" in ours
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    assert torch.equal(model.lm_head.weight, trainer.draft.lm_head.weight)
    assert torch.equal(model.embed_tokens.weight, trainer.embed.weight)
    assert torch.equal(model.verifier_lm_head.weight, trainer.rows.float())


def test_same_draft_logits_every_step(built) -> None:
    """fp32, no autocast: speculators' forward on the first record = draft_align's unroll (as in
    tests/publish/test_speculators_client.py, here on the model the benchmark builds)."""
    trainer, batch, _, model = built
    model.eval()
    aux = batch.aux[:1].float()
    x = batch.input_ids[:1]
    theirs = speculators_step_logits(model, aux, x, K)
    t = x.shape[1]
    every = torch.ones(1, t, dtype=torch.bool)
    with torch.no_grad():
        mine = trainer.draft.unroll(aux, trainer.embed, x, every, torch.arange(t).unsqueeze(0), every, K)
    for j in range(K):
        n = t - 1 - j
        a, b = theirs[j][0, :n], mine[j][0, :n]
        scale = b.abs().max().item()  # build() draws every weight, norms included, at std 0.02: small logits
        assert scale > 0.01
        assert (a - b).abs().max().item() <= 1e-4 * scale, (j, (a - b).abs().max().item(), scale)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_packed_batch_holds_the_records(built) -> None:
    _, batch, _, _ = built
    packed = speculators_batch(batch, TOKENS, torch.bfloat16)
    assert packed["input_ids"].shape == (1, TOKENS)
    n = SEQ - 1  # shift_batch drops one position per record
    assert packed["document_ids"][0].tolist() == [0] * n + [1] * n + [-1] * 2
    assert torch.equal(packed["input_ids"][0, :n], batch.input_ids[0, 1:])
    assert torch.equal(packed["hidden_states"][0, :n], batch.aux[0, :-1])
    assert int(packed["loss_mask"].sum()) == int(batch.loss_mask[:, 1:].sum())


def test_one_step_each_trains_the_same_parameters(built) -> None:
    trainer, batch, _, model = built
    packed = speculators_batch(batch, TOKENS, torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = SpeculatorsStep(model, packed, K, autocast=True)()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    ours_before = {n: p.detach().clone() for n, p in trainer.draft.named_parameters()}
    ours = trainer.train_step(batch)
    ours_changed = {
        speculators_name(n) for n, p in trainer.draft.named_parameters() if not torch.equal(p, ours_before[n])
    }
    assert changed == ours_changed and "fc.weight" in changed and "lm_head.weight" not in changed
    assert torch.isfinite(torch.tensor([out["loss"], ours["loss"]])).all()


def test_render_peer_table() -> None:
    side = {"step_s_median": 2.0, "positions_per_s": 500.0, "roofline_fraction": 0.25}
    row = {
        "k": 7,
        "records": 3,
        "positions": 1000,
        "packed_len": 1536,
        "useful_gflop": 400.0,
        "executed_gflop": {"draft_align": 420.0, "speculators": 900.0},
        "draft_align": side,
        "speculators": {**side, "step_s_median": 7.0, "positions_per_s": 142.9, "roofline_fraction": 0.07},
        "ratio": 3.5,
    }
    res = {
        "seq_len": 512,
        "reps": 5,
        "warmup": 2,
        "threads": 2,
        "autocast_bf16": True,
        "speculators_version": "0.9.0",
        "speculators_loss": "kl_div (eager)",
        "speculators_attn": "sdpa",
        "roofline_dtype": "bf16",
        "roofline_gflops": 800.0,
        "rows": [row],
    }
    text = render_peer(res)
    lines = text.splitlines()
    assert lines[0].startswith("| K | draft_align step s (median) | speculators step s (median) |")
    assert lines[2] == "| 7 | 2.000 | 7.000 | **3.50×** | 500 | 143 | 0.25 | 0.07 |"
    assert "recipes run it" not in text and "Noise check" not in text  # neither measured here
    row["draft_align"] = {**side, "step_s": [2.0, 1.5, 4.0]}
    row["speculators"] = {**row["speculators"], "step_s": [7.0, 6.0, 9.0]}
    res["roofline_gflops_runs"] = [800.0, 500.0]
    assert "K = 7: 1.50–4.00 / 6.00–9.00 s, fastest 4.00×. Roofline measurements 800 and 500" in render_peer(
        res
    )
