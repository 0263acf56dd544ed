"""The two recipe schemas, ``WarmstartRecipe`` and ``CotrainRecipe`` (a file's ``kind:`` says which), built from
the sections in ``config/sections.py``; each ``validate()`` holds its kind's cross-field rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from draft_align.config.rules import (
    RecipeError,
    check_above_zero,
    check_choices,
    check_lora,
    check_loss_section,
    check_positive,
)
from draft_align.config.sections import (
    DataConfig,
    DraftConfig,
    EvalConfig,
    LoggingConfig,
    RLConfig,
    SidecarConfig,
    TapConfig,
    TargetConfig,
    TrainConfig,
    WireConfig,
)
from draft_align.conventions import AUTO_VERIFY_MODE, DISTRIBUTION_LOSSES, check_tap_budgets

VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses a higher temperature


@dataclass
class _RecipeHeader:
    """What every recipe starts with; ``kind`` says which schema a file uses."""

    kind: str
    run: str
    output_dir: str = "checkpoints"
    seed: int = 0
    device: str = "cpu"  # cpu | cuda | cuda:N: every forward, training and eval of the run
    target: TargetConfig = field(default_factory=TargetConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run  # everything a run writes goes under it


@dataclass
class WarmstartRecipe(_RecipeHeader):
    kind: str = "warmstart"
    run: str = "warmstart"
    data: DataConfig = field(default_factory=DataConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        """The cross-field rules (field types and choices are the schema's, checked again here for a
        recipe built in code)."""
        _check_header(self)
        if self.draft.head == "mtp":
            if self.draft.mtp_depth < 1:
                raise RecipeError(f"draft.mtp_depth {self.draft.mtp_depth}: must be ≥ 1")
            if self.draft.aux_layer_ids is not None:
                raise RecipeError(
                    "draft.aux_layer_ids: an MTP head reads the target's final hidden state only"
                )
        check_lora("draft", self.draft.adapt, self.draft.lora)
        if self.draft.adapt == "lora" and self.draft.head == "eagle3" and not self.draft.init_from:
            raise RecipeError("draft.adapt=lora adapts a warm-started EAGLE-3 draft: set draft.init_from")
        if self.train.ttt_steps < 1:
            raise RecipeError("train.ttt_steps must be ≥ 1")
        # every warm-start record carries the target's final hidden state (its capture), so every loss has p
        check_loss_section("train", self.train)
        if self.eval.k < 1:
            raise RecipeError("eval.k must be ≥ 1")
        check_positive(
            self,
            [
                ("train.batch_tokens", 1),
                ("train.max_consecutive_nonfinite", 1),
                ("data.gen_batch_size", 1),
                ("data.gen_max_new_tokens", 1),
            ],
        )
        if not self.data.gen_temperature >= 0:
            raise RecipeError(
                f"data.gen_temperature must be ≥ 0 (0: greedy), got {self.data.gen_temperature}"
            )
        if self.data.gen_engine == "vllm" and self.data.gen_temperature > VLLM_MAX_TEMPERATURE:
            raise RecipeError(
                f"data.gen_temperature {self.data.gen_temperature}: vLLM samples at T ≤ "
                f"{VLLM_MAX_TEMPERATURE:g} only; use data.gen_engine=hf (or auto)"
            )
        budget = self.data.gen_time_budget_s
        if budget is not None and not budget >= 0:
            raise RecipeError(f"data.gen_time_budget_s must be ≥ 0 seconds or null (no limit), got {budget}")
        check_above_zero(self, ("train.lr", "train.grad_clip"))


@dataclass
class CotrainRecipe(_RecipeHeader):
    kind: str = "cotrain"
    run: str = "cotrain"
    # the starting draft: a published draft folder (or a run folder with `latest`); when null, the
    # warm-start recipe below is run (or its published draft reused)
    draft: str | None = None
    warmstart_recipe: str = "recipes/smollm2_demo.yaml"
    data: DataConfig = field(default_factory=DataConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    tap: TapConfig = field(default_factory=TapConfig)
    sidecar: SidecarConfig = field(default_factory=SidecarConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        """The cross-field rules (field types and choices are the schema's, checked again here for a
        recipe built in code)."""
        _check_header(self)
        check_lora("sidecar", self.sidecar.adapt, self.sidecar.lora)
        check_loss_section("sidecar", self.sidecar)
        if not self.tap.send_final:
            if self.sidecar.loss in DISTRIBUTION_LOSSES:
                raise RecipeError(
                    f"sidecar.loss={self.sidecar.loss} needs the target's distribution, but "
                    f"tap.send_final=false ships hard tokens only (no final hidden state): set "
                    f"tap.send_final=true"
                )
            raise RecipeError(
                "tap.send_final=false: the sidecar drops tapped batches without the final hidden "
                "state (its publish gate estimates acceptance from it), so nothing would train"
            )
        if self.rl.engine == "vllm" and self.rl.verify_mode == "greedy" and self.rl.temperature > 0:
            raise RecipeError(
                "rl.verify_mode greedy (argmax everywhere) at T > 0 has no vLLM equivalent: use "
                "greedy_draft (vLLM's default) or probabilistic, or rl.engine=reference"
            )
        if self.rl.verify_mode == AUTO_VERIFY_MODE and (
            self.rl.engine != "vllm" or self.rl.engine_probe_prompts == 0
        ):
            raise RecipeError(
                "rl.verify_mode=auto chooses the draft sampling by measuring both on vLLM's probe prompts: it "
                "needs rl.engine=vllm and rl.engine_probe_prompts > 0 (or choose greedy_draft | probabilistic)"
            )
        if self.rl.verify_recheck_every < 0:
            raise RecipeError("rl.verify_recheck_every must be ≥ 0 (0: measure the verify mode once)")
        if not 0.0 <= self.rl.frozen_fraction <= 1.0:
            raise RecipeError("rl.frozen_fraction must be in [0, 1]")
        if self.rl.group_size < 2:
            raise RecipeError("rl.group_size must be ≥ 2 (GRPO normalises within a group)")
        if self.rl.engine_probe_prompts < 0 or self.rl.engine_probe_tokens < 2:
            raise RecipeError(
                "rl.engine_probe_prompts must be ≥ 0 (0 turns the probe guard off) and "
                "rl.engine_probe_tokens ≥ 2 (one token gives no draft round)"
            )
        if not 0.0 < self.rl.engine_probe_min_ratio <= 1.0:
            raise RecipeError(
                f"rl.engine_probe_min_ratio must be in (0, 1] (to turn the guard off: "
                f"rl.draft_guard=none), got {self.rl.engine_probe_min_ratio}"
            )
        if self.rl.draft_guard == "probe" and self.rl.engine_probe_prompts == 0:
            raise RecipeError(
                "rl.draft_guard=probe decodes rl.engine_probe_prompts after each new draft: set it > 0, or use "
                "rl.draft_guard=counters (the step's own rollouts) or none"
            )
        try:
            check_tap_budgets(self.tap.tokens_per_step, self.tap.max_tokens_per_message)  # the Tap's own rule
        except ValueError as e:
            raise RecipeError(f"tap.{e}") from e
        if self.sidecar.max_replay_ratio <= 0:
            raise RecipeError("sidecar.max_replay_ratio must be > 0")
        if self.sidecar.holdout_every < 1:
            raise RecipeError(f"sidecar.holdout_every must be ≥ 1, got {self.sidecar.holdout_every}")
        if self.sidecar.anchor_decay < 0:
            raise RecipeError(f"sidecar.anchor_decay must be ≥ 0 (0: off), got {self.sidecar.anchor_decay}")
        if self.sidecar.lr_ramp_tokens < 0:
            raise RecipeError(
                f"sidecar.lr_ramp_tokens must be ≥ 0 (0: off), got {self.sidecar.lr_ramp_tokens}"
            )
        check_positive(
            self,
            [
                ("sidecar.batch_tokens", 1),
                ("sidecar.ttt_steps", 1),
                ("sidecar.eval_k", 1),
                ("sidecar.buffer_tokens", 1),
                ("sidecar.max_consecutive_nonfinite", 1),
                ("sidecar.keep_versions", 2),
                ("sidecar.max_seq_tokens", 2),
                ("sidecar.num_threads", 1),
                ("sidecar.log_every", 1),
                ("wire.max_message_mb", 1),
                ("wire.max_tokens", 1),
                ("wire.queue_messages", 1),
                ("wire.queue_mb", 1),
                ("rl.spec_k", 1),
                ("rl.steps", 1),
            ],
        )
        # a negative grad_clip turns descent into ascent, 0 zeroes every gradient
        check_above_zero(
            self, ("sidecar.checkpoint_every_s", "sidecar.lr", "rl.lr", "sidecar.grad_clip", "rl.grad_clip")
        )
        if not self.sidecar.publish_every_s >= 0:
            raise RecipeError(f"sidecar.publish_every_s must be ≥ 0, got {self.sidecar.publish_every_s}")
        port = self.sidecar.prometheus_port
        if port is not None and not 0 <= port <= 65535:
            raise RecipeError(
                f"sidecar.prometheus_port must be in 0..65535 (0: any free port) or null, got {port}"
            )
        if self.sidecar.buffer_tokens < self.sidecar.batch_tokens:
            raise RecipeError("sidecar.buffer_tokens must be ≥ sidecar.batch_tokens")
        if self.sidecar.ranks < 1 or not self.sidecar.collective_timeout_s > 0:
            raise RecipeError("sidecar.ranks must be ≥ 1 and sidecar.collective_timeout_s > 0")
        sc = self.sidecar
        if not 0.0 < sc.drift_tolerance < 1.0 or not sc.drift_head_threshold > 0 or sc.drift_window < 1:
            raise RecipeError(
                "sidecar.drift_tolerance must be in (0, 1), sidecar.drift_head_threshold > 0 and "
                "sidecar.drift_window ≥ 1"
            )
        if sc.train_trigger == "drift" and sc.ranks > 1:
            raise RecipeError(
                "sidecar.train_trigger=drift runs in a single-process sidecar only (sidecar.ranks=1)"
            )


Recipe = WarmstartRecipe | CotrainRecipe
R = TypeVar("R", WarmstartRecipe, CotrainRecipe)

SCHEMAS: dict[str, type[Recipe]] = {"warmstart": WarmstartRecipe, "cotrain": CotrainRecipe}
KIND_NAMES = {"warmstart": "warm-start", "cotrain": "co-training"}  # as error messages name them


def _check_header(recipe: Recipe) -> None:
    """What ``validate()`` checks first for every kind: ``kind`` names this schema, and every choice field
    holds one of its values (loading checks that already; again here for a recipe built in code)."""
    kind = type(recipe).kind
    if recipe.kind != kind:
        raise RecipeError(
            f"kind {recipe.kind!r}: this is a {recipe.kind} recipe, not a {KIND_NAMES[kind]} one"
        )
    check_choices(recipe, "")
