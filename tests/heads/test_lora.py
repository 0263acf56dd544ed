"""draft_align.heads.lora: adapters over a frozen draft (EAGLE-3 and MTP), merged publish == the peft
model, training touches only the adapters (deltas: tests/publish/test_lora_delta.py)."""

from __future__ import annotations

import pytest
import torch

from draft_align.heads.draft_head import DraftConfigError
from draft_align.heads.lora import (
    LoraSettings,
    apply_lora,
    is_lora,
    lora_state_dict,
    merged,
)
from draft_align.publish import engine_sha256, export_draft, load_draft
from tests.helpers import perturb_adapters, random_draft

V, H, L = 48, 32, 6


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(L, V, H).requires_grad_(False)


def inputs(target, draft, seed=3, t=12):
    ids = torch.randint(0, V, (1, t), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in draft.cfg.aux_layer_ids], -1)
    starts = torch.arange(0, t - 1)[None]
    return (
        aux,
        target.model.embed_tokens,
        ids,
        torch.ones(1, t, dtype=torch.bool),
        starts,
        torch.ones_like(starts, dtype=torch.bool),
        3,
    )


def logits(d, args):
    with torch.no_grad():
        return torch.stack([x for x in d.eval().unroll(*args)])


def publish(d, path, target, dtype=torch.bfloat16, version=1):
    return export_draft(
        d,
        path,
        target_config=target.config,
        target_name="tiny",
        metrics={},
        draft_version=version,
        policy_version=0,
        tokenizer_fingerprint="fp",
        dtype=dtype,
    )


# ---------------------------------------------------------------- adapters
@pytest.mark.parametrize("kind", ["eagle3", "llama_block_mtp"])
def test_apply_freezes_base_and_starts_as_identity(target, kind):
    d = random_draft(kind, target)
    args = inputs(target, d)
    before = logits(d, args)
    apply_lora(d, LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj")))
    assert is_lora(d)
    trainable = [n for n, p in d.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(lora_state_dict(d)) == 2 * 3 * (1 if kind == "eagle3" else 2)
    torch.testing.assert_close(logits(d, args), before)  # B = 0: the adapted draft starts as the base


def test_bad_targets_are_refused(target):
    with pytest.raises(DraftConfigError, match="match no Linear"):
        apply_lora(random_draft("eagle3", target), LoraSettings(target_modules=("qkv_proj",)))
    with pytest.raises(DraftConfigError, match="shared, frozen"):
        apply_lora(random_draft("llama_block_mtp", target), LoraSettings(target_modules=("lm_head",)))
    with pytest.raises(DraftConfigError, match="rank"):
        LoraSettings(rank=0)


@pytest.mark.parametrize("kind", ["eagle3", "llama_block_mtp"])
def test_merged_publish_equals_the_peft_model(target, tmp_path, kind):
    d = random_draft(kind, target)
    targets = ("q_proj", "k_proj", "o_proj", "up_proj") + (("fc",) if kind == "eagle3" else ("eh_proj",))
    apply_lora(d, LoraSettings(rank=4, alpha=8.0, target_modules=targets))
    perturb_adapters(d)
    args = inputs(target, d)
    want = logits(d, args)
    plain = merged(d)
    assert not is_lora(plain) and is_lora(d)  # the trained draft keeps its adapters
    torch.testing.assert_close(logits(plain, args), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(without_adapters(d), args), want, atol=1e-3)  # the adapters mattered
    out = publish(d, tmp_path / "v1", target, dtype=torch.float32)  # export merges the adapters itself
    loaded, man = load_draft(out)
    assert type(loaded) is type(plain) and not is_lora(loaded)
    torch.testing.assert_close(logits(loaded, args), want, atol=1e-5, rtol=1e-5)
    assert man["files"]["model.safetensors"]["sha256"] == engine_sha256(plain, torch.float32)


def without_adapters(d):
    import copy

    from draft_align.heads.lora import strip_adapters

    c = copy.deepcopy(d)
    strip_adapters(c)
    return c


# ---------------------------------------------------------------- training
@pytest.mark.parametrize("kind", ["eagle3", "llama_block_mtp"])
def test_trainer_trains_only_adapters_and_resumes(target, tmp_path, kind):
    from draft_align.hf.capture import HFTap
    from draft_align.hf.parts import frozen_embedding, head_rows
    from draft_align.train.objective import LossSettings
    from draft_align.train.records import Record, collate
    from draft_align.train.trainer import DraftTrainer, OptimSettings

    def build():
        d = random_draft(kind, target)
        apply_lora(d, LoraSettings(rank=4, alpha=8.0))
        rows = head_rows(target, d.draft_to_target)
        return DraftTrainer(
            d,
            frozen_embedding(target),
            rows,
            OptimSettings(lr=1e-2, warmup_steps=1, total_steps=8),
            LossSettings(ttt_steps=2, autocast_bf16=False),
        )

    tr = build()
    d = tr.draft
    ids = torch.randint(0, V, (4, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), HFTap(target, d.cfg.aux_layer_ids, capture_final=True) as tap:
        target(ids)
        cap = tap.pop()
    recs = [Record(ids[i], torch.arange(14) >= 3, cap.aux[i], cap.final[i]) for i in range(4)]
    frozen = {n: p.clone() for n, p in d.named_parameters() if "lora_" not in n}
    lora0 = {k: v.clone() for k, v in lora_state_dict(d).items()}
    for s in range(3):
        tr.train_step(collate(recs[s % 2 * 2 : s % 2 * 2 + 2], 2))
    assert all(torch.equal(p, frozen[n]) for n, p in d.named_parameters() if "lora_" not in n)
    assert any(not torch.equal(v, lora0[k]) for k, v in lora_state_dict(d).items())
    tr.save(tmp_path / "ckpt")
    again = build()
    again.load(tmp_path / "ckpt")
    for k, v in lora_state_dict(again.draft).items():
        assert torch.equal(v, lora_state_dict(d)[k])
    opt_params = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for n, p in d.named_parameters() if "lora_" in n}
