"""draft_align.heads.native_mtp: a model's own MTP layers (MiMo: dense Qwen2 block; GLM-4.5: mixture of experts)
loaded from tiny checkpoints saved the way released ones are (benchmarks/common/mtp_checkpoints.py): the round trip to the
checkpoint's names is bit-identical, the TTT unroll equals decoding step by step, the trunk stays detached, a
few optimizer steps lower the loss, and bad input is refused in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.common.mtp_checkpoints import N_LAYERS, family_config, mtp_names, save_checkpoint
from draft_align.heads.draft_head import DraftConfigError
from draft_align.heads.native_mtp import NativeMTPConfig, from_checkpoint, to_checkpoint

FAMILIES = ("mimo", "glm4_moe", "deepseek_v3")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(
    scope="module", params=[(f, d) for f in FAMILIES for d in (1, 2)], ids=lambda p: f"{p[0]}-d{p[1]}"
)
def ckpt(request, tmp_path_factory):
    family, depth = request.param
    out = tmp_path_factory.mktemp(f"{family}{depth}")
    cfg, tensors = save_checkpoint(family, out, depth=depth, logit_scale=15.0)  # peaky: soft CE can fall
    return family, depth, cfg, tensors, out


def head(cfg, tensors):
    return from_checkpoint(NativeMTPConfig.from_target(cfg), tensors)


def test_round_trip_is_bit_identical(ckpt):
    family, depth, cfg, tensors, _ = ckpt
    draft = head(cfg, tensors)
    out = to_checkpoint(draft)
    assert set(out) == mtp_names(family, tensors, depth)  # every MTP tensor, nothing else
    for name, t in out.items():
        assert t.dtype == tensors[name].dtype and torch.equal(t, tensors[name]), name
    assert torch.equal(draft.lm_head.weight, tensors["lm_head.weight"])
    assert not draft.lm_head.weight.requires_grad


def test_block_is_the_families_own_layer(ckpt):
    family, depth, cfg, tensors, _ = ckpt
    draft = head(cfg, tensors)
    kinds = {type(layer.block).__name__ for layer in draft.layers}
    want = {"mimo": "Qwen2", "glm4_moe": "Glm4Moe", "deepseek_v3": "DeepseekV3"}[family]
    assert kinds == {f"{want}DecoderLayer"}
    if family != "mimo":  # layer N ≥ first_k_dense_replace: the checkpoint's MTP layer is a MoE layer
        assert type(draft.layers[0].block.mlp).__name__ == f"{want}MoE"


def _target_hidden(out, ids):
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        res = model(ids, output_hidden_states=True)
    return model, res.hidden_states[-1]  # [B, T, H] final post-norm hidden (HF index L)


@pytest.mark.parametrize("steps_run", ["first", "cycle"])
def test_unroll_equals_step_by_step_decoding(ckpt, steps_run):
    """Step j of the chain from s (teacher forced) = the step decoder fed the committed context 0..s and then
    the chain; depth 0 every step (vLLM 0.32) or j mod D, the family's chained hidden."""
    family, depth, cfg, tensors, out = ckpt
    draft = from_checkpoint(NativeMTPConfig.from_target(cfg, steps_run=steps_run), tensors).eval()
    if steps_run == "cycle" and depth > 1:  # the cycle really runs another layer at step 1
        assert draft.cfg.depth_of_step(1) == 1
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, cfg.vocab_size, (1, 12), generator=g)
    model, aux = _target_hidden(out, ids)
    embed = model.get_input_embeddings()
    starts = torch.tensor([[0, 3, 6, 8]])
    steps = 3
    with torch.no_grad():
        logits = draft.unroll(
            aux,
            embed,
            ids,
            torch.ones_like(ids, dtype=torch.bool),
            starts,
            torch.ones_like(starts, dtype=torch.bool),
            steps,
        )
    for m, s in enumerate(starts[0].tolist()):
        cache = draft.new_cache()
        e_ctx = embed(ids[0, 1 : s + 2]).detach()
        lg, h = draft.step(cache, aux[0, : s + 1], e_ctx, torch.arange(s + 1), from_target=True)
        assert torch.allclose(lg[-1], logits[0][0, m], atol=1e-4), (s, 0)
        h = h[-1:]
        for j in range(1, steps):
            e = embed(ids[0, s + 1 + j : s + 2 + j]).detach()
            lg, h = draft.step(cache, h, e, torch.tensor([s + j]), from_target=False)
            assert torch.allclose(lg[0], logits[j][0, m], atol=1e-4), (s, j)


