"""draft_align.heads.megatron_mtp: the MTP head whose depths are megatron-core's own ``MultiTokenPredictionLayer``
(local layer spec, CPU), on tiny random checkpoints (benchmarks/common/mtp_checkpoints.py): GLM-4.5 with a dense
MTP layer and MiMo.  Its tensors go megatron ↔ HF bit for bit, it gives the transformers-built head's logits on
the same TTT unroll, its names and math are those of a megatron GPTModel's own MTP block, the project's trainer
trains it from Megatron Tap batches, and bad input is refused in one line."""

from __future__ import annotations

import dataclasses
import sys
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.common.mtp_checkpoints import N_LAYERS, mtp_names, mtp_prefix, save_checkpoint
from draft_align.heads.draft_head import DraftConfigError
from draft_align.heads.native_mtp import NativeMTPConfig
from draft_align.heads.native_mtp import from_checkpoint as native_from_checkpoint

pytest.importorskip("megatron.core")

from draft_align.heads import megatron_mtp as mm  # noqa: E402
from tests.tap.test_megatron import ListSink, megatron_world  # noqa: E402, F401

pytestmark = pytest.mark.usefixtures("one_thread", "megatron_world")


def dense_glm(depth: int) -> dict[str, int]:
    """GLM-4.5 whose MTP layers are dense (every layer index below first_k_dense_replace)."""
    return {"first_k_dense_replace": N_LAYERS + depth}


# (family, depth, experts): GLM-4.5 as released has experts in its MTP layer; dense variants besides
CASES = [("glm4_moe", 1, False), ("glm4_moe", 2, False), ("glm4_moe", 1, True), ("mimo", 1, False)]


@pytest.fixture(scope="module", autouse=True)
def moe_router_on_cpu():
    """megatron-core 0.16.1's MoE router reads ``te_general_gemm``, defined only when Transformer Engine imports
    (moe/moe_utils.py: a NameError without it); None selects its torch path.  Tests only, as megatron_cpu_setup."""
    from megatron.core.transformer.moe import moe_utils

    had = hasattr(moe_utils, "te_general_gemm")
    if not had:
        moe_utils.te_general_gemm = None
    yield
    if not had:
        del moe_utils.te_general_gemm


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}{'-moe' if p[2] else ''}-d{p[1]}")
def ckpt(request, tmp_path_factory):
    family, depth, experts = request.param
    out = tmp_path_factory.mktemp(f"mg_{family}{depth}{experts}")
    extra = dense_glm(depth) if family == "glm4_moe" and not experts else {}
    cfg, tensors = save_checkpoint(family, out, depth=depth, logit_scale=15.0, **extra)
    return family, depth, cfg, tensors, out


def megatron_head(cfg, tensors, steps_run="first"):
    return mm.from_checkpoint(NativeMTPConfig.from_target(cfg, steps_run=steps_run), tensors)


def test_block_is_megatrons_own_layer(ckpt):
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    family, depth, cfg, tensors, _ = ckpt
    draft = megatron_head(cfg, tensors)
    assert all(isinstance(layer.mtp, MultiTokenPredictionLayer) for layer in draft.layers)
    assert all(isinstance(layer.mtp.transformer_layer, TransformerLayer) for layer in draft.layers)
    moe = family == "glm4_moe" and cfg.first_k_dense_replace <= N_LAYERS
    mlp = type(draft.layers[0].mtp.transformer_layer.mlp).__name__
    assert mlp == ("MoELayer" if moe else "MLP")
    names = set(mm.megatron_state_dict(draft))
    for d in range(depth):
        for k in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "final_layernorm.weight",
            "transformer_layer.self_attention.linear_qkv.weight",
            *(
                (
                    "transformer_layer.mlp.router.expert_bias",
                    "transformer_layer.mlp.experts.local_experts.3.linear_fc1.weight",
                )
                if moe
                else ("transformer_layer.mlp.linear_fc1.weight",)
            ),
        ):
            assert f"mtp.layers.{d}.{k}" in names


