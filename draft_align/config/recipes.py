"""The two recipe schemas, ``WarmstartRecipe`` and ``CotrainRecipe`` (a file's ``kind:`` says which), built from
the sections in ``config/sections.py``; each ``validate()`` holds its kind's cross-field rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from draft_align.config.rules import (
    RANGES,
    SEED,
    RecipeError,
    check_choices,
    check_lora,
    check_loss_section,
    check_push,
    check_ranges,
    check_run_name,
    check_strings,
)
from draft_align.config.sections import (
    CotrainLoggingConfig,
    DataConfig,
    DraftConfig,
    EvalConfig,
    LoggingConfig,
    PushConfig,
    RayConfig,
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

    kind: str  # which schema the file uses: warmstart | cotrain
    run: str  # the run's name: everything it writes goes to <output_dir>/<run>/
    output_dir: str = "checkpoints"  # where run folders are made
    seed: int = 0  # the run's random seed (initialisation, sampling, batching)
    device: str = "cpu"  # cpu | cuda | cuda:N: every forward, training and eval of the run
    target: TargetConfig = field(default_factory=TargetConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run  # everything a run writes goes under it


RANGES[_RecipeHeader] = {"seed": SEED}


@dataclass
class WarmstartRecipe(_RecipeHeader):
    kind: str = "warmstart"  # which schema the file uses: warmstart | cotrain
    run: str = "warmstart"  # the run's name: everything it writes goes to <output_dir>/<run>/
    data: DataConfig = field(default_factory=DataConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        """The cross-field rules (field types and choices are the schema's, checked again here for a
        recipe built in code)."""
        _check_header(self)
        if self.draft.head in ("llama_block_mtp", "native_mtp"):
            if self.draft.aux_layer_ids is not None:
                raise RecipeError(
                    "draft.aux_layer_ids: an MTP head reads the target's final hidden state only"
                )
        if self.draft.mtp_impl == "megatron" and (
            self.draft.head != "native_mtp" or self.draft.init_from or self.draft.adapt != "full"
        ):
            raise RecipeError(
                "draft.mtp_impl=megatron builds the target checkpoint's own MTP layers in megatron-core: "
                "draft.head=native_mtp, draft.adapt=full, no draft.init_from"
            )
        if self.draft.mtp_impl == "megatron" and self.train.objective.autocast_bf16 is not False:
            raise RecipeError(
                "draft.mtp_impl=megatron: set train.objective.autocast_bf16=false (megatron-core's linear layers "
                "run their backward in the weights' dtype and refuse torch autocast's bf16 gradients)"
            )
        check_lora("draft", self.draft.adapt, self.draft.lora)
        if self.draft.adapt == "lora" and self.draft.head == "eagle3" and not self.draft.init_from:
            raise RecipeError("draft.adapt=lora adapts a warm-started EAGLE-3 draft: set draft.init_from")
        # every warm-start record carries the target's final hidden state (its capture), so every loss has p
        check_loss_section("train.objective", self.train.objective)
        if self.data.gen_engine == "vllm" and self.data.gen_temperature > VLLM_MAX_TEMPERATURE:
            raise RecipeError(
                f"data.gen_temperature {self.data.gen_temperature}: vLLM samples at T ≤ "
                f"{VLLM_MAX_TEMPERATURE:g} only; use data.gen_engine=hf (or auto)"
            )


@dataclass
class CotrainRecipe(_RecipeHeader):
    kind: str = "cotrain"  # which schema the file uses: warmstart | cotrain
    run: str = "cotrain"  # the run's name: everything it writes goes to <output_dir>/<run>/
    # the starting draft: a published draft folder (or a run folder with `latest`); when null, the
    # warm-start recipe below is run (or its published draft reused)
    draft: str | None = None
    # run first when its draft is not published yet (and `draft` is unset)
    warmstart_recipe: str = "recipes/smollm2_demo.yaml"
    data: DataConfig = field(default_factory=DataConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    tap: TapConfig = field(default_factory=TapConfig)
    sidecar: SidecarConfig = field(default_factory=SidecarConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    push: PushConfig = field(default_factory=PushConfig)  # draft-align push beside vLLM servers
    logging: CotrainLoggingConfig = field(default_factory=CotrainLoggingConfig)

    def validate(self) -> None:
        """The cross-field rules (field types and choices are the schema's, checked again here for a
        recipe built in code)."""
        _check_header(self)
        check_push(self.push)
        check_lora("sidecar.train", self.sidecar.train.adapt, self.sidecar.train.lora)
        check_loss_section("sidecar.train.objective", self.sidecar.train.objective)
        if not self.tap.send_final:
            if (loss := self.sidecar.train.objective.loss) in DISTRIBUTION_LOSSES:
                raise RecipeError(
                    f"sidecar.train.objective.loss={loss} needs the target's distribution, but "
                    f"tap.send_final=false ships hard tokens only (no final hidden state): set "
                    f"tap.send_final=true"
                )
            raise RecipeError(
                "tap.send_final=false: the sidecar drops tapped batches without the final hidden "
                "state (its publish gate estimates acceptance from it), so nothing would train"
            )
        _check_rl(self.rl)
        try:
            check_tap_budgets(self.tap.tokens_per_step, self.tap.max_tokens_per_message)  # the Tap's own rule
        except ValueError as e:
            raise RecipeError(f"tap.{e}") from e
        if any(not v >= 0 for v in self.ray.resources.values()):
            raise RecipeError(f"ray.resources must be ≥ 0 each, got {dict(self.ray.resources)}")
        if not self.ray.namespace:
            raise RecipeError("ray.namespace must not be empty")
        sc = self.sidecar
        if sc.buffer.tokens < sc.train.batch_tokens:
            raise RecipeError("sidecar.buffer.tokens must be ≥ sidecar.train.batch_tokens")
        if sc.trigger.when == "drift" and sc.ranks > 1:
            raise RecipeError(
                "sidecar.trigger.when=drift runs in a single-process sidecar only (sidecar.ranks=1)"
            )


def _check_rl(rl: RLConfig) -> None:
    """``rl``'s rules between its sections: the engine's verify mode, its probe prompts, the guard."""
    engine, guard = rl.engine, rl.guard
    if engine.kind == "vllm" and engine.verify_mode == "greedy" and rl.task.temperature > 0:
        raise RecipeError(
            "rl.engine.verify_mode greedy (argmax everywhere) at T > 0 has no vLLM equivalent: use "
            "greedy_draft (vLLM's default) or probabilistic, or rl.engine.kind=reference"
        )
    if engine.verify_mode == AUTO_VERIFY_MODE and (engine.kind != "vllm" or guard.probe_prompts == 0):
        raise RecipeError(
            "rl.engine.verify_mode=auto chooses the draft sampling by measuring both on vLLM's probe prompts: "
            "it needs rl.engine.kind=vllm and rl.guard.probe_prompts > 0 (or choose greedy_draft | "
            "probabilistic)"
        )
    if engine.kind == "server":
        _check_server(rl)
    if guard.kind == "probe" and guard.probe_prompts == 0:
        raise RecipeError(
            "rl.guard.kind=probe decodes rl.guard.probe_prompts after each new draft: set it > 0, or use "
            "rl.guard.kind=counters (the step's own rollouts) or none"
        )


def _check_server(rl: RLConfig) -> None:
    """``rl.engine.kind: server``: one server serves one draft (the push process's), so nothing decodes the
    frozen draft beside it and the engine probes nothing."""
    engine = rl.engine
    if engine.frozen_fraction != 0:
        raise RecipeError(
            "rl.engine.kind=server: one server serves one draft (the one draft-align push keeps current), so "
            "there are no frozen-draft rollouts: set rl.engine.frozen_fraction=0"
        )
    if (
        rl.guard.kind == "probe"
        or engine.verify_mode == AUTO_VERIFY_MODE
        or engine.verify_mode == "probabilistic"
    ):
        raise RecipeError(
            "rl.engine.kind=server: the server's draft sampling and guard are its own: use "
            "rl.guard.kind=counters or none and rl.engine.verify_mode=greedy_draft"
        )
    if engine.server_url is not None and not engine.server_url.startswith(("http://", "https://")):
        raise RecipeError(f"rl.engine.server_url: {engine.server_url!r} is not an http://host:port URL")


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
    check_run_name(recipe.run)
    check_strings(recipe)  # no control characters, no path longer than MAX_STRING
    check_ranges(recipe)  # every numeric field in its declared range (config/rules.py RANGES)