def test_gradients_reach_the_head_not_the_trunk(ckpt):
    family, depth, cfg, tensors, out = ckpt
    draft = head(cfg, tensors)
    ids = torch.randint(3, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    model, aux = _target_hidden(out, ids)
    aux = aux.clone().requires_grad_(True)
    embed = model.get_input_embeddings()
    starts = torch.arange(8).expand(2, 8)
    xs = draft.unroll(
        aux,
        embed,
        ids,
        torch.ones_like(ids, dtype=torch.bool),
        starts,
        torch.ones_like(starts, dtype=torch.bool),
        2,
    )
    loss = sum(
        torch.nn.functional.cross_entropy(x.flatten(0, 1), ids[:, 2 + j : 10 + j].clamp(max=9).flatten())
        for j, x in enumerate(xs[:1])
    )
    loss.backward()
    assert aux.grad is None and embed.weight.grad is None  # detached on entry
    assert draft.layers[0].proj.weight.grad is not None and draft.layers[0].proj.weight.grad.abs().sum() > 0
    assert draft.lm_head.weight.grad is None


def test_training_lowers_the_loss(ckpt):
    """Hard CE on the next-next token of the target's own greedy text: 30 AdamW steps lower it."""
    family, depth, cfg, tensors, out = ckpt
    if depth != 1:
        pytest.skip("one depth is enough here")
    draft = head(cfg, tensors)
    prompts = torch.randint(3, cfg.vocab_size, (4, 4), generator=torch.Generator().manual_seed(5))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = model.generate(prompts, max_new_tokens=20, do_sample=False, pad_token_id=0)
        aux = model(ids, output_hidden_states=True).hidden_states[-1]
    embed = model.get_input_embeddings()
    t = ids.shape[1]
    starts = torch.arange(t - 2).expand(ids.shape[0], t - 2)
    valid = torch.ones_like(ids, dtype=torch.bool)
    sv = torch.ones_like(starts, dtype=torch.bool)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)

    def loss_now():
        x = draft.unroll(aux, embed, ids, valid, starts, sv, 1)[0]
        return torch.nn.functional.cross_entropy(x.flatten(0, 1), ids[:, 2:].flatten())

    first = float(loss_now().detach())
    kept = {k: tensors[k].clone() for k in mtp_names(family, tensors, depth) | {"lm_head.weight"}}
    for _ in range(30):
        opt.zero_grad()
        loss = loss_now()
        loss.backward()
        opt.step()
    assert float(loss_now().detach()) < 0.7 * first
    assert all(torch.equal(tensors[k], v) for k, v in kept.items())  # the head trained its own copies


# ---------------------------------------------------------------- bad input: one line each
def test_family_not_supported():
    from transformers import LlamaConfig

    c = LlamaConfig(num_hidden_layers=2)
    c.architectures = ["LlamaForCausalLM"]
    with pytest.raises(DraftConfigError, match="no native MTP family for architecture 'LlamaForCausalLM'"):
        NativeMTPConfig.from_target(c)


def test_config_without_mtp_layers():
    c = family_config("mimo")
    c.num_nextn_predict_layers = 0
    with pytest.raises(DraftConfigError, match="ships no MTP layers"):
        NativeMTPConfig.from_target(c)


def test_checkpoint_without_mtp_tensors(ckpt):
    family, depth, cfg, tensors, _ = ckpt
    trunk = {k: v for k, v in tensors.items() if k not in mtp_names(family, tensors, depth)}
    with pytest.raises(DraftConfigError, match="checkpoint has no MTP tensors") as e:
        head(cfg, trunk)
    assert "\n" not in str(e.value)


def test_checkpoint_missing_one_tensor(ckpt):
    family, depth, cfg, tensors, _ = ckpt
    name = sorted(mtp_names(family, tensors, depth))[-1]
    with pytest.raises(DraftConfigError, match="checkpoint lacks MTP tensors"):
        head(cfg, {k: v for k, v in tensors.items() if k != name})


