import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from draft_align.rl.policy import Policy, PolicyError, Sequences, adapter_dir, gather_response

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAIRS = [
    (torch.tensor([1, 40, 41, 42]), torch.tensor([50, 51, 2])),
    (torch.tensor([1, 60]), torch.tensor([70, 71, 72, 73, 74])),
    (torch.tensor([1, 30, 31, 32, 33, 34]), torch.tensor([80])),
]


@pytest.fixture
def load(tiny_world, tiny_env):
    def make(dtype=torch.float32):
        return AutoModelForCausalLM.from_pretrained(tiny_world.model, dtype=dtype).eval()

    return make


def new_policy(model, r=4, seed=0):
    return Policy(model, lora_r=r, lora_alpha=2 * r, target_modules=TARGETS, seed=seed)


def seqs():
    return Sequences.pack(PAIRS, pad_id=2)


def train_step(policy, lr=1e-2):
    """One AdamW step raising log p of the response tokens: moves the LoRA B matrices off zero."""
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=lr, weight_decay=0.0)
    logits, tokens = policy.response_logits(seqs())
    loss = -F.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).mean()
    loss.backward()
    opt.step()
    policy.version += 1


def manual_kl(policy, base, batch):
    with torch.no_grad():
        p = F.log_softmax(policy.logits(batch.input_ids, batch.attention_mask).double(), -1)
        q = F.log_softmax(
            base(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double(), -1
        )
    sel = batch.loss_mask[:, 1:]
    p, q = p[:, :-1][sel], q[:, :-1][sel]
    return float((p.exp() * (p - q)).sum(-1).mean())


# ---------------------------------------------------------------- sequences
def test_pack_right_pads_and_masks_responses():
    s = seqs()
    assert s.input_ids.tolist() == [
        [1, 40, 41, 42, 50, 51, 2],
        [1, 60, 70, 71, 72, 73, 74],
        [1, 30, 31, 32, 33, 34, 80],
    ]
    short = Sequences.pack(PAIRS[:1] + [(torch.tensor([5]), torch.tensor([6]))], pad_id=9)
    assert short.input_ids[1].tolist() == [5, 6, 9, 9, 9, 9, 9]
    assert short.attention_mask[1].tolist() == [1, 1, 0, 0, 0, 0, 0]
    assert short.loss_mask[1].tolist() == [False, True, False, False, False, False, False]
    assert s.loss_mask.sum(1).tolist() == [3, 5, 1] and s.num_response_tokens == 9
    mb = list(short.micro_batches(1))
    assert [tuple(m.input_ids.shape) for m in mb] == [(1, 7), (1, 2)]  # each cropped to its own length


@pytest.mark.parametrize(
    ("pairs", "match"),
    [
        ([], "no sequences"),
        ([(torch.tensor([1]), torch.tensor([], dtype=torch.long))], "must be non-empty"),
        ([(torch.tensor([], dtype=torch.long), torch.tensor([3]))], "must be non-empty"),
    ],
)
def test_pack_rejects_bad_pairs(pairs, match):
    with pytest.raises(PolicyError, match=match):
        Sequences.pack(pairs, pad_id=0)


def test_sequences_reject_response_at_position_zero():
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(PolicyError, match="position 0"):
        Sequences(ids, torch.ones_like(ids), torch.tensor([[True, True, False]]))
    with pytest.raises(PolicyError, match="equal"):
        Sequences(ids, torch.ones(1, 2, dtype=torch.long), torch.zeros(1, 3, dtype=torch.bool))


# ---------------------------------------------------------------- construction and version 0
def test_only_lora_trains_and_version0_is_the_base_model(load):
    base, policy = load(), new_policy(load())
    names = [n for n, p in policy.peft_model.named_parameters() if p.requires_grad]
    assert names and all("lora_A" in n or "lora_B" in n for n in names)
    assert len(names) == 2 * len(TARGETS) * 6  # A and B per targeted projection per layer
    assert all(not p.detach().any() for n, p in policy.peft_model.named_parameters() if "lora_B" in n)
    assert policy.version == 0
    b = seqs()
    with torch.no_grad():
        got = policy.logits(b.input_ids, b.attention_mask)
        want = base(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    assert torch.equal(got, want)


def test_same_seed_same_lora_init(load):
    a, b, c = new_policy(load(), seed=1), new_policy(load(), seed=1), new_policy(load(), seed=2)
    pa, pb, pc = (p.trainable_parameters()[0] for p in (a, b, c))  # a lora_A matrix
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_unknown_target_module_rejected(load):
    with pytest.raises(PolicyError, match=r"\['qkv_proj'\]"):
        Policy(load(), lora_r=4, lora_alpha=8, target_modules=["q_proj", "qkv_proj"])
    with pytest.raises(PolicyError, match="lora_r"):
        Policy(load(), lora_r=0, lora_alpha=8, target_modules=["q_proj"])


def test_response_logits_match_full_forward(load):
    policy = new_policy(load())
    train_step(policy)
    b = seqs()
    with torch.no_grad():
        full, tok_full = gather_response(policy.logits(b.input_ids, b.attention_mask), b)
        part, tok_part = policy.response_logits(b)
    assert tok_full.tolist() == [50, 51, 2, 70, 71, 72, 73, 74, 80] == tok_part.tolist()
    torch.testing.assert_close(part, full, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- KL to the initial policy
def test_kl_zero_at_v0_and_positive_after_update(load):
    base, policy = load(), new_policy(load())
    assert policy.kl_to_initial(seqs()) == 0.0
    train_step(policy)
    kl = policy.kl_to_initial(seqs(), micro_batch=2)
    assert kl > 1e-6
    assert kl == pytest.approx(manual_kl(policy, base, seqs()), rel=1e-4)
    with policy.initial():  # the adapter-disabled model is the base model
        assert manual_kl(policy, base, seqs()) == pytest.approx(0.0, abs=1e-9)


# ---------------------------------------------------------------- persistence
def test_adapter_round_trip(load, tmp_path):
    policy = new_policy(load())
    train_step(policy)
    train_step(policy)
    out = policy.save_adapter(adapter_dir(tmp_path, policy.version))
    assert out == tmp_path / "policy" / "v0002"
    assert {"adapter_model.safetensors", "adapter_config.json", "policy_version.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not [p for p in (tmp_path / "policy").iterdir() if p.name.startswith(".")]  # no temp left
    modes = {p.name: p.stat().st_mode & 0o777 for p in (out, *out.iterdir())}  # storage.py's mode policy
    assert modes == {p.name: 0o750 if p.is_dir() else 0o640 for p in (out, *out.iterdir())}, modes
    with pytest.raises(PolicyError, match="already exists"):
        policy.save_adapter(out)

    other = new_policy(load(), seed=5)
    assert other.load_adapter(out) == 2 and other.version == 2
    b = seqs()
    with torch.no_grad():
        want = policy.logits(b.input_ids, b.attention_mask)
        got = other.logits(b.input_ids, b.attention_mask)
    assert torch.equal(got, want)

    with pytest.raises(PolicyError, match="r=4, this policy has 8"):
        new_policy(load(), r=8).load_adapter(out)
    (out / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(PolicyError, match="not a readable policy adapter"):
        other.load_adapter(out)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
def test_merged_folder_reloads_with_same_logits(load, tiny_world, tmp_path, dtype, tol):
    from transformers import AutoTokenizer

    policy = new_policy(load(dtype))
    train_step(policy, lr=3e-2)
    b = seqs()
    with torch.no_grad():
        live = policy.logits(b.input_ids, b.attention_mask).float()
        base = load(dtype)(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
    out = policy.save_merged(tmp_path / "merged", AutoTokenizer.from_pretrained(tiny_world.model))
    assert json.loads((out / "policy_version.json").read_text()) == {"policy_version": 1}
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        got = merged(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
        after = policy.logits(b.input_ids, b.attention_mask).float()
    assert (live - base).abs().max() > 10 * tol  # the update is visible above the tolerance
    torch.testing.assert_close(got, live, rtol=0, atol=tol)
    assert torch.equal(after, live)  # the live model was not merged or changed
    assert AutoTokenizer.from_pretrained(out).encode("hi") == AutoTokenizer.from_pretrained(
        tiny_world.model
    ).encode("hi")


def test_merged_folder_keeps_the_checkpoints_own_mtp_layers(tiny_env, tmp_path):
    """transformers drops a MiMo checkpoint's MTP layers when it loads the trunk; the merged policy carries them
    over unchanged with the source's architecture, so vLLM can still serve it with its MTP drafter."""
    import safetensors.torch

    from benchmarks.common.mtp_checkpoints import mtp_names, save_checkpoint

    src = tmp_path / "mimo"
    _, tensors = save_checkpoint("mimo", src)
    policy = new_policy(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval())
    train_step(policy, lr=3e-2)
    out = policy.save_merged(tmp_path / "merged")
    written = {}
    for f in out.glob("*.safetensors"):
        written.update(safetensors.torch.load_file(str(f)))
    mtp = mtp_names("mimo", tensors)
    assert mtp and mtp <= set(written)
    assert all(torch.equal(written[k], tensors[k]) for k in mtp)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(written[q], tensors[q])  # the trunk is the merged policy's
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MiMoForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any(k.startswith("model.mtp_layers.") for k in reloaded.state_dict())


def test_merged_folder_of_a_model_without_extra_tensors_is_unchanged(load, tiny_world, tmp_path):
    policy = new_policy(load())
    out = policy.save_merged(tmp_path / "merged")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == json.loads((tiny_world.model / "config.json").read_text())["architectures"]
    assert [f.name for f in out.glob("*.safetensors")] == ["model.safetensors"]
