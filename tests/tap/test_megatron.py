"""MegatronPolicyTap against HFPolicyTap: a tiny Llama built in megatron-core and the same weights in HF
transformers give the same TapBatch (TP=1/PP=1 in-process; TP=2 with sequence parallelism and PP=2 in a
2-rank gloo group, the PP stages joined by the StageJoiner)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from draft_align.hf.capture import TapError
from draft_align.tap.hf import HFPolicyTap
from draft_align.tap.protocol import PolicyTap, PolicyTapError
from draft_align.wire.codec import encode
from draft_align.wire.join import StageJoiner
from draft_align.wire.messages import HeadSync, TapBatch, TapPart, decode

pytest.importorskip("megatron.core")

H, L, NH, KV, FF, V, EPS = 64, 4, 4, 2, 128, 97, 1e-6
B, T = 3, 12
D2T = torch.tensor([0, 3, 5, 8, 13, 21, 34, 55, 89, 96])


class ListSink(list):
    """A TapSink that keeps every message."""

    def offer(self, message) -> bool:
        self.append(message)
        return True


# ----------------------------------------------------------------------------- megatron on CPU (tests only)
def megatron_cpu_setup() -> None:
    """megatron-core on CPU needs torch.cuda.current_device → "cpu" and an inference RNG
    tracker.  Applied in tests (and the spawned test workers) only, never by the library."""
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """A 1-rank gloo group with megatron's model-parallel state (TP=1, PP=1) and the CPU workarounds."""
    from megatron.core import parallel_state as ps

    saved = torch.cuda.current_device
    init = tmp_path_factory.mktemp("gloo") / "store"
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    megatron_cpu_setup()
    yield ps
    ps.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
    torch.cuda.current_device = saved


# ----------------------------------------------------------------------------------------- the models
def hf_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=FF,
        num_hidden_layers=L,
        num_attention_heads=NH,
        num_key_value_heads=KV,
        head_dim=H // NH,
        rms_norm_eps=EPS,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # non-trivial norms: a swapped norm would show
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


