"""draft_align.heads.lora: adapters over a frozen draft (EAGLE-3 and MTP), merged publish == the peft
model, adapter-only deltas rebuilt to the recorded sha256, and deltas for another base refused."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from draft_align.heads.eagle3 import DraftConfigError, Eagle3Config, Eagle3Draft
from draft_align.heads.lora import (
    ADAPTER_FILE,
    AdapterMismatchError,
    LoraSettings,
    apply_lora,
    engine_sha256,
    export_adapter,
    is_lora,
    load_adapter,
    lora_state_dict,
    merged,
    publish_adapter,
)
from draft_align.heads.mtp import MTPDraft
from draft_align.publish.export import export_draft, load_draft, read_manifest

V, H, L = 48, 32, 6
AUX = (1, 3, 4)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(L, V, H).requires_grad_(False)


def eagle(target, seed=0) -> Eagle3Draft:
    torch.manual_seed(seed)
    d = Eagle3Draft(Eagle3Config.from_target(target.config, 24, AUX, torch_dtype="float32"))
    for p in d.parameters():
        nn.init.normal_(p, std=0.2)
    d.set_vocab(torch.arange(0, 48, 2))
    return d


def mtp(target, seed=0) -> MTPDraft:
    torch.manual_seed(seed)
    d = MTPDraft.attach(target, depth=2)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return d


def inputs(target, draft, seed=3, t=12):
    ids = torch.randint(0, V, (1, t), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in draft.cfg.aux_layer_ids], -1)
    starts = torch.arange(0, t - 1)[None]
    return (aux, target.model.embed_tokens, ids, torch.ones(1, t, dtype=torch.bool), starts,
            torch.ones_like(starts, dtype=torch.bool), 3)


def perturb_adapters(d, seed=5, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def logits(d, args):
    with torch.no_grad():
        return torch.stack([x for x in d.eval().unroll(*args)])


def publish(d, path, target, dtype=torch.bfloat16, version=1):
    return export_draft(d, path, target_config=target.config, target_name="tiny", metrics={}, draft_version=version,
                        policy_version=0, tokenizer_fingerprint="fp", dtype=dtype)


# ---------------------------------------------------------------- adapters
@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_apply_freezes_base_and_starts_as_identity(target, kind):
    d = eagle(target) if kind == "eagle3" else mtp(target)
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
        apply_lora(eagle(target), LoraSettings(target_modules=("qkv_proj",)))
    with pytest.raises(DraftConfigError, match="shared, frozen"):
        apply_lora(mtp(target), LoraSettings(target_modules=("lm_head",)))
    with pytest.raises(DraftConfigError, match="rank"):
        LoraSettings(rank=0)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_merged_publish_equals_the_peft_model(target, tmp_path, kind):
    d = eagle(target) if kind == "eagle3" else mtp(target)
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

    from draft_align.heads.lora import _strip_adapters

    c = copy.deepcopy(d)
    _strip_adapters(c)
    return c


# ---------------------------------------------------------------- adapter-only deltas
@pytest.fixture(params=["eagle3", "mtp"])
def published_base(request, target, tmp_path):
    """A base draft published in bf16 and the LoRA draft trained over it (loaded back from the folder)."""
    d = eagle(target) if request.param == "eagle3" else mtp(target)
    base_dir = publish(d, tmp_path / "base" / "v0001", target)
    base, _ = load_draft(base_dir)
    apply_lora(base, LoraSettings(rank=2, alpha=4.0, target_modules=("q_proj", "gate_proj")))
    perturb_adapters(base, scale=0.05)
    return request.param, base_dir, base


def test_delta_round_trip_matches_sha(target, tmp_path, published_base):
    kind, base_dir, lora_draft = published_base
    info = export_adapter(lora_draft, tmp_path / "adapters" / "v0002", base_dir, draft_version=2, policy_version=3)
    man = json.loads((info.path / "manifest.json").read_text())
    assert man["base"]["sha256"] == read_manifest(base_dir)["files"]["model.safetensors"]["sha256"]
    assert man["lora"]["rank"] == 2 and man["merged_sha256"] == info.merged_sha256
    full = publish(lora_draft, tmp_path / "full" / "v0002", target, version=2)  # the merged publish
    full_sha = read_manifest(full)["files"]["model.safetensors"]["sha256"]
    assert info.merged_sha256 == full_sha  # delta + base rebuilds exactly the merged engine weights
    assert info.bytes < 0.5 * (full / "model.safetensors").stat().st_size
    rebuilt, man2 = load_adapter(info.path, base_dir)
    assert engine_sha256(rebuilt) == full_sha and man2["draft_version"] == 2
    out = publish_adapter(info.path, base_dir, tmp_path / "pub" / "v0002", target_config=target.config,
                          target_name="tiny", tokenizer_fingerprint="fp")
    assert read_manifest(out)["files"]["model.safetensors"]["sha256"] == full_sha
    assert read_manifest(out)["lora_delta"]["base_sha256"] == man["base"]["sha256"]


def test_delta_for_another_base_is_refused(target, tmp_path, published_base):
    kind, base_dir, lora_draft = published_base
    info = export_adapter(lora_draft, tmp_path / "adapters" / "v0002", base_dir, draft_version=2, policy_version=0)
    other = eagle(target, seed=9) if kind == "eagle3" else mtp(target, seed=9)
    other_dir = publish(other, tmp_path / "other" / "v0001", target)
    with pytest.raises(AdapterMismatchError, match="trained over base draft sha256"):
        load_adapter(info.path, other_dir)
    dest = tmp_path / "pub" / "v0002"
    with pytest.raises(AdapterMismatchError):
        publish_adapter(info.path, other_dir, dest, target_config=target.config, target_name="t",
                        tokenizer_fingerprint="fp")
    assert not dest.exists()
    assert not (tmp_path / "pub").exists() or not any((tmp_path / "pub").iterdir())  # no temp folder left
    with pytest.raises(AdapterMismatchError, match="trained over another base"):  # export checks its base too
        export_adapter(lora_draft, tmp_path / "adapters" / "v0003", other_dir, draft_version=3, policy_version=0)
    assert not (tmp_path / "adapters" / "v0003").exists()
    # a tampered adapter file, or a tampered recorded merge, is refused as well
    data = bytearray((info.path / ADAPTER_FILE).read_bytes())
    data[-1] ^= 1
    (info.path / ADAPTER_FILE).write_bytes(bytes(data))
    with pytest.raises(AdapterMismatchError, match="corrupt"):
        load_adapter(info.path, base_dir)


def test_recorded_merge_sha_is_checked(tmp_path, published_base):
    _, base_dir, lora_draft = published_base
    info = export_adapter(lora_draft, tmp_path / "a" / "v0002", base_dir, draft_version=2, policy_version=0)
    mpath = info.path / "manifest.json"
    man = json.loads(mpath.read_text())
    man["merged_sha256"] = "0" * 64
    mpath.write_text(json.dumps(man))
    with pytest.raises(AdapterMismatchError, match="hash to"):
        load_adapter(info.path, base_dir)


# ---------------------------------------------------------------- training
@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_trainer_trains_only_adapters_and_resumes(target, tmp_path, kind):
    from draft_align.hf.parts import frozen_embedding, head_rows
    from draft_align.tap.hooks import HFTap
    from draft_align.train.records import Record, collate
    from draft_align.train.trainer import DraftTrainer, LossSettings, OptimSettings

    def build():
        d = eagle(target) if kind == "eagle3" else mtp(target)
        apply_lora(d, LoraSettings(rank=4, alpha=8.0))
        rows = head_rows(target, d.draft_to_target)
        return DraftTrainer(d, frozen_embedding(target), rows, OptimSettings(lr=1e-2, warmup_steps=1, total_steps=8),
                            LossSettings(ttt_steps=2, autocast_bf16=False))

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