def test_round_trip_is_bit_identical(ckpt):
    """checkpoint MTP tensors → megatron-built head → export: every tensor back, bit for bit."""
    family, depth, cfg, tensors, _ = ckpt
    draft = megatron_head(cfg, tensors)
    out = draft.checkpoint_tensors()
    assert set(out) == mtp_names(family, tensors, depth)
    for name, t in out.items():
        assert t.dtype == tensors[name].dtype and torch.equal(t, tensors[name]), name
    assert torch.equal(draft.lm_head.weight, tensors["lm_head.weight"])
    assert not draft.lm_head.weight.requires_grad
    # the head's own state dict (what the trainer's checkpoints save and resume) holds tensors only, strictly loadable
    sd = draft.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    other = mm.MegatronMTPDraft(draft.cfg)
    other.load_state_dict(sd, strict=True)
    assert all(torch.equal(v, sd[k]) for k, v in other.state_dict().items())
    # and the pure conversion both ways
    ncfg = draft.cfg
    back = mm.megatron_to_hf(ncfg, mm.hf_to_megatron(ncfg, tensors))
    assert all(torch.equal(v, tensors[k]) for k, v in back.items())


def _target_hidden(out, ids):
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        res = model(ids, output_hidden_states=True)
    return model, res.hidden_states[-1]