class TestRMSNorm(nn.Module):
    """RMSNorm with megatron's norm signature; torch's wrapped norm refuses sequence parallelism on CPU."""

    __test__ = False

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def megatron_model(
    dtype: torch.dtype = torch.float32,
    *,
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    pre: bool = True,
    post: bool = True,
) -> nn.Module:
    """A megatron GPTModel stage (RMSNorm, SwiGLU, RoPE, GQA, no bias, untied) of the same shape."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=NH,
        num_query_groups=KV,
        ffn_hidden_size=FF,
        kv_channels=H // NH,
        normalization="RMSNorm",
        layernorm_epsilon=EPS,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if sp:
        spec.submodules.input_layernorm = TestRMSNorm
        spec.submodules.pre_mlp_layernorm = TestRMSNorm
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(cfg), layer_norm=TestRMSNorm
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(
            cfg,
            spec,
            vocab_size=V + (-V) % tp,
            max_sequence_length=64,
            pre_process=pre,
            post_process=post,
            parallel_output=False,
            position_embedding_type="rope",
            rotary_base=10000,
            share_embeddings_and_output_weights=False,
        )
    return model.eval()


def load_hf_weights(model: nn.Module, hf_sd: dict[str, torch.Tensor], tp_rank: int = 0, tp: int = 1) -> None:
    """HF Llama weights → a megatron stage (its layers by global layer_number, TP shard ``tp_rank``).

    Megatron's fused QKV is grouped per query group [q heads of the group, k, v]; SwiGLU fc1 per TP shard
    is [gate shard; up shard]; column-parallel weights split rows, row-parallel ones split columns."""
    d, hpg = H // NH, NH // KV

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(tp, dim=0)[tp_rank]

    def cols(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(tp, dim=1)[tp_rank]

    out: dict[str, torch.Tensor] = {}
    if model.pre_process:
        out["embedding.word_embeddings.weight"] = rows(
            F.pad(hf_sd["model.embed_tokens.weight"], (0, 0, 0, (-V) % tp))
        )
    if model.post_process:
        out["decoder.final_layernorm.weight"] = hf_sd["model.norm.weight"]
        out["output_layer.weight"] = rows(F.pad(hf_sd["lm_head.weight"], (0, 0, 0, (-V) % tp)))
    for j, layer in enumerate(model.decoder.layers):
        p, m = f"model.layers.{layer.layer_number - 1}.", f"decoder.layers.{j}."
        q = hf_sd[p + "self_attn.q_proj.weight"].view(KV, hpg * d, H)
        k = hf_sd[p + "self_attn.k_proj.weight"].view(KV, d, H)
        v = hf_sd[p + "self_attn.v_proj.weight"].view(KV, d, H)
        out[m + "self_attention.linear_qkv.weight"] = rows(torch.cat([q, k, v], 1).reshape(-1, H))
        out[m + "self_attention.linear_proj.weight"] = cols(hf_sd[p + "self_attn.o_proj.weight"])
        out[m + "input_layernorm.weight"] = hf_sd[p + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf_sd[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [rows(hf_sd[p + "mlp.gate_proj.weight"]), rows(hf_sd[p + "mlp.up_proj.weight"])]
        )
        out[m + "mlp.linear_fc2.weight"] = cols(hf_sd[p + "mlp.down_proj.weight"])
    missing, unexpected = model.load_state_dict(out, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")], (
        missing,
        unexpected,
    )


# ------------------------------------------------------------------------------------------ the inputs
def batch_inputs(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask (right-padded), loss_mask [B, T]; row 2 has no response (skipped)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths, prompts = [12, 9, 7], [4, 3, 7]
    pos = torch.arange(T)
    att = torch.stack([pos < n for n in lengths]).long()
    loss = torch.stack([(pos >= p) & (pos < n) for p, n in zip(prompts, lengths, strict=True)]).long()
    ids = ids * att  # padding = token 0
    return ids, att, loss


def causal_mask() -> torch.Tensor:
    return torch.triu(torch.ones(T, T, dtype=torch.bool), 1)[None, None].expand(B, 1, T, T)


def hf_reference(model: nn.Module, aux_ids: tuple[int, ...], microbatches: int = 1) -> tuple[list, HeadSync]:
    sink = ListSink()
    tap = HFPolicyTap(model, aux_ids, sink, run_id="r", tokens_per_step=1000, topk=3, seed=0)
    with tap.capturing(), torch.no_grad():
        for mb in range(microbatches):
            ids, att, loss = batch_inputs(7 + mb)
            logits = model(input_ids=ids, attention_mask=att).logits
            tap.submit(
                input_ids=ids,
                attention_mask=att,
                loss_mask=loss,
                logits=logits,
                policy_version=2,
                step=5,
                temperature=0.7,
            )
    tap.end_step()
    tap.head_sync(2, D2T)
    return [m for m in sink if isinstance(m, TapBatch)], next(m for m in sink if isinstance(m, HeadSync))


def assert_same_batch(got: TapBatch, want: TapBatch, atol: float, exact_topk: bool = True) -> None:
    for f in (
        "run_id",
        "policy_version",
        "source_rank",
        "batch_id",
        "step",
        "aux_layer_ids",
        "hidden_size",
        "vocab_size",
        "final_norm",
        "temperature",
    ):
        assert getattr(got, f) == getattr(want, f), f
    for name in ("cu_seqlens", "input_ids", "loss_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # the megatron tap sends statistics at every position, the HF tap from stats_from on: compare those
    assert got.stats_from is None
    at = defined(want)
    same = (got.topk_ids[at] == want.topk_ids[at]).float().mean().item()
    # random tiny models have near-flat logits: in bf16 near-ties may swap places in the top-k
    assert same == 1.0 if exact_topk else same >= 0.9, same
    for name in ("aux_hidden", "final_hidden", "next_logprob", "logit_lse", "topk_logprobs"):
        a, b = getattr(got, name), getattr(want, name)
        assert a is not None and b is not None, name
        if name not in ("aux_hidden", "final_hidden"):
            a, b = a[at], b[at]
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=0.02, msg=name)


def defined(batch: TapBatch) -> torch.Tensor:
    """[N] bool: the positions whose statistics ``batch`` defines (from each sequence's stats_from on)."""
    out = torch.zeros(batch.num_tokens, dtype=torch.bool)
    for i in range(batch.num_sequences):
        out[int(batch.cu_seqlens[i]) + batch.stats_start(i) : int(batch.cu_seqlens[i + 1])] = True
    return out


# --------------------------------------------------------------------------------------- TP=1, PP=1
@pytest.mark.parametrize("aux_ids", [(1, 2, 3), (0, 2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_rank_matches_hf_tap(megatron_world, aux_ids, dtype):
    from draft_align.tap.megatron import MegatronPolicyTap

    hf = hf_model(dtype)
    mg = megatron_model(dtype)
    load_hf_weights(mg, hf.state_dict())
    want, want_head = hf_reference(hf, aux_ids)

    sink = ListSink()
    tap = MegatronPolicyTap.from_parallel_state(
        mg, aux_ids, sink, run_id="r", tokens_per_step=1000, topk=3, seed=0
    )
    assert isinstance(tap, PolicyTap)
    ids, att, loss = batch_inputs()
    with tap.capturing(), torch.no_grad():
        logits = mg(ids, torch.arange(T).expand(B, T), causal_mask())
        tap.submit(
            input_ids=ids,
            attention_mask=att,
            loss_mask=loss,
            logits=logits,
            policy_version=2,
            step=5,
            temperature=0.7,
        )
    assert tap.end_step() == 21  # rows of 12 and 9 tokens; the row without response is skipped
    assert tap.head_sync(2, D2T)
    got = [m for m in sink if isinstance(m, TapBatch)]
    assert len(got) == len(want) == 1
    # fp32: bf16 rounding of equal values (≤ 1 ulp); bf16 models: the two stacks round differently
    atol = 2e-2 if dtype == torch.float32 else 0.15
    assert_same_batch(got[0], want[0], atol, exact_topk=dtype == torch.float32)
    head = next(m for m in sink if isinstance(m, HeadSync))
    assert torch.equal(head.rows, want_head.rows) and torch.equal(
        head.draft_to_target, want_head.draft_to_target
    )
    torch.testing.assert_close(head.norm_weight, want_head.norm_weight)
    assert head.norm_eps == pytest.approx(want_head.norm_eps)
    assert tap.stats()["no_response"] == 1 and tap.stats()["capture_broken"] == 0


def test_single_rank_bad_calls(megatron_world):
    from draft_align.tap.megatron import MegatronPolicyTap

    mg = megatron_model()
    sink = ListSink()
    with pytest.raises(TapError, match="outside hidden_states indices 0..4"):
        MegatronPolicyTap(mg, (1, 2, 9), sink, run_id="r", tokens_per_step=100)
    with pytest.raises(TapError, match="distinct and ascending"):
        MegatronPolicyTap(mg, (2, 1, 3), sink, run_id="r", tokens_per_step=100)
    tap = MegatronPolicyTap(mg, (1, 2, 3), sink, run_id="r", tokens_per_step=100)
    ids, att, loss = batch_inputs()
    with tap.capturing():
        with pytest.raises(PolicyTapError, match="without a captured forward"):
            tap.submit(
                input_ids=ids,
                attention_mask=att,
                loss_mask=loss,
                logits=None,
                policy_version=0,
                step=0,
                temperature=1.0,
            )
        with torch.no_grad():
            mg(ids, torch.arange(T).expand(B, T), causal_mask())
        with pytest.raises(PolicyTapError, match="logits must be"):
            tap.submit(
                input_ids=ids,
                attention_mask=att,
                loss_mask=loss,
                logits=None,
                policy_version=0,
                step=0,
                temperature=1.0,
            )
    with pytest.raises(PolicyTapError, match="outside"):
        tap.head_sync(0, torch.tensor([V + 3]))
    with pytest.raises(TapError, match="megatron GPTModel"):
        MegatronPolicyTap(nn.Linear(2, 2), (1, 2, 3), sink, run_id="r", tokens_per_step=100)


def test_wrapped_model_is_unwrapped(megatron_world):
    """DDP / Float16Module wrap the GPTModel in ``.module``; the tap hooks the inner model."""
    from draft_align.tap.megatron import MegatronPolicyTap

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

        def forward(self, *args):
            return self.module(*args)

    mg = megatron_model()
    load_hf_weights(mg, hf_model().state_dict())
    sink = ListSink()
    tap = MegatronPolicyTap(Wrapper(Wrapper(mg)), (1, 2, 3), sink, run_id="r", tokens_per_step=1000, topk=3)
    ids, att, loss = batch_inputs()
    with tap.capturing(), torch.no_grad():
        logits = tap.model(ids, torch.arange(T).expand(B, T), causal_mask())
        tap.submit(
            input_ids=ids,
            attention_mask=att,
            loss_mask=loss,
            logits=logits,
            policy_version=2,
            step=5,
            temperature=0.7,
        )
    tap.end_step()
    assert_same_batch(sink[0], hf_reference(hf_model(), (1, 2, 3))[0][0], 2e-2)


# ------------------------------------------------------------------------- 2 ranks: TP=2+SP, then PP=2
def _worker(rank: int, tmp: str) -> None:
    from megatron.core import parallel_state as ps

    from draft_align.tap.megatron import MegatronPolicyTap

    torch.set_num_threads(1)
    out = Path(tmp)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=2)
    hf_sd = torch.load(out / "hf.pt")
    ids, att, loss = batch_inputs()
    pos = torch.arange(T).expand(B, T)
    key = b"k" * 32

    # TP=2 with sequence parallelism: both ranks capture and gather, only TP rank 0 sends
    ps.initialize_model_parallel(2, 1)
    megatron_cpu_setup()
    mg = megatron_model(tp=2, sp=True)
    load_hf_weights(mg, hf_sd, tp_rank=rank, tp=2)
    sink = ListSink()
    tap = MegatronPolicyTap.from_parallel_state(
        mg, (1, 2, 4), sink, run_id="r", tokens_per_step=1000, topk=3, seed=0, vocab_size=V
    )
    with tap.capturing(), torch.no_grad():
        logits = mg(ids, pos, causal_mask())
        tap.submit(
            input_ids=ids,
            attention_mask=att,
            loss_mask=loss,
            logits=logits,
            policy_version=2,
            step=5,
            temperature=0.7,
        )
    tap.end_step()
    tap.head_sync(2, D2T)
    torch.save([encode(m, key) for m in sink], out / f"tp_rank{rank}.pt")
    # the same with vocab-parallel logits (megatron's parallel_output): statistics computed over the TP group
    sink = ListSink()
    tap = MegatronPolicyTap.from_parallel_state(
        mg,
        (1, 2, 4),
        sink,
        run_id="r",
        tokens_per_step=1000,
        topk=3,
        seed=0,
        vocab_size=V,
        vocab_parallel_logits=True,
    )
    with tap.capturing(), torch.no_grad():
        shard = mg(ids, pos, causal_mask(), runtime_gather_output=False)
        assert shard.shape == (B, T, (V + 1) // 2)  # 97 padded to 98: rank 1's last column is padding
        tap.submit(
            input_ids=ids,
            attention_mask=att,
            loss_mask=loss,
            logits=shard,
            policy_version=2,
            step=5,
            temperature=0.7,
        )
    tap.end_step()
    torch.save([encode(m, key) for m in sink], out / f"tpvp_rank{rank}.pt")
    ps.destroy_model_parallel()

    # PP=2: each stage taps its own layers; two micro-batches run forward before either is submitted
    ps.initialize_model_parallel(1, 2)
    megatron_cpu_setup()
    mg = megatron_model(pp=2, pre=rank == 0, post=rank == 1)
    assert [la.layer_number for la in mg.decoder.layers] == ([1, 2] if rank == 0 else [3, 4])
    load_hf_weights(mg, hf_sd)
    sink = ListSink()
    tap = MegatronPolicyTap.from_parallel_state(
        mg, (0, 2, 3), sink, run_id="r", tokens_per_step=1000, topk=3, seed=0
    )
    logits_per_mb = []
    with tap.capturing(), torch.no_grad():
        for mb in range(2):  # different inputs: the captures must be consumed first-in first-out
            ids, _, _ = batch_inputs(7 + mb)
            if rank == 0:
                dist.send(mg(ids, pos, causal_mask()).contiguous(), 1)
                logits_per_mb.append(None)
            else:
                x = torch.empty(T, B, H)
                dist.recv(x, 0)
                mg.set_input_tensor(x)
                logits_per_mb.append(mg(ids, pos, causal_mask()))
        for mb, logits in enumerate(logits_per_mb):
            ids, att, loss = batch_inputs(7 + mb)
            tap.submit(
                input_ids=ids,
                attention_mask=att,
                loss_mask=loss,
                logits=logits,
                policy_version=2,
                step=5,
                temperature=0.7,
            )
    tap.end_step()
    sent_head = tap.head_sync(2, D2T)
    assert sent_head == (rank == 1)
    torch.save([encode(m, key) for m in sink], out / f"pp_rank{rank}.pt")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = str(tmp_path_factory.mktemp("two_ranks"))
    torch.save(hf_model().state_dict(), Path(tmp) / "hf.pt")
    env = {"OMP_NUM_THREADS": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mp.spawn(_worker, args=(tmp,), nprocs=2, join=True)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    key = b"k" * 32
    return {
        name: [decode(f, key) for f in torch.load(Path(tmp) / f"{name}.pt")]
        for name in ("tp_rank0", "tp_rank1", "tpvp_rank0", "tpvp_rank1", "pp_rank0", "pp_rank1")
    }


def test_tensor_parallel_sequence_parallel_only_rank0_sends(two_rank_run):
    want, want_head = hf_reference(hf_model(), (1, 2, 4))
    assert two_rank_run["tp_rank1"] == []
    sent = two_rank_run["tp_rank0"]
    got = [m for m in sent if isinstance(m, TapBatch)]
    assert len(got) == 1
    assert_same_batch(got[0], want[0], 2e-2)
    head = next(m for m in sent if isinstance(m, HeadSync))
    assert torch.equal(head.rows, want_head.rows)  # gathered from both vocab shards


def test_vocab_parallel_logits_give_the_same_statistics(two_rank_run):
    want, _ = hf_reference(hf_model(), (1, 2, 4))
    assert two_rank_run["tpvp_rank1"] == []
    (got,) = two_rank_run["tpvp_rank0"]
    assert_same_batch(got, want[0], 2e-2)
    at = defined(want[0])
    torch.testing.assert_close(
        got.logit_lse[at], want[0].logit_lse[at], atol=1e-4, rtol=0
    )  # the padding is ignored


def test_pipeline_stages_join_into_the_single_process_batch(two_rank_run):
    want, _ = hf_reference(hf_model(), (0, 2, 3), microbatches=2)
    parts0, parts1 = two_rank_run["pp_rank0"], two_rank_run["pp_rank1"]
    assert all(isinstance(p, TapPart) for p in parts0)
    assert [p.layer_ids for p in parts0] == [(0, 2)] and [p.stage for p in parts0] == [0]
    assert [p.layer_ids for p in parts1 if isinstance(p, TapPart)] == [(3,)]
    assert parts0[0].final_hidden is None and parts0[0].next_logprob is None
    assert any(isinstance(m, HeadSync) for m in parts1)
    joiner = StageJoiner(timeout_s=5.0)
    assert joiner.add(parts1[0]) is None  # the last stage may arrive first
    joined = joiner.add(parts0[0])
    assert joined is not None and joiner.stats()["joined"] == 1 and joiner.pending == 0
    assert len(want) == 1
    assert_same_batch(joined, want[0], 2e-2)
