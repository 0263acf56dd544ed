"""draft_align.heads.mtp and publish.mtp_export: unroll == KV-cached steps, layouts round-trip, clear
import errors, a detached trunk, the estimators and the lossless reference decoder with an MTP head."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draft_align.heads.eagle3 import DraftConfigError
from draft_align.heads.mtp import MTPConfig, MTPDraft
from draft_align.hf.parts import decoder_parts
from draft_align.publish import export as ex
from draft_align.publish.export import ExportError
from draft_align.publish.mtp_export import (
    export_mtp_draft,
    from_layout,
    head_copies,
    import_mtp,
    import_mtp_from_folder,
    layout_names,
    load_mtp_draft,
    to_layout,
    with_layout,
)
from draft_align.tap.hooks import HFTap

V, H, L = 48, 32, 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama):
    model = tiny_llama(L, V, H)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaky: a draft has something to learn
    model.generation_config.pad_token_id = 0
    return model


def make_head(target, layout="deepseek_v3", depth=1, seed=1, noise=0.1) -> MTPDraft:
    torch.manual_seed(seed)
    d = MTPDraft.attach(target, depth=depth, layout=layout)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.add_(noise * torch.randn_like(p))
    return d.eval()


def final_hidden(target, ids):
    with torch.no_grad():
        return target(ids, output_hidden_states=True).hidden_states[-1]


# ---------------------------------------------------------------- structure
def test_config_is_eagle3_shaped_for_the_pipeline(target):
    d = make_head(target)
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
@pytest.mark.parametrize(("layout", "depth"), [("deepseek_v3", 1), ("deepseek_v3", 2), ("qwen3_next", 1),
                                               ("qwen3_next", 3)])
def test_unroll_equals_kv_cached_steps(target, layout, depth):
    d = make_head(target, layout, depth)
    t, k = 12, 4
    ids = torch.randint(0, V, (1, t), generator=torch.Generator().manual_seed(3))
    fin = final_hidden(target, ids)
    emb = decoder_parts(target)[0]
    starts = torch.arange(0, t - 1)[None]
    with torch.no_grad():
        q = d.unroll(fin, emb, ids, torch.ones(1, t, dtype=torch.bool), starts, torch.ones_like(starts, dtype=torch.bool), k)
    checked = 0
    for s in range(0, t - 1 - k):
        cache = d.new_cache()
        # committed context in two chunks (as the decoder appends it), then the chain
        lg, h = d.step(cache, fin[0, : s // 2 + 1], emb(ids[0, 1 : s // 2 + 2]), torch.arange(s // 2 + 1), True)
        if s // 2 + 1 < s + 1:
            lg, h = d.step(cache, fin[0, s // 2 + 1 : s + 1], emb(ids[0, s // 2 + 2 : s + 2]),
                           torch.arange(s // 2 + 1, s + 1), True)
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
    d = make_head(target, "deepseek_v3")
    q_ = with_layout(d, "qwen3_next")
    ids = torch.randint(1, V, (1, 10), generator=torch.Generator().manual_seed(4))
    ids2 = ids.clone()
    ids2[0, 1] = (ids[0, 1] + 1) % V
    emb = decoder_parts(target)[0]
    fin = final_hidden(target, ids)  # the same hidden for both: only the token input differs
    starts = torch.zeros(1, 1, dtype=torch.long)

    def first(head, x):
        with torch.no_grad():
            return head.unroll(fin, emb, x, torch.ones(1, 10, dtype=torch.bool), starts, torch.ones(1, 1, dtype=torch.bool), 1)[0]

    assert torch.equal(first(d, ids), first(d, ids2))
    assert not torch.allclose(first(q_, ids), first(q_, ids2))


# ---------------------------------------------------------------- layouts: round trip and errors
def target_config(**kw):
    return dataclasses.replace(target_cfg_ns(), **kw) if kw else target_cfg_ns()


@dataclasses.dataclass
class target_cfg_ns:  # noqa: N801 - a stand-in for an HF config
    num_hidden_layers: int = L
    hidden_size: int = H
    vocab_size: int = V
    max_position_embeddings: int = 128
    rope_parameters: dict = dataclasses.field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    bos_token_id: int = 1
    eos_token_id: int = 2


@pytest.mark.parametrize(("layout", "depth"), [("deepseek_v3", 1), ("deepseek_v3", 2), ("qwen3_next", 1)])
def test_export_import_round_trip_identical(target, tmp_path, layout, depth):
    d = make_head(target, layout, depth)
    out = export_mtp_draft(d, tmp_path / "v1", target_config=target.config, target_name="tiny", metrics={"x": 1.0},
                           draft_version=1, policy_version=0, tokenizer_fingerprint="fp", dtype=torch.float32)
    man = ex.read_manifest(out)  # sha256 of both files verified
    assert man["format"] == "draft_align.mtp" and man["layout"] == layout
    assert man["mtp_config"]["depth"] == depth
    import safetensors.torch

    names = set(safetensors.torch.load_file(str(out / "model.safetensors")))
    copies = {c for _, c in head_copies(d.cfg, layout)}
    assert names == set(layout_names(d.cfg, layout).values()) | copies
    assert len(copies) == (2 * (depth - 1) if layout == "deepseek_v3" else 0)
    if layout == "deepseek_v3":
        assert f"model.layers.{L}.eh_proj.weight" in names and f"model.layers.{L}.shared_head.head.weight" in names
        assert f"model.layers.{L + depth - 1}.mlp.down_proj.weight" in names
        assert f"model.layers.{L + depth - 1}.shared_head.head.weight" in names
    else:
        assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= names
    back, _ = load_mtp_draft(out)
    a, b = d.engine_state_dict(), back.engine_state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and through the generic loader / compatibility check (dispatch on the manifest's format)
    back2, man2 = ex.load_draft(out)
    assert isinstance(back2, MTPDraft) and man2["layout"] == layout
    ex.check_compatible(man2, target.config, "fp")
    with pytest.raises(ExportError, match="hidden size"):
        ex.check_compatible(man2, target_config(hidden_size=H * 2), None)


def test_import_from_a_whole_checkpoint_ignores_the_trunk(target):
    d = make_head(target, "deepseek_v3", depth=2)
    ckpt = {**target.state_dict(), **to_layout(d)}
    for i in range(2):  # DeepSeek-V3 checkpoints carry the shared embedding per MTP layer
        ckpt[f"model.layers.{L + i}.embed_tokens.weight"] = target.model.embed_tokens.weight
        ckpt[f"model.layers.{L + i}.shared_head.norm.weight"] = d.norm.weight
        ckpt[f"model.layers.{L + i}.shared_head.head.weight"] = d.lm_head.weight
    back = import_mtp(ckpt, d.cfg)
    for k, v in d.engine_state_dict().items():
        assert torch.equal(v, back.engine_state_dict()[k]), k
    q = make_head(target, "qwen3_next", depth=1)
    ckpt = {**target.state_dict(), **{k: v for k, v in to_layout(q).items() if k != "lm_head.weight"}}
    ckpt["lm_head.weight"] = q.lm_head.weight  # the target's own head, as in a Qwen3-Next checkpoint
    back = import_mtp(ckpt, q.cfg)
    assert torch.equal(back.layers[0].eh_proj.weight, q.layers[0].eh_proj.weight)


@pytest.mark.parametrize("layout", ["deepseek_v3", "qwen3_next"])
def test_import_from_a_sharded_checkpoint_folder(target, tmp_path, layout):
    import safetensors.torch

    d = make_head(target, layout, depth=1)
    full = {k: v.contiguous().clone() for k, v in {**target.state_dict(), **to_layout(d)}.items()}
    names = sorted(full)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):  # two shards, MTP tensors in either
        safetensors.torch.save_file({k: full[k] for k in part}, str(tmp_path / f"model-{i:05d}-of-00002.safetensors"))
    cfg = target.config.to_dict()
    cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    back = import_mtp_from_folder(tmp_path, layout)
    for k, v in d.engine_state_dict().items():
        assert torch.equal(v, back.engine_state_dict()[k]), k
    with pytest.raises(ExportError, match="depth mismatch"):
        import_mtp_from_folder(tmp_path, layout, depth=2)
    if layout == "deepseek_v3":  # an MoE block (DeepSeek-V3's own) is not this head's Llama block
        moe = {**full, f"model.layers.{L}.mlp.experts.0.gate_proj.weight": torch.zeros(4, H)}
        for f in tmp_path.glob("*.safetensors"):
            f.unlink()
        safetensors.torch.save_file(moe, str(tmp_path / "model.safetensors"))
        with pytest.raises(ExportError, match=r"unexpected \['model.layers.4.mlp.experts.0.gate_proj.weight'\]"):
            import_mtp_from_folder(tmp_path, layout)


def test_qwen3_next_without_head_needs_the_targets(target):
    q = make_head(target, "qwen3_next")
    mtp_only = {k: v for k, v in to_layout(q).items() if k.startswith("mtp.")}
    with pytest.raises(ExportError, match="no lm_head.weight.*pass the target's lm_head"):
        from_layout(mtp_only, q.cfg)
    back = import_mtp(mtp_only, q.cfg, lm_head=target.lm_head.weight)
    assert torch.equal(back.lm_head.weight, target.lm_head.weight)


def test_import_errors_are_clear(target):
    d = make_head(target, "deepseek_v3", depth=1)
    sd = to_layout(d)
    with pytest.raises(ExportError, match="depth mismatch: the checkpoint has 1 MTP layers, the config expects 2"):
        from_layout(sd, dataclasses.replace(d.cfg, depth=2))
    big = MTPConfig.from_target(LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=L,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V,
                                            max_position_embeddings=128))
    with pytest.raises(ExportError, match=r"hidden size mismatch: model.layers.4.eh_proj.weight is \[32, 64\]"):
        from_layout(sd, big)
    missing = {k: v for k, v in sd.items() if not k.endswith("hnorm.weight")}
    with pytest.raises(ExportError, match=r"missing \['model.layers.4.hnorm.weight'\]"):
        from_layout(missing, d.cfg)
    extra = {**sd, "model.layers.4.mtp_block.bogus.weight": torch.zeros(1)}
    with pytest.raises(ExportError, match="unexpected.*mtp_block.bogus"):
        from_layout(extra, d.cfg)
    qsd = to_layout(with_layout(d, "qwen3_next"))
    with pytest.raises(ExportError, match="no MTP weights in the deepseek_v3 layout.*looks like the qwen3_next"):
        from_layout(qsd, d.cfg)
    with pytest.raises(ExportError, match="numbered from the target's"):
        from_layout(sd, dataclasses.replace(d.cfg, target_num_layers=2))
    with pytest.raises(ExportError, match="would change its outputs"):
        to_layout(d, "qwen3_next")
    deep = make_head(target, "qwen3_next", depth=2)
    with pytest.raises(ExportError, match="shares mtp.fc"):
        to_layout(deep)


def test_load_refuses_a_tampered_or_mismatched_folder(target, tmp_path):
    d = make_head(target, "deepseek_v3")
    out = export_mtp_draft(d, tmp_path / "v1", target_config=target.config, target_name="tiny", metrics={},
                           draft_version=1, policy_version=0, tokenizer_fingerprint="fp")
    import json

    man = json.loads((out / "manifest.json").read_text())
    man["mtp_config"]["depth"] = 2
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ExportError, match="depth mismatch"):
        load_mtp_draft(out)
    with pytest.raises(ExportError, match="vocab size mismatch"):
        export_mtp_draft(d, tmp_path / "v2", target_config=target_config(vocab_size=V + 1), target_name="t",
                         metrics={}, draft_version=2, policy_version=0, tokenizer_fingerprint="fp")
    assert not (tmp_path / "v2").exists()


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
    q = d.unroll(fin, tgt.model.embed_tokens, ids, torch.ones(2, 10, dtype=torch.bool), starts,
                 torch.ones_like(starts, dtype=torch.bool), 4)  # module 1 runs steps 1 and 3: its q/k matter
    sum(x.logsumexp(-1).sum() for x in q).backward()
    assert all(p.grad is None for p in tgt.parameters())
    assert d.lm_head.weight.grad is None
    no_grad = [n for n, p in d.named_parameters() if n != "lm_head.weight" and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert not no_grad


# ---------------------------------------------------------------- trainer, estimators, decoder
def trained_head(target, layout="deepseek_v3", depth=1, steps=60, kind="soft"):
    from draft_align.hf.parts import frozen_embedding
    from draft_align.train.records import Record, collate
    from draft_align.train.trainer import DraftTrainer, LossSettings, OptimSettings

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
    tr = DraftTrainer(d, frozen_embedding(target), target.lm_head.weight.detach(),
                      OptimSettings(lr=3e-3, warmup_steps=2, total_steps=steps),
                      LossSettings(ttt_steps=3, step_decay=0.6, kind=kind, autocast_bf16=False))
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
    from draft_align.monitor.records import record_alpha
    from draft_align.train.records import Record, TappedRecord

    ids = torch.randint(0, V, (16,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), HFTap(target, (L,), capture_final=True) as tap:
        logits = target(ids[None]).logits[0]
        cap = tap.pop()
    rec = TappedRecord(Record(ids, torch.arange(16) >= 4, cap.aux[0], cap.final[0]), policy_version=0, step=0,
                       logit_lse=torch.logsumexp(logits, -1), topk_ids=logits.topk(2, -1).indices)
    torch.testing.assert_close(cap.aux[0], cap.final[0])  # "aux layer" L is the final post-norm state
    for mode, temp in (("greedy", 0.0), ("greedy_draft", 1.0), ("probabilistic", 1.0)):
        got, valid = record_alpha(good_head, decoder_parts(target)[0], target.lm_head.weight, rec, 3, mode, temp)
        want, want_valid = alpha_table(target, good_head, ids, 4, 3, mode, temp)
        assert torch.equal(valid, want_valid)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("layout", "depth"), [("deepseek_v3", 1), ("qwen3_next", 2)])
def test_reference_decoder_is_lossless_at_t0(target, good_head, layout, depth):
    from draft_align.monitor.estimator import estimate
    from draft_align.monitor.specdec import SpecDecoder

    d = good_head if (layout, depth) == ("deepseek_v3", 1) else make_head(target, layout, depth)
    prompts = [[3, 17, 5], [40, 2, 9, 11, 30], [7]]
    total_acc = 0.0
    for p in prompts:
        ref = target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None)[0, len(p):]
        for k in (1, 3):
            out, tally = SpecDecoder(target, d, k, "greedy", 0.0).generate(torch.tensor(p), 16)
            assert out.tolist() == ref.tolist(), (p, k)
            total_acc += tally.num_accepted
    if d is good_head:
        assert total_acc > 0  # the acceptance path was exercised
        est = estimate(target, d, [(torch.tensor(p), torch.tensor([1, 2, 3, 4, 5, 6])) for p in prompts], 3,
                       "greedy", 0.0)
        assert est["acceptance_length_est"] >= 1.0 and est["num_tokens"] == 18


def test_estimator_matches_the_decoder_at_t0(target, good_head):
    """monitor.evaluate with an MTP head: the engine-replay estimate equals the decoder's counters at T=0,
    up to each prompt's last round (drafts accepted past the limit: ≤ k per prompt)."""
    from draft_align.monitor.evaluate import evaluate

    prompts = [torch.tensor([5, 17, 33]), torch.tensor([1, 9, 40, 22, 7]), torch.tensor([12, 0, 31, 31])]
    r = evaluate(target, None, good_head, prompts, k=3, mode="greedy", temperature=0.0, max_new_tokens=20, seed=0)
    assert r["rounds_est"] == r["rounds_measured"]
    gap = (r["acceptance_length_measured"] - r["acceptance_length_est"]) * r["rounds_measured"]
    assert -1e-9 <= gap <= 3 * 3
    assert r["acceptance_length_observed"] == pytest.approx(r["acceptance_length_est"])
    assert r["acceptance_length_measured"] > 1.2  # trained: drafts are accepted


