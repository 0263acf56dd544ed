"""The Tap on verl's old-log-prob pass: verl's own DataProto → left_right_2_no_padding → FSDP engine
``forward_backward_batch`` (packed and padded), against the HF Tap on the same sequences."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import left_right_2_no_padding

from draft_align.integrations.verl.tap import VerlTap, VerlTapError
from draft_align.tap.hf import HFPolicyTap
from tests.helpers import ListSink

AUX = (0, 2, 3)
D2T = torch.arange(0, 50, 2)  # a 25-token draft vocabulary

# a rollout batch as verl's agent loop returns it: left-padded prompts, right-padded responses (0 = pad)
PROMPTS = [[3, 4], [5, 6, 7], [8, 9, 10, 11], [22]]
RESPONSES = [[12, 13, 14], [15, 16, 17, 18, 19], [20, 21], [23, 24, 25, 26]]
# response_mask 0 inside a response: a tool-output token the policy did not sample (multi-turn)
MASKED = {(1, 2)}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        tie_word_embeddings=False,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # peaky: distinct top-k
    return m


def engine_for(model, use_remove_padding: bool):
    """verl's FSDP engine with its own constructor; the HF model set as its module (one rank: no sharding)."""
    mc = SimpleNamespace(use_remove_padding=use_remove_padding, lora_rank=0)
    ec = SimpleNamespace(
        ulysses_sequence_parallel_size=1,
        fsdp_size=-1,
        full_determinism=False,
        param_offload=False,
        optimizer_offload=False,
        entropy_from_logits_with_chunking=False,
        use_torch_compile=False,
        pad_to_length=False,
        pad_to_length_bucket=1024,
        entropy_checkpointing=False,
        qat=None,
    )
    engine = FSDPEngineWithLMHead(mc, ec, None, None)
    engine.module = model
    engine._autocast_dtype = torch.float32
    return engine


def old_log_prob_batch(use_remove_padding: bool, temperatures: list[float] | float, **meta):
    """The TensorDict ``RayPPOTrainer._compute_old_log_prob`` sends: DataProto → to_tensordict →
    left_right_2_no_padding → its meta keys, plus the worker's defaults (micro-batches of 2)."""
    p_w, r_w = max(map(len, PROMPTS)), max(map(len, RESPONSES))
    prompts = torch.tensor([[0] * (p_w - len(p)) + p for p in PROMPTS])
    responses = torch.tensor([r + [0] * (r_w - len(r)) for r in RESPONSES])
    attention = torch.cat([(prompts != 0), (responses != 0)], dim=1).long()
    response_mask = (responses != 0).long()
    for b, t in MASKED:
        response_mask[b, t] = 0
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": torch.clamp(attention.cumsum(dim=1) - 1, min=0),
        "response_mask": response_mask,
    }
    meta_info = {}
    if isinstance(temperatures, list):
        tensors["temperature"] = torch.tensor(temperatures)  # one per sample
    else:
        meta_info["temperature"] = temperatures
    td = left_right_2_no_padding(DataProto.from_dict(tensors=tensors, meta_info=meta_info).to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, **meta)
    tu.assign_non_tensor(
        td,
        use_remove_padding=use_remove_padding,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        use_fused_kernels=False,
    )
    return td


def v1_old_log_prob_batch(temperature: float):
    """The same rollouts as verl's TransferQueue trainer (``trainer.use_v1``, verl 0.9's default) holds them: one
    unpadded row per sample, as ``AgentLoopManagerTQ`` puts them, batched by ``list_of_dict_to_tensordict``."""
    fields = []
    for b, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        ids = torch.tensor(p + r)
        mask = torch.ones(len(r), dtype=torch.int64)
        for bb, t in MASKED:
            if bb == b:
                mask[t] = 0
        fields.append(
            {
                "prompts": torch.tensor(p),
                "responses": torch.tensor(r),
                "response_mask": mask,
                "loss_mask": mask,
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "position_ids": torch.arange(len(ids)),
            }
        )
    td = tu.list_of_dict_to_tensordict(fields)
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, temperature=temperature)
    tu.assign_non_tensor(
        td,
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        use_fused_kernels=False,
    )
    return td


def shipped(sink) -> dict[tuple[int, ...], dict]:
    out = {}
    for msg in sink.messages:
        if not hasattr(msg, "aux_hidden"):
            continue
        cu = msg.cu_seqlens.tolist()
        for a, b in itertools.pairwise(cu):
            seq = {"temperature": float(msg.temperature), "version": (msg.policy_version, msg.step)}
            for name in ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "next_logprob", "logit_lse"):
                seq[name] = getattr(msg, name)[a:b]
            for name in ("topk_ids", "topk_logprobs"):
                seq[name] = getattr(msg, name)[a:b]
            out[tuple(seq["input_ids"].tolist())] = seq
    return out


