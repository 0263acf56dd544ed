"""draft_align.sidecar surviving what a cluster does to it: a record whose cap leaves only prompt, versions at
the end of the wire's range, a restart under replayed traffic, and a second sidecar on the same run."""

from __future__ import annotations

import pytest
import torch

from draft_align.sidecar.ingest import Ingest
from draft_align.sidecar.state import Rates, SidecarState
from draft_align.train.replay import ReplayBuffer
from draft_align.wire.messages import HeadSync
from draft_align.wire.packing import pack_sequences

H, V, AUX = 8, 50, (1, 2, 3)


def _ingest() -> Ingest:
    head = HeadSync.make_dummy(hidden_size=H, vocab_size=V)
    return Ingest(
        ReplayBuffer(10_000, 2.0, 0, 0),
        SidecarState(),
        Rates(),
        aux_ids=AUX,
        hidden=H,
        vocab=V,
        draft_to_target=head.draft_to_target,
    )


def _seq(t: int, prompt: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(3, V, (t,), generator=g),
        "loss_mask": torch.arange(t) >= prompt,
        "aux_hidden": torch.randn(t, len(AUX) * H, generator=g),
        "final_hidden": torch.randn(t, H, generator=g),
    }


def _batch(seqs, *, version: int = 0, step: int = 0, batch_id: int = 0):
    return pack_sequences(
        seqs,
        run_id="dummy",
        policy_version=version,
        source_rank=0,
        batch_id=batch_id,
        step=step,
        aux_layer_ids=AUX,
        hidden_size=H,
        vocab_size=V,
        final_norm="post",
        temperature=1.0,
    )


# ------------------------------------------------------------------ 1: a cut must keep targets
def test_a_record_without_a_trainable_target_is_dropped_counted():
    """A response that starts at position 1 has no chain start (a step predicts t + 2 from t): dropped at
    ingest, counted, and the count reaches the monitoring row."""
    from draft_align.sidecar.state import sidecar_stats

    ing = _ingest()
    ing.on_batch(_batch([_seq(2, 1, 0), _seq(6, 1, 1), _seq(5, 3, 2)]))
    assert ing.state.untrainable_records == 1 and ing.buffer.stats()["records"] == 2
    stats = sidecar_stats(ing.state, ing.buffer.stats(), Rates(), {})
    assert stats.to_dict()["untrainable_records"] == 1


@pytest.mark.parametrize("sidecar_world", [{"sidecar.max_seq_tokens": 12}], indirect=True)
def test_records_whose_cap_leaves_only_prompt_train_instead_of_killing_the_loop(sidecar_world, until):
    """Chat prompts of the tiny world are longer than 12 tokens: the plain cut left no target and the
    next train step raised 'cannot reshape tensor of 0 elements'."""
    recipe, sc, feeder = sidecar_world
    feeder.step(0, 0)
    assert until(lambda: sc.state.monitor_rows >= 1, 30, every=lambda: sc.drain(0.1, 100))
    for _ in range(3):
        assert sc.train_one()
    assert sc.state.train_steps == 3
    assert sc.trainer.progress.prompt_cut_sequences > 0