def test_mismatched_hidden_size(ckpt):
    family, depth, cfg, tensors, _ = ckpt
    name = next(
        k
        for k in sorted(mtp_names(family, tensors, depth))
        if k.endswith(("input_proj.weight", "eh_proj.weight"))
    )
    bad = dict(tensors)
    bad[name] = torch.zeros(cfg.hidden_size, cfg.hidden_size)
    with pytest.raises(DraftConfigError, match="has shape"):
        head(cfg, bad)


def test_mismatched_vocabulary(ckpt):
    family, depth, cfg, tensors, _ = ckpt
    bad = dict(tensors)
    for k in ("lm_head.weight", f"model.layers.{N_LAYERS}.shared_head.head.weight"):
        if k in bad:
            bad[k] = torch.zeros(cfg.vocab_size + 1, cfg.hidden_size)
    with pytest.raises(DraftConfigError, match="has shape"):
        head(cfg, bad)


def test_the_projects_trainer_trains_it(ckpt):
    """DraftTrainer (the EAGLE-3 trainer: TTT over K = 2 steps, soft CE against the target's distribution)
    trains the native head from the target's final hidden states, as the sidecar would feed them."""
    from draft_align.train.objective import LossSettings
    from draft_align.train.records import Record, collate
    from draft_align.train.trainer import DraftTrainer, OptimSettings

    family, depth, cfg, tensors, out = ckpt
    if depth != 1:
        pytest.skip("one depth is enough here")
    draft = head(cfg, tensors)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompts = torch.randint(3, cfg.vocab_size, (6, 4), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ids = model.generate(prompts, max_new_tokens=24, do_sample=False, pad_token_id=0)
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]
    records = []
    for i in range(ids.shape[0]):
        mask = torch.zeros(ids.shape[1], dtype=torch.bool)
        mask[4:] = True  # the response
        records.append(Record(ids[i], mask, hidden[i], hidden[i]))  # aux = final = hidden_states[L]
    batch = collate(records, steps=2)
    trainer = DraftTrainer(
        draft,
        model.get_input_embeddings(),
        model.lm_head.weight.detach(),
        OptimSettings(lr=3e-3, warmup_steps=0, total_steps=40),
        LossSettings(ttt_steps=2, step_decay=0.6, autocast_bf16=False),
    )
    first = trainer.train_step(batch)
    for _ in range(39):
        last = trainer.train_step(batch)
    assert last["ce_0"] < 0.7 * first["ce_0"] and last["acc_0"] > first["acc_0"]
    assert not draft.lm_head.weight.requires_grad  # the shared head never trains


def test_a_checkpoint_folder_with_hostile_shards_is_one_line_each(ckpt, tmp_path):
    """From a checkpoint folder (``from_target_checkpoint``): NaN tensors were loaded, a FIFO named
    ``*.safetensors`` hung the load, a later shard silently replaced an MTP tensor, bad offsets raised a raw
    SafetensorError.  Each is now one DraftConfigError naming the file."""
    import os
    import shutil
    import threading

    import safetensors.torch

    from draft_align.publish.native_mtp_format import from_target_checkpoint

    family, depth, cfg, tensors, folder = ckpt
    name = sorted(mtp_names(family, tensors, depth))[0]

    def case(edit):
        d = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        shutil.copytree(folder, d)
        edit(d)
        return d

    def shard(d):
        return next(d.glob("*.safetensors"))

    nan = case(
        lambda d: safetensors.torch.save_file(
            {k: (torch.full_like(v, float("nan")) if k == name else v) for k, v in tensors.items()},
            str(shard(d)),
        )
    )
    twice = case(
        lambda d: safetensors.torch.save_file({name: tensors[name]}, str(d / "zz-extra.safetensors"))
    )
    cut = case(lambda d: shard(d).write_bytes(shard(d).read_bytes()[:-64]))
    fifo = case(lambda d: os.mkfifo(d / "a-pipe.safetensors"))
    for folder_, why in (
        (nan, "NaN or Inf"),
        (twice, "is in both"),
        (cut, "unreadable safetensors"),
        (fifo, "not a regular file"),
    ):
        got = {}

        def load(folder_=folder_, got=got):
            try:
                from_target_checkpoint(folder_, cfg)
            except DraftConfigError as e:
                got["error"] = str(e)

        t = threading.Thread(target=load, daemon=True)
        t.start()
        t.join(30.0)
        assert not t.is_alive(), f"{why}: the load hangs"
        assert why in got.get("error", ""), (why, got)
        assert "\n" not in got["error"]