def hf_reference(model, temperatures: list[float]) -> dict:
    """The HF Tap on the same sequences as one right-padded batch (prompt + response, loss on the response's
    sampled tokens)."""
    sink = ListSink()
    tap = HFPolicyTap(model, AUX, sink, run_id="r", tokens_per_step=10_000, topk=2)
    seqs = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    am = torch.zeros(len(seqs), width, dtype=torch.long)
    lm = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        am[b, : len(p) + len(r)] = 1
        lm[b, len(p) : len(p) + len(r)] = True
        for bb, t in MASKED:
            if bb == b:
                lm[b, len(p) + t] = False
    tap.head_sync(3, D2T)
    with torch.no_grad(), tap.capturing():
        model(input_ids=ids, attention_mask=am)
        tap.submit(
            input_ids=ids,
            attention_mask=am,
            loss_mask=lm,
            logits=None,
            policy_version=3,
            step=3,
            temperature=temperatures,
        )
    tap.end_step()
    return shipped(sink)


@pytest.mark.parametrize("layout", ["packed", "padded", "v1"])
def test_verl_old_log_prob_pass_ships_what_the_hf_tap_ships(gloo_world, model, layout):
    use_remove_padding = layout != "padded"
    temps = [1.0, 0.6, 1.0, 0.6] if layout == "packed" else 0.8
    engine = engine_for(model, use_remove_padding)
    sink = ListSink()
    hf = HFPolicyTap(model, AUX, sink, run_id="r", tokens_per_step=10_000, topk=2)
    vtap = VerlTap(engine, hf, lambda v: hf.head_sync(v, D2T))
    vtap.set_version(3)  # update_weights(global_steps=3) reached the worker
    td = v1_old_log_prob_batch(temps) if layout == "v1" else old_log_prob_batch(use_remove_padding, temps)
    with vtap.log_prob_call(td) as tapped:
        out = engine.forward_backward_batch(td, loss_function=None, forward_only=True)
    assert tapped and vtap.micro_batches == 2 and "forward_step" not in vars(engine)
    assert out["model_output"]["log_probs"] is not None  # verl's own pass ran as usual
    heads = [m for m in sink.messages if not hasattr(m, "aux_hidden")]
    assert [h.policy_version for h in heads] == [3]

    got = shipped(sink)
    ref = hf_reference(model, temps if isinstance(temps, list) else [temps] * len(PROMPTS))
    assert got.keys() == ref.keys() and len(got) == len(PROMPTS)
    for key, want in ref.items():
        have = got[key]
        assert have["version"] == (3, 3)
        assert have["temperature"] == pytest.approx(want["temperature"])
        assert torch.equal(have["loss_mask"], want["loss_mask"])
        for name in ("aux_hidden", "final_hidden", "next_logprob", "logit_lse", "topk_logprobs"):
            torch.testing.assert_close(have[name].float(), want[name].float(), atol=2e-2, rtol=2e-2, msg=name)
        assert torch.equal(have["topk_ids"], want["topk_ids"])
    assert vtap.last_accepted == sum(len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES, strict=True))


@pytest.mark.parametrize(
    "meta",
    [
        {"no_lora_adapter": True, "calculate_entropy": False},  # LoRA: the reference pass through the actor
        {"calculate_entropy": False},  # the reference pass as _compute_ref_log_prob sends it
    ],
    ids=["lora-ref", "ref"],
)
def test_reference_passes_are_never_tapped(gloo_world, model, meta):
    engine = engine_for(model, True)
    sink = ListSink()
    hf = HFPolicyTap(model, AUX, sink, run_id="r", tokens_per_step=10_000)
    vtap = VerlTap(engine, hf, lambda v: hf.head_sync(v, D2T))
    td = old_log_prob_batch(True, 1.0)
    tu.assign_non_tensor(td, **meta)
    with vtap.log_prob_call(td) as tapped:
        engine.forward_backward_batch(td, loss_function=None, forward_only=True)
    assert not tapped and vtap.skipped_calls == 1 and vtap.micro_batches == 0
    assert sink.messages == [] and hf.stats()["sequences_seen"] == 0


def test_ulysses_is_refused_at_start(gloo_world, model):
    engine = engine_for(model, True)
    engine.ulysses_sequence_parallel_size = 2
    hf = HFPolicyTap(model, AUX, ListSink(), run_id="r", tokens_per_step=100)
    with pytest.raises(VerlTapError, match="ulysses_sequence_parallel_size > 1"):
        VerlTap(engine, hf, lambda v: True)
