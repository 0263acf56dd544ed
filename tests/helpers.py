"""Helpers several test modules share (imported as ``tests.helpers``; fixtures are in the conftest files)."""

from __future__ import annotations

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
