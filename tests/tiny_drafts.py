"""Tiny target and drafts shared by the reference decoder's tests (tests/engines/reference/) and the estimators'
(tests/monitor/): built once per session, fixed seeds.  A pytest plugin (``pytest_plugins`` in tests/conftest.py),
so one session builds each once; the two folders' conftests run their modules on one torch thread
(:func:`single_thread`)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft
from draft_align.hf.capture import HFTap
from draft_align.hf.parts import decoder_parts

AUX = (2, 3, 4)  # the engines' default (2, L//2, L-3) is (2, 3, 3) for 6 layers: not distinct
LOGIT_SCALE = 15.0  # random init gives near-uniform logits; scaled, the top token holds ~40% on average


@contextlib.contextmanager
def single_thread():
    # Tiny tensors: thread fan-out costs more than it saves, and is ruinous on a shared 2-core box.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=64,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model.requires_grad_(False)
    model.generation_config.pad_token_id = 0
    return model


def random_draft(target, vocab: torch.Tensor, seed: int) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = Eagle3Config.from_target(
        target.config, draft_vocab_size=vocab.numel(), aux_layer_ids=AUX, torch_dtype="float32"
    )
    d = Eagle3Draft(cfg)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    d.set_vocab(vocab)
    return d.eval()


@pytest.fixture(scope="session")
def draft_random48(target):
    g = torch.Generator().manual_seed(5)
    return random_draft(target, torch.randperm(64, generator=g)[:48].sort().values, seed=6)


@pytest.fixture(scope="session")
def draft_random64(target):
    return random_draft(target, torch.arange(64), seed=7)


@pytest.fixture(scope="session")
def draft_good48(target):
    """Trained briefly (K=3 TTT unroll, soft targets) on the target's own T=1 samples: high acceptance."""
    with single_thread():  # session fixtures are built before the module-scoped one_thread
        return train_good_draft(target)


def train_good_draft(target) -> Eagle3Draft:
    batch, length, k = 64, 40, 3
    g = torch.Generator().manual_seed(1)
    ids = sample_from(target, torch.randint(0, 64, (batch, 4), generator=g), length, 1.0, seed=2)
    with torch.no_grad(), HFTap(target, AUX, capture_final=False) as tap:
        logits = target(ids).logits
        aux = tap.pop().aux
    vocab = torch.bincount(ids.flatten(), minlength=64).argsort(descending=True)[:48].sort().values
    d = random_draft(target, vocab, seed=8).train()
    with torch.no_grad():
        d.lm_head.weight.copy_(target.lm_head.weight[vocab])
    embed = decoder_parts(target)[0]
    logp = torch.log_softmax(logits[..., vocab], dim=-1)  # target restricted to the draft vocab
    starts = torch.arange(length - 2).expand(16, -1)
    every = torch.ones(16, length, dtype=torch.bool)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    for _ in range(200):
        rows = torch.randint(0, batch, (16,), generator=g)
        out = d.unroll(
            aux[rows], embed, ids[rows], every, starts, torch.ones_like(starts, dtype=torch.bool), k
        )
        loss = torch.zeros(())
        for j, q in enumerate(out):
            pos = (starts + 1 + j).clamp(max=length - 1)
            ok = starts + 2 + j <= length - 1
            tgt = logp[rows].gather(1, pos.unsqueeze(-1).expand(-1, -1, vocab.numel()))
            ce = -(tgt.exp() * F.log_softmax(q, dim=-1)).sum(-1)
            loss = loss + 0.8**j * (ce * ok).sum() / ok.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval().requires_grad_(False)


def sample_from(target, prompts: torch.Tensor, length: int, temperature: float, seed: int) -> torch.Tensor:
    """Batched ancestral sampling from the target: prompts [B, P] → [B, length] (prompt included)."""
    g = torch.Generator().manual_seed(seed)
    ids = prompts
    with torch.no_grad():
        while ids.shape[1] < length:
            probs = torch.softmax(target(ids).logits[:, -1] / temperature, -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    return ids


@pytest.fixture(scope="session")
def target_samples(target):
    """64 sequences of 40 tokens sampled at T = 1 after 4-token random prompts (not the training data)."""
    prompts = torch.randint(0, 64, (64, 4), generator=torch.Generator().manual_seed(77))
    with single_thread():
        return sample_from(target, prompts, 40, 1.0, seed=78)
