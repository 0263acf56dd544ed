"""Helpers several test modules share (imported as ``tests.helpers``; fixtures are in the conftest files)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn


class ListSink:
    """A TapSink backed by a list; accepts at most ``capacity`` messages (None: all), counting the refused."""

    def __init__(self, capacity: int | None = None) -> None:
        self.messages: list = []
        self.refused = 0
        self.capacity = capacity

    def offer(self, message) -> bool:
        if self.capacity is not None and len(self.messages) >= self.capacity:
            self.refused += 1
            return False
        self.messages.append(message)
        return True


def saved_bytes(fn: Callable[[], Any]) -> int:
    """Bytes autograd keeps for backward while ``fn`` runs (checkpointed regions keep only their inputs)."""
    seen: dict[int, int] = {}

    def pack(x):
        seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(seen.values())


def random_eagle3(target: nn.Module, seed: int = 0, aux: tuple[int, ...] = (1, 3, 4), vocab: int = 24):
    """An EAGLE-3 draft of ``target`` (fp32) with N(0, 0.2²) weights and the draft vocabulary 0, 2, 4, …"""
    from draft_align.heads.eagle3 import Eagle3Config, Eagle3Draft

    torch.manual_seed(seed)
    d = Eagle3Draft(Eagle3Config.from_target(target.config, vocab, aux, torch_dtype="float32"))
    for p in d.parameters():
        nn.init.normal_(p, std=0.2)
    d.set_vocab(torch.arange(0, 2 * vocab, 2))
    return d


def jittered_mtp(
    target: nn.Module, *, depth: int = 1, layout: str = "deepseek_v3", seed: int = 1, noise: float = 0.1
):
    """An MTP head attached to ``target`` whose trainable weights are moved by ``noise`` · N(0, 1)."""
    from draft_align.heads.mtp import MTPDraft

    torch.manual_seed(seed)
    d = MTPDraft.attach(target, depth=depth, layout=layout)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.add_(noise * torch.randn_like(p))
    return d


def random_draft(kind: str, target: nn.Module, seed: int = 0):
    """The LoRA tests' base draft: :func:`random_eagle3` (``kind`` eagle3) or a 2-module :func:`jittered_mtp`."""
    return random_eagle3(target, seed) if kind == "eagle3" else jittered_mtp(target, depth=2, seed=seed)