@pytest.mark.parametrize("steps_run", ["first", "cycle"])
def test_same_logits_as_the_transformers_head(ckpt, steps_run):
    """Same weights, same teacher-forced unroll (3 TTT steps, chains from 4 starts): the megatron-core-built head
    and NativeMTPDraft (transformers' layer) give the same logits; the step decoder agrees too."""
    family, depth, cfg, tensors, out = ckpt
    ncfg = NativeMTPConfig.from_target(cfg, steps_run=steps_run)
    ours = mm.from_checkpoint(ncfg, tensors).eval()
    ref = native_from_checkpoint(ncfg, tensors).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, cfg.vocab_size, (2, 12), generator=g)
    model, aux = _target_hidden(out, ids)
    embed = model.get_input_embeddings()
    starts = torch.tensor([[0, 3, 6, 8], [1, 2, 5, 9]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    sv = torch.ones_like(starts, dtype=torch.bool)
    with torch.no_grad():
        got = ours.unroll(aux, embed, ids, valid, starts, sv, 3)
        want = ref.unroll(aux, embed, ids, valid, starts, sv, 3)
    for j, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.abs().max() > 1.0  # real logits (lm_head × 15), not zeros on both sides
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=f"step {j}")
    # the step decoder (no cache) against the transformers head's, from start 6 of row 0
    s = 6
    caches = (ours.new_cache(), ref.new_cache())
    e_ctx = embed(ids[0, 1 : s + 2]).detach()
    with torch.no_grad():
        outs = [
            d.step(c, aux[0, : s + 1], e_ctx, torch.arange(s + 1), True)
            for d, c in zip((ours, ref), caches, strict=True)
        ]
        torch.testing.assert_close(outs[0][0], outs[1][0], atol=2e-4, rtol=1e-4)
        h = [o[1][-1:] for o in outs]
        e = embed(ids[0, s + 2 : s + 3]).detach()
        nxt = [
            d.step(c, hh, e, torch.tensor([s + 1]), False)
            for d, c, hh in zip((ours, ref), caches, h, strict=True)
        ]
        torch.testing.assert_close(nxt[0][0], nxt[1][0], atol=2e-4, rtol=1e-4)


def test_publishes_the_transformers_heads_folder(ckpt, tmp_path):
    """The warm-start's path (``draft.mtp_impl: megatron``): the target folder's MTP layers read into the
    megatron-built head, and its publish writes the same model.safetensors, byte for byte, as the
    transformers-built head's (the folder vLLM's MTP drafter loads); a trained block publishes its new values."""
    import safetensors.torch

    from draft_align.publish import load_draft, write_draft
    from draft_align.publish.folder import ExportRequest
    from draft_align.publish.native_mtp_format import from_target_checkpoint

    family, depth, cfg, tensors, out = ckpt
    ours = from_target_checkpoint(out, cfg, impl="megatron")
    ref = from_target_checkpoint(out, cfg)
    assert isinstance(ours, mm.MegatronMTPDraft) and not isinstance(ref, mm.MegatronMTPDraft)
    req = ExportRequest(
        target_config=cfg,
        target_name="tiny",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="none",
        dtype=torch.float32,
    )
    write_draft(ours, tmp_path / "mg", req)
    write_draft(ref, tmp_path / "hf", req)
    assert (tmp_path / "mg" / "model.safetensors").read_bytes() == (
        tmp_path / "hf" / "model.safetensors"
    ).read_bytes()
    with torch.no_grad():
        ours.layers[0].mtp.eh_proj.weight.add_(0.25)  # a trained block
    write_draft(ours, tmp_path / "mg2", req)
    written = safetensors.torch.load_file(str(tmp_path / "mg2" / "model.safetensors"))
    glue = "input_proj" if family == "mimo" else "eh_proj"
    proj = f"{mtp_prefix(family, 0)}{glue}.weight"  # depth 0's projection
    assert not torch.equal(written[proj], tensors[proj])
    back, _ = load_draft(tmp_path / "mg2")  # the transformers-built head reads it back
    assert torch.equal(back.checkpoint_tensors()[proj], written[proj])


# --------------------------------------------------------------- a megatron GPTModel of the same target
def gpt_model(cfg, tensors, with_mtp: bool):
    """A megatron GPTModel of the tiny target (local spec, CPU) with the HF checkpoint's trunk weights; with its
    own MTP block when ``with_mtp`` (megatron's GPTModel with ``mtp_block_spec``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    ncfg = NativeMTPConfig.from_target(cfg)
    mcfg = mm.megatron_config(ncfg)
    if not with_mtp:
        mcfg = dataclasses.replace(mcfg, mtp_num_layers=None)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(mcfg, spec, use_transformer_engine=False) if with_mtp else None
    rope = cfg.rope_parameters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(
            mcfg,
            spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=512,
            parallel_output=False,
            position_embedding_type="rope",
            rotary_percent=float(rope.get("partial_rotary_factor", 1.0)),
            rotary_base=int(rope["rope_theta"]),
            share_embeddings_and_output_weights=False,
            mtp_block_spec=mtp,
        )
    sd = {
        "embedding.word_embeddings.weight": tensors["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": tensors["model.norm.weight"],
        "output_layer.weight": tensors["lm_head.weight"],
    }
    dims = mm._attention_dims(ncfg)
    for j in range(ncfg.target_num_layers):
        p, m = f"model.layers.{j}.", f"decoder.layers.{j}."
        for hf, mg in mm._PLAIN:
            sd[m + mg] = tensors[p + hf]
        sd[m + "mlp.linear_fc2.weight"] = tensors[p + "mlp.down_proj.weight"]
        for kind in ("weight", "bias"):
            if p + f"self_attn.q_proj.{kind}" in tensors:
                q, k, v = (tensors[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
                sd[f"{m}self_attention.linear_qkv.{kind}"] = mm.fuse_qkv(q, k, v, dims)
        sd[m + "mlp.linear_fc1.weight"] = torch.cat(
            (tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"])
        )
    if with_mtp:
        sd.update(mm.hf_to_megatron(ncfg, tensors))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")], (
        missing,
        unexpected,
    )
    return model.eval()


def test_names_and_math_are_the_gptmodels_own_mtp_block(ckpt):
    """A megatron GPTModel built with its MTP block holds exactly the head's megatron names and shapes; the
    head loads from that state, and its step-0 output equals the GPTModel's own MTP block run on the decoder's
    output (with position 0's embedding zeroed, as vLLM's drafters and the head do)."""
    family, depth, cfg, tensors, _ = ckpt
    if family != "glm4_moe":
        pytest.skip("megatron's block concatenates (embedding, hidden): the GLM-4.5/DeepSeek layout")
    if cfg.first_k_dense_replace <= N_LAYERS:
        pytest.skip(
            "this test's GPTModel builds every trunk layer from one spec; GLM's trunk mixes dense and experts"
        )
    gpt = gpt_model(cfg, tensors, with_mtp=True)
    state = {
        k: v for k, v in gpt.state_dict().items() if k.startswith("mtp.") and not k.endswith("_extra_state")
    }
    draft = mm.MegatronMTPDraft(NativeMTPConfig.from_target(cfg))
    own = mm.megatron_state_dict(draft)
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in own.items()}
    mm.load_megatron_state(draft, state)
    draft.set_head(tensors["lm_head.weight"])
    assert all(torch.equal(own[k], state[k]) for k in own)

    b, t = 2, 10
    ids = torch.randint(3, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(t).expand(b, t)
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)[None, None]
    captured = []
    handle = gpt.decoder.register_forward_hook(lambda _m, _i, o: captured.append(o))

    def embed_zero_first(input_ids, position_ids):  # megatron rolls ids left: row 0 embeds x[1]
        e = gpt.embedding(input_ids=input_ids, position_ids=position_ids).clone()
        e[0] = 0
        return e

    with torch.no_grad():
        gpt(ids, pos, mask, labels=ids)  # megatron's forward with an MTP block computes the MTP loss: labels
        handle.remove()
        final = captured[0]  # [T, B, H] the decoder's output after final_layernorm
        rope = gpt.rotary_pos_emb(t)
        block = gpt.mtp.layers[0](
            input_ids=ids,
            position_ids=pos,
            hidden_states=final,
            attention_mask=mask,
            rotary_pos_emb=rope,
            embedding=embed_zero_first,
        )[0]  # [T, B, H] final_layernorm(out) at each position
        starts = torch.arange(t - 1).expand(b, t - 1)
        ours = draft.unroll_hidden(
            final.transpose(0, 1),
            gpt.embedding.word_embeddings,
            ids,
            torch.ones(b, t, dtype=torch.bool),
            starts,
            torch.ones_like(starts, dtype=torch.bool),
            1,
        )[0]
    torch.testing.assert_close(ours, block.transpose(0, 1)[:, : t - 1], atol=1e-5, rtol=1e-5)


def test_trains_from_megatron_tap_batches(ckpt):
    """The Megatron Tap on a megatron GPTModel of the target supplies what the head reads (the final post-norm
    hidden as aux_layer_ids (L,), token ids, the lm_head via head_sync); DraftTrainer (TTT over 2 steps, soft CE
    against the target's distribution) trains the megatron-built head on those batches and the loss falls."""
    from draft_align.sidecar.ingest import split_records
    from draft_align.tap.megatron import MegatronPolicyTap
    from draft_align.train.objective import LossSettings
    from draft_align.train.records import collate
    from draft_align.train.trainer import DraftTrainer, OptimSettings
    from draft_align.wire.messages import HeadSync, TapBatch

    family, depth, cfg, tensors, out = ckpt
    if depth != 1:
        pytest.skip("one depth is enough here")
    if family == "glm4_moe" and cfg.first_k_dense_replace <= N_LAYERS:
        pytest.skip(
            "this test's GPTModel builds every trunk layer from one spec; GLM's trunk mixes dense and experts"
        )
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = torch.randint(3, cfg.vocab_size, (6, 4), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ids = hf.generate(prompts, max_new_tokens=24, do_sample=False, pad_token_id=0)
    b, t = ids.shape
    gpt = gpt_model(cfg, tensors, with_mtp=False)
    n = NativeMTPConfig.from_target(cfg).target_num_layers
    sink = ListSink()
    tap = MegatronPolicyTap(gpt, (n,), sink, run_id="r", tokens_per_step=10_000, topk=1)
    att = torch.ones(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t, dtype=torch.long)
    loss_mask[:, 4:] = 1  # the response
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)[None, None]
    with tap.capturing(), torch.no_grad():
        logits = gpt(ids, torch.arange(t).expand(b, t), mask)
        tap.submit(
            input_ids=ids,
            attention_mask=att,
            loss_mask=loss_mask,
            logits=logits,
            policy_version=1,
            step=0,
            temperature=1.0,
        )
    tap.end_step()
    assert tap.head_sync(1, torch.arange(cfg.vocab_size))
    (batch,) = [m for m in sink if isinstance(m, TapBatch)]
    (head,) = [m for m in sink if isinstance(m, HeadSync)]
    assert batch.aux_layer_ids == (n,) and batch.final_norm == "post"
    with (
        torch.no_grad()
    ):  # the Tap's final hidden is HF hidden_states[L] of the same weights (bf16 on the wire)
        want = hf(ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(batch.final_hidden[:t].float(), want[0], atol=5e-2, rtol=2e-2)
    records = [rec for rec, _ in split_records(batch)]
    assert len(records) == b

    draft = megatron_head(cfg, tensors)
    draft.set_head(head.rows.float())  # what the sidecar does with each HeadSync of an MTP head
    trainer = DraftTrainer(
        draft,
        gpt.embedding.word_embeddings,  # megatron's own embedding supplies the head's token embeddings
        head.rows,
        OptimSettings(lr=3e-3, warmup_steps=0, total_steps=30),
        LossSettings(ttt_steps=2, step_decay=0.6, autocast_bf16=False),
    )
    batch_t = collate(records, steps=2)
    kept = {k: v.clone() for k, v in mm.megatron_state_dict(draft).items()}
    first = trainer.train_step(batch_t)
    for _ in range(29):
        last = trainer.train_step(batch_t)
    assert last["ce_0"] < 0.7 * first["ce_0"] and last["acc_0"] > first["acc_0"], (first, last)
    assert last["ce_1"] < first["ce_1"]  # the chained step learns too
    trained = mm.megatron_state_dict(draft)
    assert not torch.equal(trained["mtp.layers.0.eh_proj.weight"], kept["mtp.layers.0.eh_proj.weight"])
    assert not draft.lm_head.weight.requires_grad
    # the trained megatron block publishes under the family's HF names, loadable by the transformers-built head
    exported = draft.checkpoint_tensors()
    assert set(exported) == mtp_names(family, tensors, depth)
    ref = native_from_checkpoint(draft.cfg, {**tensors, **exported})
    assert all(torch.equal(v, exported[k]) for k, v in ref.checkpoint_tensors().items())


def test_expert_layer_trains(ckpt):
    """GLM-4.5's MTP layer as released (megatron's MoELayer: router, shared and routed experts): DraftTrainer
    trains it from the target's final hidden states (HF, as the Tap ships them); the loss falls and the router
    and the experts move, the selection bias (a buffer) stays."""
    from draft_align.train.objective import LossSettings
    from draft_align.train.records import Record, collate
    from draft_align.train.trainer import DraftTrainer, OptimSettings

    family, depth, cfg, tensors, out = ckpt
    if not (family == "glm4_moe" and cfg.first_k_dense_replace <= N_LAYERS):
        pytest.skip("the mixture-of-experts MTP layer only (the dense ones train in the Megatron Tap test)")
    draft = megatron_head(cfg, tensors)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompts = torch.randint(3, cfg.vocab_size, (6, 4), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ids = model.generate(prompts, max_new_tokens=24, do_sample=False, pad_token_id=0)
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]
    mask = torch.zeros(ids.shape[1], dtype=torch.bool)
    mask[4:] = True
    batch = collate([Record(ids[i], mask, hidden[i], hidden[i]) for i in range(ids.shape[0])], steps=2)
    trainer = DraftTrainer(
        draft,
        model.get_input_embeddings(),
        model.lm_head.weight.detach(),
        OptimSettings(lr=3e-3, warmup_steps=0, total_steps=30),
        LossSettings(ttt_steps=2, step_decay=0.6, autocast_bf16=False),
    )
    before = {k: v.clone() for k, v in mm.megatron_state_dict(draft).items()}
    first = trainer.train_step(batch)
    for _ in range(29):
        last = trainer.train_step(batch)
    assert last["ce_0"] < 0.7 * first["ce_0"] and last["acc_0"] > first["acc_0"], (first, last)
    after = mm.megatron_state_dict(draft)
    tl = "mtp.layers.0.transformer_layer.mlp."
    for k in (
        "router.weight",
        "shared_experts.linear_fc1.weight",
        "experts.local_experts.0.linear_fc2.weight",
    ):
        assert not torch.equal(after[tl + k], before[tl + k]), k
    assert torch.equal(after[tl + "router.expert_bias"], before[tl + "router.expert_bias"])


# ---------------------------------------------------------------- bad input: one line each
def test_megatron_core_missing(monkeypatch, ckpt):
    family, depth, cfg, tensors, _ = ckpt
    monkeypatch.setitem(sys.modules, "megatron.core.transformer.transformer_config", None)
    with pytest.raises(DraftConfigError, match="needs megatron-core") as e:
        megatron_head(cfg, tensors)
    assert "\n" not in str(e.value)


def test_family_megatron_path_does_not_map(tmp_path):
    cfg, tensors = save_checkpoint("deepseek_v3", tmp_path)  # MLA attention, experts
    with pytest.raises(DraftConfigError, match="family 'deepseek_v3'.*not mapped") as e:
        megatron_head(cfg, tensors)
    assert "\n" not in str(e.value)


def test_router_megatron_cannot_express_refused(tmp_path):
    cfg, tensors = save_checkpoint("glm4_moe", tmp_path, norm_topk_prob=False)  # un-normalised top-k weights
    with pytest.raises(DraftConfigError, match="norm_topk_prob=false is not mapped"):
        megatron_head(cfg, tensors)


def test_mixed_dense_and_expert_mtp_layers_refused(tmp_path):
    cfg, tensors = save_checkpoint("glm4_moe", tmp_path, depth=2, first_k_dense_replace=N_LAYERS + 1)
    with pytest.raises(DraftConfigError, match="mix dense and expert layers"):
        megatron_head(cfg, tensors)


def test_mismatched_hidden_size(ckpt):
    family, depth, cfg, tensors, _ = ckpt
    name = next(
        k
        for k in sorted(mtp_names(family, tensors, depth))
        if k.endswith(("input_proj.weight", "eh_proj.weight"))
    )
    bad = dict(tensors)
    bad[name] = torch.zeros(cfg.hidden_size, cfg.hidden_size)
    with pytest.raises(DraftConfigError, match="eh_proj.weight has shape") as e:
        megatron_head(cfg, bad)
    assert "\n" not in str(e.value)


def test_mismatched_vocabulary(ckpt):
    family, depth, cfg, tensors, _ = ckpt
    bad = dict(tensors)
    for k in (
        "lm_head.weight",
        f"model.layers.{N_LAYERS}.shared_head.head.weight",
        "model.embed_tokens.weight",
    ):
        if k in bad:
            bad[k] = torch.zeros(cfg.vocab_size + 1, cfg.hidden_size)
    with pytest.raises(DraftConfigError, match="does not fit|has shape") as e:
        megatron_head(cfg, bad)
    assert "\n" not in str(e.value)


def test_checkpoint_without_mtp_tensors(ckpt):
    family, depth, cfg, tensors, _ = ckpt
    trunk = {k: v for k, v in tensors.items() if k not in mtp_names(family, tensors, depth)}
    with pytest.raises(DraftConfigError, match="checkpoint has no MTP tensors"):
        megatron_head(cfg, trunk)
    name = sorted(mtp_names(family, tensors, depth))[0]
    with pytest.raises(DraftConfigError, match="checkpoint lacks MTP tensors"):
        megatron_head(cfg, {k: v for k, v in tensors.items() if k != name})
