"""Shared by the sidecar tests: the policy side of a test (:class:`Feeder`) and a set-up sidecar on the tiny
target (``sidecar_world``)."""

from __future__ import annotations

import pytest
import torch

from draft_align.config import CotrainRecipe, load_recipe


class Feeder:
    """The policy side of a test: a tiny HF target, an HFPolicyTap and a TapSender to the sidecar (its ipc
    socket in the run folder, or ``endpoints``)."""

    def __init__(
        self,
        recipe: CotrainRecipe,
        draft_to_target: torch.Tensor,
        aux: tuple[int, ...],
        endpoints: list[str] | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        from draft_align.tap.hf import HFPolicyTap
        from draft_align.wire import channel

        self.recipe = recipe
        self.model = AutoModelForCausalLM.from_pretrained(recipe.target.model, dtype=torch.float32).eval()
        self.key = channel.resolve_key(None, recipe.run_dir, create=True)
        self.sender = channel.TapSender(
            endpoints or channel.default_endpoint(recipe.run_dir, "tap"), self.key, send_timeout_s=0.5
        )
        self.tap = HFPolicyTap(self.model, aux, self.sender, run_id=recipe.run, tokens_per_step=2000)
        self.d2t = draft_to_target
        from transformers import AutoTokenizer

        from draft_align import data

        tok = AutoTokenizer.from_pretrained(recipe.target.model)
        convs = data.load_conversations(recipe.data.source)
        self.prompts = [data.encode_prompt(tok, c) for c in convs]

    def step(self, step: int, version: int, n: int = 8) -> None:
        """One RL step's worth of taps: the tiny target's own T=1 continuations of chat prompts."""
        from draft_align.hf.generate import generate_responses
        from draft_align.rl.policy import Sequences
        from draft_align.wire.messages import StepReport

        if version != getattr(self, "_synced", -1):
            self.tap.head_sync(version, self.d2t)
            self._synced = version
        prompts = [self.prompts[(step * n + i) % len(self.prompts)] for i in range(n)]
        resp = generate_responses(
            self.model,
            prompts,
            max_new_tokens=24,
            temperature=1.0,
            eos_ids={2},
            pad_id=2,
            batch_size=n,
            seed=step,
        )
        pairs = [(p, r) for p, r in zip(prompts, resp, strict=True) if r is not None and r.numel() > 0]
        seqs = Sequences.pack(pairs, pad_id=2)
        with torch.no_grad(), self.tap.capturing():
            logits = self.model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
            self.tap.submit(
                input_ids=seqs.input_ids,
                attention_mask=seqs.attention_mask,
                loss_mask=seqs.loss_mask,
                logits=logits,
                policy_version=version,
                step=step,
                temperature=1.0,
            )
        self.tap.end_step()
        self.sender.offer(
            StepReport(
                run_id=self.recipe.run,
                step=step,
                policy_version=version,
                metrics={"reward_mean": 0.25 * step, "accept_measured_adapted": 1.5},
            )
        )

    def close(self) -> None:
        self.sender.close()


@pytest.fixture
def feeder_cls() -> type[Feeder]:
    """:class:`Feeder` itself, for tests that build the policy side without a sidecar in the process."""
    return Feeder


@pytest.fixture
def sidecar_world(tiny_run, tiny_env, tmp_path, request):
    """(recipe, set-up Sidecar, Feeder) on the tiny target; ``indirect`` parametrization passes a dict of further
    recipe overrides as the param."""
    from draft_align.sidecar.launch import starting_draft
    from draft_align.sidecar.loop import Sidecar

    extra = request.param if hasattr(request, "param") else {}
    recipe = load_recipe(None, tiny_run.cotrain_overrides(tmp_path, **extra), CotrainRecipe)
    sc = Sidecar(recipe, starting_draft(recipe)).setup()
    feeder = Feeder(recipe, sc.frozen.draft_to_target, sc.aux_ids)
    yield recipe, sc, feeder
    feeder.close()
    sc.close()