def perturb_adapters(draft: nn.Module, seed: int = 5, scale: float = 0.3) -> None:
    """Set every LoRA adapter weight of ``draft`` to ``scale`` · N(0, 1) (non-zero B: the adapters change the
    draft)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def make_mtp_head(
    target: nn.Module, layout: str = "deepseek_v3", depth: int = 1, seed: int = 1, noise: float = 0.1
):
    """:func:`jittered_mtp` in eval mode (the MTP head and format tests' head)."""
    return jittered_mtp(target, depth=depth, layout=layout, seed=seed, noise=noise).eval()


def peaky(model: nn.Module, scale: float = 8.0) -> nn.Module:
    """``model`` with its lm_head scaled by ``scale`` (peaky distributions: a draft has something to learn) and
    generation's pad id 0."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.generation_config.pad_token_id = 0
    return model


def lora_policy(path: Path, targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")):
    """The RL Policy (LoRA r=4, α=8, seed 0) over the fp32 HF model at ``path``."""
    from transformers import AutoModelForCausalLM

    from draft_align.rl.policy import Policy

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return Policy(model, lora_r=4, lora_alpha=8, target_modules=list(targets), seed=0)


def drift(policy, std: float, seed: int = 0) -> None:
    """Give the adapter non-zero B matrices (a policy that moved away from the base model)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    policy.version += 1


def run_warmstart(recipe, home: Path) -> tuple[dict[str, Any], float]:
    """``warmstart.run(recipe)`` with its caches under ``home`` and one thread; (summary, seconds)."""
    from draft_align import warmstart

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFT_ALIGN_HOME", str(home))
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        try:
            summary = warmstart.run(recipe)
        finally:
            torch.set_num_threads(threads)
    return summary, time.perf_counter() - t0


# ---------------------------------------------------------------- distribution tests of sampled tokens
def chi2_test(counts: torch.Tensor, probs: torch.Tensor, p_value: float = 1e-3) -> tuple[float, float]:
    """(Pearson χ² statistic, critical value at ``p_value``) with bins merged to expected counts ≥ 5.

    The critical value uses the Wilson–Hilferty approximation (scipy is not a dependency).
    """
    n = counts.sum().item()
    expected = probs.double() * n
    order = expected.argsort()
    groups, cur_o, cur_e = [], 0.0, 0.0
    for i in order.tolist():
        cur_o += counts[i].item()
        cur_e += expected[i].item()
        if cur_e >= 5.0:
            groups.append((cur_o, cur_e))
            cur_o, cur_e = 0.0, 0.0
    if cur_e > 0 or cur_o > 0:  # left-over mass joins the last (largest) group
        o, e = groups.pop()
        groups.append((o + cur_o, e + cur_e))
    stat = sum((o - e) ** 2 / e for o, e in groups)
    df = len(groups) - 1
    z = {1e-3: 3.0902, 1e-2: 2.3263}[p_value]
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def _next_probs(target: nn.Module, ctx: torch.Tensor, temp: float, chunk: int = 512) -> torch.Tensor:
    """softmax(logits / temp) of the token after each row of ``ctx`` [n, t] (float64 [n, V]), in chunks."""
    return torch.cat(
        [
            torch.softmax(target(ctx[i : i + chunk]).logits[:, -1].double() / temp, -1)
            for i in range(0, len(ctx), chunk)
        ]
    )


def exact_three(target: nn.Module, prompt: list[int], temp: float) -> dict[str, Any]:
    """The exact statistics of the 3 tokens ``target`` samples after ``prompt`` at ``temp``: the marginals
    [p(x1), p(x2), p(x3)] ([V] each), the greedy token tables argmax p(x2|x1) [V] and argmax p(x3|x1,x2) [V, V],
    and the probabilities that x2 and x3 are their greedy tokens (V² contexts through ``target``)."""
    with torch.no_grad():
        base = torch.tensor(prompt)
        p1 = _next_probs(target, base[None], temp)[0]
        v = p1.numel()
        ctx2 = torch.cat([base.expand(v, -1), torch.arange(v)[:, None]], 1)
        p2c = _next_probs(target, ctx2, temp)  # [x1, x2]
        ctx3 = torch.cat([ctx2.repeat_interleave(v, 0), torch.arange(v).repeat(v)[:, None]], 1)
        p3c = _next_probs(target, ctx3, temp).view(v, v, v)
    return dict(
        marginals=[p1, p1 @ p2c, torch.einsum("a,ab,abc->c", p1, p2c, p3c)],
        greedy2=p2c.argmax(-1),
        greedy3=p3c.argmax(-1),
        p_greedy=[
            (p1 * p2c.max(-1).values).sum().item(),
            torch.einsum("a,ab,ab->", p1, p2c, p3c.max(-1).values).item(),
        ],
    )


def distribution_stats(
    outs: torch.Tensor, ex: dict[str, Any]
) -> tuple[list[tuple[float, float]], list[float]]:
    """χ² (stat, critical) of each of the 3 sampled tokens' marginals (``outs`` [n, 3] against
    :func:`exact_three`), and z-scores of how often x2, x3 are the greedy token of their context (the statistic
    that a bias towards the drafts moves most)."""
    n = outs.shape[0]
    v = ex["marginals"][0].numel()
    chi2 = [chi2_test(torch.bincount(outs[:, i], minlength=v).double(), ex["marginals"][i]) for i in range(3)]
    hits = [
        (outs[:, 1] == ex["greedy2"][outs[:, 0]]).sum().item(),
        (outs[:, 2] == ex["greedy3"][outs[:, 0], outs[:, 1]]).sum().item(),
    ]
    z = [(h - n * e) / math.sqrt(n * e * (1 - e)) for h, e in zip(hits, ex["p_greedy"], strict=True)]
    return chi2, z