def test_generic_export_dispatches_to_mtp(target, tmp_path):
    d = make_head(target)
    out = ex.export_draft(d, tmp_path / "drafts" / "v0001", target_config=target.config, target_name="t",
                          metrics={}, draft_version=1, policy_version=0, tokenizer_fingerprint="fp")
    man = ex.read_manifest(out)
    assert man["format"] == "draft_align.mtp" and len(man["files"]["model.safetensors"]["sha256"]) == 64
    ex.write_latest(tmp_path, out)
    assert ex.resolve_draft_dir(tmp_path) == out


@pytest.mark.slow
def test_smollm2_attach_decode_and_round_trip(tmp_path):
    """A fresh MTP head on the real SmolLM2-135M: the lossless decoder, and both layouts round-trip."""
    from draft_align import assets
    from draft_align.monitor.specdec import SpecDecoder

    target, _ = assets.load_target(str(assets.fetch_smollm2()), torch.float32, "cpu")
    d = MTPDraft.attach(target).eval()
    assert d.cfg.aux_layer_ids == (30,) and d.cfg.hidden_size == 576
    prompt = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018])
    ref = target.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None)[0, prompt.numel():]
    out, _ = SpecDecoder(target, d, 3, "greedy", 0.0).generate(prompt, 12)
    assert out.tolist() == ref.tolist()
    for layout in ("deepseek_v3", "qwen3_next"):
        h = with_layout(d, layout)
        back, _ = load_mtp_draft(export_mtp_draft(
            h, tmp_path / layout, target_config=target.config, target_name="smollm2", metrics={}, draft_version=1,
            policy_version=0, tokenizer_fingerprint="fp", dtype=torch.float32))
        for k, v in h.engine_state_dict().items():
            assert torch.equal(v, back.engine_state_dict()[k]), (layout, k)
