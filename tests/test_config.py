"""draft_align.config: every recipe loads; unknown keys and bad values fail loudly; overrides apply."""

import dataclasses
import re
from pathlib import Path

import pytest

from draft_align.config import (
    SCHEMAS,
    CotrainRecipe,
    RecipeError,
    WarmstartRecipe,
    load_recipe,
    recipe_kind,
    recipe_to_dict,
)

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def test_recipes_exist():
    assert RECIPES, "no recipes/*.yaml found"


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads_and_validates(path):
    import yaml

    schema = SCHEMAS[recipe_kind(path)]
    r = load_recipe(path, schema=schema)
    assert isinstance(r, schema)
    raw = yaml.safe_load(path.read_text())
    # every value the YAML sets is what the recipe holds (nothing silently dropped)
    as_dict = recipe_to_dict(r)

    def same(held, given, key):  # a nested section: every key it sets, at any depth
        if isinstance(given, dict):
            for k, v in given.items():
                same(held[k], v, f"{key}.{k}" if key else k)
        else:
            assert held == given, key

    same(as_dict, raw, "")
    assert r.run_dir == Path(r.output_dir) / r.run


def test_defaults_without_a_file():
    r = load_recipe(None)
    assert r == WarmstartRecipe()
    assert r.draft.aux_layer_ids is None and r.train.objective.loss == "soft"


def test_overrides_apply_with_types():
    r = load_recipe(
        RECIPES[0].parent / "smollm2_demo.yaml",
        [
            "train.objective.lr=3e-4",
            "draft.aux_layer_ids=[1,3,4]",
            "data.max_conversations=null",
            "eval.temperatures=[0.0]",
            "train.max_steps=7",
            "run=custom",
            "logging.wandb=false",
        ],
    )
    assert r.train.objective.lr == pytest.approx(3e-4) and isinstance(r.train.objective.lr, float)
    assert r.draft.aux_layer_ids == [1, 3, 4]
    assert r.data.max_conversations is None
    assert r.eval.temperatures == [0.0]
    assert r.train.max_steps == 7
    assert r.run == "custom" and r.logging.wandb is False


def test_unknown_key_in_yaml_names_the_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("run: x\ntrain:\n  learning_rate: 0.1\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml.*learning_rate"):
        load_recipe(p, ["train.objective.lr=1e-3"])
    p.write_text("run: x\ntrainer:\n  lr: 0.1\n")
    with pytest.raises(RecipeError, match="trainer"):
        load_recipe(p)


@pytest.mark.parametrize(
    ("override", "key"),
    [("train.lrr=1", "lrr"), ("nosuchsection.x=1", "nosuchsection"), ("data.sourcee=x", "sourcee")],
)
def test_unknown_override_names_the_key(override, key):
    with pytest.raises(RecipeError, match=rf"overrides .*{key}"):
        load_recipe(RECIPES[0], ["train.objective.lr=1e-3", override])


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("sidecar.lr=1e-3", "sidecar.lr moved to sidecar.train.objective.lr"),
        ("sidecar.eval_k=2", "sidecar.eval_k moved to sidecar.gate.k"),
        ("sidecar.buffer_tokens=9000", "sidecar.buffer_tokens moved to sidecar.buffer.tokens"),
        ("sidecar.lora.rank=4", "sidecar.lora.rank moved to sidecar.train.lora.rank"),
        ("sidecar.train_trigger=drift", "sidecar.train_trigger moved to sidecar.trigger.when"),
        ("sidecar.record_wire=true", "sidecar.record_wire moved to sidecar.recording.enabled"),
        ("sidecar.batch_tokens=512", "sidecar.batch_tokens moved to sidecar.train.batch_tokens"),
        ("sidecar.train.lr=1e-3", "sidecar.train.lr moved to sidecar.train.objective.lr"),
        ("sidecar.train.loss=tv", "sidecar.train.loss moved to sidecar.train.objective.loss"),
        ("rl.lr=1e-4", "rl.lr moved to rl.policy.lr"),
        ("rl.lora_r=8", "rl.lora_r moved to rl.policy.lora.rank"),
        ("rl.lora_targets=[q_proj]", "rl.lora_targets moved to rl.policy.lora.target_modules"),
        ("rl.engine=vllm", "rl.engine moved to rl.engine.kind"),
        ("rl.spec_k=2", "rl.spec_k moved to rl.engine.spec_k"),
        ("rl.engine_kv_cache_gb=2", "rl.engine_kv_cache_gb moved to rl.engine.kv_cache_gb"),
        ("rl.draft_guard=none", "rl.draft_guard moved to rl.guard.kind"),
        ("rl.engine_probe_min_ratio=0.3", "rl.engine_probe_min_ratio moved to rl.guard.min_ratio"),
        ("rl.temperature=0.5", "rl.temperature moved to rl.task.temperature"),
    ],
)
def test_a_moved_override_names_its_new_key_in_one_line(override, line):
    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["sidecar.train.objective.lr=1e-3", override], CotrainRecipe)
    assert str(e.value).endswith(f": {line}") and "\n" not in str(e.value)


def test_several_moved_keys_in_yaml_are_one_line_naming_each(tmp_path):
    p = tmp_path / "old.yaml"
    p.write_text(
        "kind: cotrain\nsidecar:\n  ranks: 1\n  lr: 3.0e-4\n  min_buffer_tokens: 2048\n"
        "rl:\n  steps: 3\n  engine: vllm\n  lora_r: 8\n  draft_guard: probe\n  task:\n    group_size: 4\n"
    )
    with pytest.raises(RecipeError) as e:
        load_recipe(p, [], CotrainRecipe)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"recipe {p}: ")
    assert msg.removeprefix(f"recipe {p}: ").split("; ") == [
        "sidecar.lr moved to sidecar.train.objective.lr",
        "sidecar.min_buffer_tokens moved to sidecar.buffer.min_tokens",
        "rl.engine moved to rl.engine.kind",
        "rl.lora_r moved to rl.policy.lora.rank",
        "rl.draft_guard moved to rl.guard.kind",
    ]


def test_a_key_of_the_new_schema_is_never_flagged(tmp_path):
    """``rl.engine`` is a section now: as a section (file or override) it loads; only a plain value is refused."""
    r = load_recipe(
        None, ["rl.engine.kind=reference", "rl.engine.spec_k=2", "rl.guard.kind=none"], CotrainRecipe
    )
    assert (r.rl.engine.kind, r.rl.engine.spec_k, r.rl.guard.kind) == ("reference", 2, "none")
    assert load_recipe(None, ["rl.engine={kind: reference}"], CotrainRecipe).rl.engine.kind == "reference"
    p = tmp_path / "new.yaml"
    p.write_text(
        "kind: cotrain\nrl:\n  engine:\n    kind: vllm\n    spec_k: 4\n  policy:\n    lora:\n      rank: 8\n"
    )
    r = load_recipe(p, [], CotrainRecipe)
    assert (r.rl.engine.kind, r.rl.engine.spec_k, r.rl.policy.lora.rank) == ("vllm", 4, 8)
    from draft_align.config.recipe_files import _moved

    for schema in SCHEMAS.values():
        for key, _, _ in _all_keys(schema):
            assert _moved(schema, key, plain=True) is None, key


def _all_keys(cls, prefix=""):
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _all_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", cls, f.name


def test_every_moved_key_names_a_key_that_exists_and_is_gone_itself():
    from draft_align.config.recipe_files import _schema_key
    from draft_align.config.sections import MOVED_KEYS

    for old, new in MOVED_KEYS.items():
        homes = [s for s in SCHEMAS.values() if _schema_key(s, new)[0]]
        assert homes, f"{old} → {new}: no schema has {new}"
        for schema in homes:
            is_key, is_section = _schema_key(schema, old)
            assert not is_key or is_section, f"{old} is still a key of {schema.__name__}"


def test_wrongly_typed_value_is_an_error():
    with pytest.raises(RecipeError, match="batch_tokens"):
        load_recipe(None, ["train.batch_tokens=lots"])


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("draft.head=medusa", "draft.head"),
        ("draft.adapt=partial", "draft.adapt"),
        ("draft.adapt=lora", "set draft.init_from"),
        ("draft.adapt=lora draft.init_from=x draft.lora.rank=0", "draft.lora"),
        ("draft.head=llama_block_mtp draft.aux_layer_ids=[1,2,3]", "final hidden state only"),
        ("draft.head=native_mtp draft.aux_layer_ids=[1,2,3]", "final hidden state only"),
        ("draft.head=llama_block_mtp draft.mtp_layout=mimo", "mtp_layout"),
        ("draft.mtp_impl=torch", "draft.mtp_impl"),
        ("draft.mtp_impl=megatron", "draft.mtp_impl=megatron builds the target checkpoint's own MTP layers"),
        ("draft.head=native_mtp draft.mtp_impl=megatron draft.init_from=x", "no draft.init_from"),
        ("draft.head=native_mtp draft.mtp_impl=megatron", r"set train\.objective\.autocast_bf16=false"),
        (
            "draft.head=native_mtp draft.mtp_impl=megatron draft.adapt=lora draft.init_from=x",
            "draft.adapt=full",
        ),
        # the old name of the Llama-block head: one line naming the new one
        (
            "draft.head=mtp",
            r"^overrides .*draft\.head: draft head 'mtp' was renamed 'llama_block_mtp' \(it is a Llama",
        ),
        ("train.objective.loss=kl", "train.objective.loss"),
        (
            "train.objective.accept_mode=greedy",
            r"^train\.objective\.accept_mode=greedy is for the acceptance objectives",
        ),
        (
            "train.objective.loss=tv train.objective.accept_mode=greedy_draft",
            r"^train\.objective\.accept_mode=greedy_draft: loss=tv is",
        ),
        (
            "train.objective.loss=greedy_surrogate train.objective.accept_mode=probabilistic",
            r"^train\.objective\.accept_mode=probabilistic",
        ),
        (
            "train.objective.soft_ce_weight=0.5",
            r"^train\.objective\.soft_ce_weight=0\.5 mixes soft CE into an acceptance objective",
        ),
        (
            "train.objective.loss=tv train.objective.soft_ce_weight=-1",
            r"^train\.objective\.soft_ce_weight must be in \[0, 1000000\]",
        ),
        (
            "train.objective.loss=tv train.objective.soft_ce_weight=nan",
            r"^train\.objective\.soft_ce_weight must be in \[0, 1000000\]",
        ),
        (
            "train.objective.loss=greedy_surrogate train.objective.surrogate_tau=0",
            r"^train\.objective\.surrogate_tau must be in \(0, 1000\]",
        ),
        ("eval.modes=[greedy,typical]", "unknown verify mode 'typical'"),
        ("train.objective.ttt_steps=0", "ttt_steps"),
        ("eval.k=0", "eval.k"),
        ("logging.wandb_mode=cloud", "wandb_mode"),
        ("target.dtype=int8", "target.dtype"),
    ],
)
def test_validate_rejects_bad_values(override, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(None, override.split())


def test_mtp_and_lora_keys():
    from draft_align.config import CotrainRecipe, step_decay

    r = load_recipe(
        None,
        [
            "draft.head=llama_block_mtp",
            "draft.mtp_depth=2",
            "draft.mtp_layout=qwen3_next",
            "draft.adapt=lora",
            "draft.lora.rank=4",
            "draft.lora.target_modules=[q_proj,eh_proj]",
        ],
    )
    assert (r.draft.head, r.draft.mtp_depth, r.draft.lora.rank) == ("llama_block_mtp", 2, 4)
    assert r.draft.lora.target_modules == ["q_proj", "eh_proj"]
    assert (
        step_decay(r.train.objective.step_decay, "llama_block_mtp") == 0.6
        and step_decay(None, "eagle3") == 0.8
    )
    assert step_decay(0.9, "llama_block_mtp") == 0.9 and step_decay(None, "native_mtp") == 0.6
    with pytest.raises(RecipeError, match="bogus"):
        load_recipe(None, ["draft.lora.bogus=1"])
    c = load_recipe(None, ["sidecar.train.adapt=lora", "sidecar.train.lora.lr=1e-3"], schema=CotrainRecipe)
    assert c.sidecar.train.adapt == "lora" and c.sidecar.train.lora.lr == 1e-3
    with pytest.raises(RecipeError, match="sidecar.train.adapt"):
        load_recipe(None, ["sidecar.train.adapt=half"], schema=CotrainRecipe)


def test_kind_selects_the_schema_and_a_mismatch_fails(tmp_path):
    from draft_align.config import CotrainRecipe

    cot = RECIPES[0].parent / "smollm2_cotrain.yaml"
    assert recipe_kind(cot) == "cotrain"
    r = load_recipe(cot, schema=CotrainRecipe)
    assert r.rl.steps >= 1 and r.sidecar.train.batch_tokens <= r.sidecar.buffer.tokens
    with pytest.raises(RecipeError, match="warm-start recipe.*needs a co-training recipe"):
        load_recipe(RECIPES[0].parent / "smollm2_demo.yaml", schema=CotrainRecipe)
    with pytest.raises(RecipeError, match="co-training recipe.*needs a warm-start recipe"):
        load_recipe(cot)
    with pytest.raises(RecipeError, match="not a co-training one"):
        load_recipe(None, ["kind=warmstart"], schema=CotrainRecipe)
    p = tmp_path / "odd.yaml"
    p.write_text("kind: evaluation\n")
    with pytest.raises(RecipeError, match="unknown kind"):
        recipe_kind(p)


# -- choice fields: typed in the schema, one-line errors naming the key and the allowed values -------------
def _choice_fields():
    """(schema, dotted key, choice enum) for every choice field of both schemas."""
    import dataclasses
    import typing

    from draft_align.config import CotrainRecipe
    from draft_align.config.choices import choice_type

    out = []

    def walk(schema, cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(schema, hints[f.name], f"{prefix}{f.name}.")
            elif (choice := choice_type(hints[f.name])) is not None:
                out.append((schema, f"{prefix}{f.name}", choice, typing.get_origin(hints[f.name]) is list))

    walk(WarmstartRecipe, WarmstartRecipe, "")
    walk(CotrainRecipe, CotrainRecipe, "")
    return out


CHOICE_FIELDS = _choice_fields()


def test_every_enum_like_field_is_a_choice():
    keys = {(s.__name__, k) for s, k, _, _ in CHOICE_FIELDS}
    assert keys == {
        ("WarmstartRecipe", k)
        for k in (
            "target.dtype",
            "data.gen_engine",
            "draft.head",
            "draft.mtp_layout",
            "draft.mtp_init",
            "draft.mtp_impl",
            "draft.adapt",
            "train.objective.loss",
            "train.objective.accept_mode",
            "eval.modes",
            "logging.wandb_mode",
        )
    } | {
        ("CotrainRecipe", k)
        for k in (
            "target.dtype",
            "data.gen_engine",
            "sidecar.train.objective.loss",
            "sidecar.train.objective.accept_mode",
            "sidecar.gate.mode",
            "sidecar.train.adapt",
            "sidecar.parallel",
            "sidecar.trigger.when",
            "sidecar.host",
            "ray.lifetime",
            "rl.engine.verify_mode",
            "rl.engine.kind",
            "rl.guard.kind",
            "push.pause",
            "logging.wandb_mode",
            "logging.trl_metrics",
        )
    }


@pytest.mark.parametrize(
    ("schema", "key", "choice", "is_list"),
    CHOICE_FIELDS,
    ids=[f"{s.__name__}:{k}" for s, k, _, _ in CHOICE_FIELDS],
)
def test_bad_choice_names_the_key_and_the_allowed_values(tmp_path, schema, key, choice, is_list):
    allowed = [m.value for m in choice]
    value = "[bogus]" if is_list else "bogus"
    shown = f"{key}[0]" if is_list else key
    with pytest.raises(RecipeError) as e:
        load_recipe(None, [f"{key}={value}"], schema)
    msg = str(e.value)
    assert "\n" not in msg and f"{shown}: unknown" in msg and "'bogus'" in msg
    assert msg.endswith("expected one of " + " | ".join(allowed))
    # the same from a YAML file: the error names the file
    *sections, leaf = key.split(".")
    nested = "".join(f"{'  ' * i}{name}:\n" for i, name in enumerate(sections))
    p = tmp_path / "bad.yaml"
    p.write_text(f"kind: {schema.kind}\n{nested}{'  ' * len(sections)}{leaf}: {value}\n")
    with pytest.raises(
        RecipeError, match=rf"^recipe .*bad\.yaml: {re.escape(shown)}: unknown .*'bogus'; expected"
    ):
        load_recipe(p, None, schema)
    # every allowed value loads, as a string (with what the cross-field rules ask for besides)
    extra = {
        "draft.adapt": ["draft.init_from=x"],
        "draft.mtp_impl": ["draft.head=native_mtp", "train.objective.autocast_bf16=false"],
        "train.objective.accept_mode": ["train.objective.loss=expected_length"],
        "sidecar.train.objective.accept_mode": ["sidecar.train.objective.loss=expected_length"],
    }.get(key, [])
    for v in allowed:
        needs = ["rl.engine.kind=vllm"] if (key, v) == ("rl.engine.verify_mode", "auto") else []  # on vLLM
        if (key, v) == ("rl.engine.kind", "server"):
            needs = ["rl.engine.frozen_fraction=0"]  # one server serves one draft
        r = load_recipe(None, [f"{key}=[{v}]" if is_list else f"{key}={v}", *extra, *needs], schema)
        got = r
        for name in key.split("."):
            got = getattr(got, name)
        assert (got[0] if is_list else got) == v and isinstance(got[0] if is_list else got, str)


def test_a_recipe_built_in_code_is_checked_too():
    from draft_align.config import CotrainRecipe, RLConfig, RLEngineConfig
    from draft_align.config.sections import EvalConfig

    with pytest.raises(
        RecipeError,
        match=r"^rl\.engine\.kind: unknown rollout engine 'sglang'; expected one of "
        r"auto \| vllm \| reference \| server$",
    ):
        CotrainRecipe(rl=RLConfig(engine=RLEngineConfig(kind="sglang"))).validate()
    with pytest.raises(RecipeError, match=r"^eval\.modes\[1\]: unknown verify mode 'typical'"):
        WarmstartRecipe(eval=EvalConfig(modes=["greedy", "typical"])).validate()
    CotrainRecipe(
        rl=RLConfig(engine=RLEngineConfig(kind="reference", verify_mode="probabilistic"))
    ).validate()  # plain strings are fine


def test_choices_come_from_their_one_source():
    import typing

    from draft_align.cli import build_parser
    from draft_align.config.choices import DtypeChoice, HeadChoice, MTPLayoutChoice, VerifyModeChoice
    from draft_align.conventions import FLOAT_DTYPE_NAMES, RECIPE_HEAD_KINDS, VERIFY_MODES
    from draft_align.heads.draft_head import HeadKind
    from draft_align.heads.mtp import Layout

    assert tuple(VerifyModeChoice) == VERIFY_MODES and tuple(DtypeChoice) == FLOAT_DTYPE_NAMES
    # a recipe names every head the warm-start and sidecar build, native_mtp included
    assert tuple(HeadChoice) == RECIPE_HEAD_KINDS == typing.get_args(HeadKind)
    assert tuple(MTPLayoutChoice) == typing.get_args(Layout)
    ev = next(
        a
        for a in build_parser()._subparsers._group_actions[0].choices["eval"]._actions
        if a.dest == "verify_mode"
    )
    assert tuple(ev.choices) == VERIFY_MODES


def test_choice_values_behave_as_strings():
    import json

    r = load_recipe(RECIPES[0].parent / "smollm2_mtp_demo.yaml")
    h = "llama_block_mtp"
    assert r.draft.head == h and f"{r.draft.head}" == h and {h: 1}[r.draft.head] == 1
    assert json.dumps([r.draft.head, r.eval.modes[0]]) == json.dumps([h, r.eval.modes[0].value])
    d = recipe_to_dict(r)
    assert type(d["draft"]["head"]) is str and all(type(m) is str for m in d["eval"]["modes"])


# -- the tap budgets: one rule, the Tap's -----------------------------------------------------------------
@pytest.mark.parametrize("key", ["tap.tokens_per_step", "tap.max_tokens_per_message"])
def test_tap_budgets_follow_the_taps_rule(key):
    from draft_align.config import CotrainRecipe
    from draft_align.tap.budget import MIN_SEQUENCE_TOKENS, check_budgets
    from draft_align.tap.protocol import PolicyTapError

    low = MIN_SEQUENCE_TOKENS - 1
    with pytest.raises(RecipeError, match=rf"^{re.escape(key)} must be ≥ {MIN_SEQUENCE_TOKENS}, got {low}$"):
        load_recipe(None, [f"{key}={low}"], CotrainRecipe)
    kw = {"tokens_per_step": 8192, "max_tokens_per_message": 16384, key.split(".")[1]: low}
    with pytest.raises(PolicyTapError):  # what the Tap itself would refuse at construction
        check_budgets(**kw)
    r = load_recipe(None, [f"{key}={MIN_SEQUENCE_TOKENS}"], CotrainRecipe)
    check_budgets(r.tap.tokens_per_step, r.tap.max_tokens_per_message)


# -- save_recipe ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_save_recipe_round_trips(tmp_path, path):
    from omegaconf import OmegaConf

    from draft_align.config import save_recipe

    schema = SCHEMAS[recipe_kind(path)]
    r = load_recipe(path, schema=schema)
    out = save_recipe(r, tmp_path / "run" / "resolved.yaml")
    assert out == tmp_path / "run" / "resolved.yaml" and [p.name for p in out.parent.iterdir()] == [out.name]
    assert out.read_text() == OmegaConf.to_yaml(
        OmegaConf.create(recipe_to_dict(r))
    )  # what cotrain wrote itself
    assert recipe_kind(out) == schema.kind and load_recipe(out, schema=schema) == r


def test_load_recipe_returns_the_schemas_type():
    from draft_align.config import CotrainRecipe

    assert type(load_recipe(None)) is WarmstartRecipe
    assert type(load_recipe(None, None, CotrainRecipe)) is CotrainRecipe
    assert type(load_recipe(None, schema=CotrainRecipe)) is CotrainRecipe


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("sidecar.train.batch_tokens=0", "sidecar.train.batch_tokens must be ≥ 1, got 0"),
        ("sidecar.train.batch_tokens=-5", "sidecar.train.batch_tokens must be ≥ 1"),
        ("sidecar.train.objective.ttt_steps=0", "sidecar.train.objective.ttt_steps must be in \\[1, 64\\]"),
        ("sidecar.gate.k=0", "sidecar.gate.k must be in \\[1, 64\\]"),
        (
            "sidecar.train.objective.grad_clip=-1",
            r"sidecar.train.objective.grad_clip must be in \(0, 1000000\], got -1",
        ),
        (
            "sidecar.train.objective.grad_clip=0",
            r"sidecar.train.objective.grad_clip must be in \(0, 1000000\]",
        ),
        ("sidecar.train.checkpoint_every_s=0", "sidecar.train.checkpoint_every_s must be in \\(0, 604800\\]"),
        ("sidecar.publish.keep_versions=1", "sidecar.publish.keep_versions must be in \\[2, 10000\\]"),
        ("sidecar.train.max_seq_tokens=2", "sidecar.train.max_seq_tokens must be in \\[3, 1048576\\]"),
        (
            "sidecar.train.max_seq_tokens=1000000000",
            "sidecar.train.max_seq_tokens must be in \\[3, 1048576\\]",
        ),
        ("sidecar.train.max_consecutive_nonfinite=0", "max_consecutive_nonfinite must be ≥ 1"),
        ("sidecar.recording.max_mb=0", "sidecar.recording.max_mb must be ≥ 1, got 0"),
        ("sidecar.recording.reserve_mb=-1", "sidecar.recording.reserve_mb must be ≥ 0, got -1"),
        (
            "sidecar.train.anchor_decay=-1",
            r"sidecar.train.anchor_decay must be in \[0, 1000000\] \(0: off\), got -1",
        ),
        ("sidecar.monitor.prometheus_port=70000", "prometheus_port must be in \\[0, 65535\\]"),
        ("sidecar.monitor.prometheus_port=-1", "prometheus_port"),
        ("wire.max_message_mb=0", "wire.max_message_mb must be in \\[1, 65536\\]"),
        ("wire.max_message_mb=-3", "wire.max_message_mb"),
        ("wire.max_tokens=0", "wire.max_tokens must be ≥ 1"),
        ("rl.policy.grad_clip=-1", r"rl.policy.grad_clip must be in \(0, 1000000\]"),
        ("rl.policy.lr=nan", r"rl.policy.lr must be in \(0, 10\]"),
        (
            "rl.guard.min_ratio=0",
            r"rl.guard.min_ratio must be in \(0, 1\] \(to turn the guard off: rl.guard.kind=none",
        ),
        ("rl.guard.min_ratio=1.5", "rl.guard.min_ratio must be in"),
        ("rl.guard.probe_prompts=-1", "rl.guard.probe_prompts must be ≥ 0"),
        ("rl.guard.probe_tokens=1", "rl.guard.probe_tokens must be ≥ 2"),
        ("ray.max_restarts=-2", "ray.max_restarts must be"),
        ("ray.call_timeout_s=0", "ray.call_timeout_s must be"),
        ("ray.num_gpus=-1", "ray.num_gpus must be"),
        ("ray.resources.x=-1", "ray.resources must be ≥ 0 each"),
        ("ray.namespace=''", "ray.namespace must not be empty"),
        ("rl.guard.kind=probe rl.guard.probe_prompts=0", "rl.guard.kind=probe decodes"),
    ],
)
def test_cotrain_operator_mistakes_fail_at_load(override, match):
    from draft_align.config import CotrainRecipe

    with pytest.raises(RecipeError, match=match):
        load_recipe(None, override.split(), CotrainRecipe)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("train.objective.grad_clip=-1", r"train.objective.grad_clip must be in \(0, 1000000\]"),
        ("train.batch_tokens=0", "train.batch_tokens must be ≥ 1"),
    ],
)
def test_warmstart_operator_mistakes_fail_at_load(override, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(None, override.split())


def test_yaml_syntax_errors_and_directories_are_one_line_recipe_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sidecar:\n  batch_tokens: [1, 2\n  lr: 3\n")
    with pytest.raises(RecipeError, match="is not valid YAML") as e:
        load_recipe(bad)
    assert "\n" not in str(e.value)
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(tmp_path / "binary.yaml")
    with pytest.raises(RecipeError, match="is a directory"):
        load_recipe(tmp_path)


# -- the training objective: one section under train and sidecar.train, one rule, checked at load ------------
def test_objective_fields_load_in_both_schemas_and_reach_the_same_loss_settings():
    from draft_align.config import CotrainRecipe, ObjectiveConfig
    from draft_align.train.objective import LossSettings

    keys = {
        "loss": "expected_length",
        "accept_mode": "greedy_draft",
        "soft_ce_weight": "0.25",
        "surrogate_tau": "0.3",
        "fused_soft_ce": "false",
    }
    w = load_recipe(None, [f"train.objective.{k}={v}" for k, v in keys.items()])
    c = load_recipe(None, [f"sidecar.train.objective.{k}={v}" for k, v in keys.items()], CotrainRecipe)
    a = LossSettings.from_section(w.train.objective, 0.8, True)
    b = LossSettings.from_section(c.sidecar.train.objective, 0.8, True)
    assert (a.kind, a.accept_mode, a.soft_ce_weight, a.surrogate_tau, a.fused_soft_ce) == (
        "expected_length",
        "greedy_draft",
        0.25,
        0.3,
        False,
    )
    assert LossSettings.from_section(ObjectiveConfig(), 0.8, True).fused_soft_ce is True  # the default
    assert dataclasses.replace(a, ttt_steps=b.ttt_steps, autocast_bf16=b.autocast_bf16) == b
    assert a.verify_mode == "greedy_draft" and type(a.kind) is str and type(a.accept_mode) is str
    assert (
        LossSettings.from_section(
            load_recipe(None, ["train.objective.loss=tv"]).train.objective, 0.8, True
        ).verify_mode
        == "probabilistic"
    )
    assert LossSettings.from_section(ObjectiveConfig(), 0.8, True).verify_mode is None  # soft CE
    with pytest.raises(RecipeError, match=r"^sidecar\.train\.objective\.soft_ce_weight=1\.0 mixes soft CE"):
        load_recipe(None, ["sidecar.train.objective.soft_ce_weight=1"], CotrainRecipe)
    with pytest.raises(ValueError, match="loss 'kl' unknown"):
        LossSettings(kind="kl")  # type: ignore[arg-type]


def test_each_place_keeps_its_own_objective_defaults_and_builds_its_optimizer_one_way():
    """train.objective and sidecar.train.objective are one class with two sets of defaults (the sidecar's: a
    smaller lr, constant after 10 warm-up steps); the trainer's optimizer is built from either by one function."""
    from draft_align.config import CotrainRecipe
    from draft_align.config.sections import LoraAdaptConfig
    from draft_align.train.trainer import OptimSettings

    w, c = load_recipe(None).train.objective, load_recipe(None, None, CotrainRecipe).sidecar.train.objective
    assert (w.lr, w.min_lr_ratio, w.warmup_steps) == (1e-3, 0.1, 20)
    assert (c.lr, c.min_lr_ratio, c.warmup_steps) == (5e-4, 1.0, 10)
    assert dataclasses.replace(c, lr=w.lr, min_lr_ratio=w.min_lr_ratio, warmup_steps=w.warmup_steps) == w
    assert OptimSettings.from_section(c, total_steps=10**9, anchor_decay=0.1) == OptimSettings(
        lr=5e-4,
        min_lr_ratio=1.0,
        weight_decay=0.0,
        warmup_steps=10,
        total_steps=10**9,
        grad_clip=0.5,
        anchor_decay=0.1,
    )
    lora = LoraAdaptConfig()
    assert OptimSettings.from_section(w, total_steps=7, adapters=lora) == OptimSettings(
        lr=lora.lr,
        min_lr_ratio=0.1,
        weight_decay=lora.weight_decay,
        warmup_steps=lora.warmup_steps,
        total_steps=7,
    )


def test_an_old_objective_key_in_a_warmstart_file_names_its_new_key(tmp_path):
    p = tmp_path / "old.yaml"
    p.write_text("kind: warmstart\ntrain:\n  lr: 1.0e-3\n  epochs: 2\n  loss: tv\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert str(e.value) == (
        f"recipe {p}: train.lr moved to train.objective.lr; train.loss moved to train.objective.loss"
    )
    with pytest.raises(RecipeError, match=r": train\.ttt_steps moved to train\.objective\.ttt_steps$"):
        load_recipe(None, ["train.ttt_steps=3"])


@pytest.mark.parametrize("loss", ["soft", "tv", "greedy_surrogate", "expected_length"])
def test_a_distribution_loss_on_hard_tokens_only_fails_at_load(loss):
    from draft_align.config import CotrainRecipe

    with pytest.raises(RecipeError) as e:
        load_recipe(None, [f"sidecar.train.objective.loss={loss}", "tap.send_final=false"], CotrainRecipe)
    assert str(e.value) == (
        f"sidecar.train.objective.loss={loss} needs the target's distribution, but tap.send_final=false ships "
        f"hard tokens only (no final hidden state): set tap.send_final=true"
    )
    load_recipe(None, [f"sidecar.train.objective.loss={loss}", "tap.send_final=true"], CotrainRecipe)


def test_hard_tokens_only_fail_at_load_for_the_hard_loss_too():
    """The sidecar's ingest drops batches without a final hidden state whatever the loss."""
    from draft_align.config import CotrainRecipe

    with pytest.raises(RecipeError, match=r"^tap\.send_final=false: the sidecar drops tapped batches"):
        load_recipe(None, ["sidecar.train.objective.loss=hard", "tap.send_final=false"], CotrainRecipe)


# ----------------------------------------------------------------------------- numeric ranges (config/rules.py)
def _numeric_keys():
    from draft_align.config.rules import numeric_fields

    return [
        (kind, key, owner, name)
        for kind, schema in SCHEMAS.items()
        for key, owner, name in numeric_fields(schema)
    ]


def test_every_numeric_field_has_a_declared_range_that_its_default_keeps():
    """A numeric field added to a schema without an entry in rules.RANGES fails here."""
    from draft_align.config.rules import RANGES

    keys = _numeric_keys()
    assert len(keys) > 100  # both schemas, every section
    missing = [f"{owner.__name__}.{name}" for _, _, owner, name in keys if name not in RANGES.get(owner, {})]
    assert not missing, f"numeric fields without a declared range in config/rules.py RANGES: {missing}"
    declared = {(owner, name) for _, _, owner, name in keys}
    stale = [f"{o.__name__}.{n}" for o, fields in RANGES.items() for n in fields if (o, n) not in declared]
    assert not stale, f"RANGES entries for fields no schema has: {stale}"
    for schema in SCHEMAS.values():
        schema().validate()  # every default inside its range


def _bad_values(rng, is_int):
    """Values just outside ``rng`` (and NaN/±inf for a float field, 2^70 for an int one)."""
    bad = []
    if rng.low is not None:
        bad.append(rng.low if rng.open_low else rng.low - (1 if is_int else 1e-3 * max(1.0, abs(rng.low))))
    if rng.high is not None:
        bad.append(
            rng.high if rng.open_high else rng.high + (1 if is_int else 1e-3 * max(1.0, abs(rng.high)))
        )
    if is_int:
        bad.append(2**70)
    else:
        bad += ["nan", "-inf"] + ([] if rng.inf_ok else ["inf"])
    return [v for v in bad if v not in rng.also]


@pytest.mark.parametrize(
    ("kind", "key", "owner", "name"), _numeric_keys(), ids=lambda x: getattr(x, "__name__", x)
)
def test_every_numeric_field_refuses_values_outside_its_range_in_one_line(kind, key, owner, name):
    """Each numeric field of each schema: the values just outside its declared range, NaN and ±inf (floats) and
    2^70 (ints) fail at load with one line naming the key and the allowed range; the range's own ends load."""
    import typing

    from draft_align.config.rules import range_of

    rng = range_of(owner, name)
    from draft_align.config.rules import _item_type

    hint = typing.get_type_hints(owner)[name]
    is_list = "list[" in str(hint)
    is_int = _item_type(hint) is int
    schema = SCHEMAS[kind]
    for v in _bad_values(rng, is_int):
        over = f"{key}=[{v}]" if is_list else f"{key}={v}"
        with pytest.raises(RecipeError) as e:
            load_recipe(None, [over], schema)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(
            f"{key}{'[0]' if is_list else ''} must be {rng.text()}, got"
        ), msg
    for v in (rng.low, rng.high):
        if v is not None and not (v == rng.low and rng.open_low) and not (v == rng.high and rng.open_high):
            v = int(v) if is_int else float(v)
            try:
                load_recipe(None, [f"{key}=[{v}]" if is_list else f"{key}={v}"], schema)
            except RecipeError as e:  # an end of the range may break a cross-field rule, never its own range
                assert not str(e).startswith(f"{key} must be {rng.text()}"), str(e)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (
            "rl.task.temperature=nan",
            r"^rl\.task\.temperature must be 0 or in \[0\.001, 100\] \(0: greedy\), got nan$",
        ),
        ("rl.task.temperature=1e308", r"^rl\.task\.temperature must be 0 or in"),
        ("rl.task.temperature=5e-324", r"^rl\.task\.temperature must be 0 or in"),
        ("sidecar.gate.temperature=inf", r"^sidecar\.gate\.temperature must be 0 or in"),
        ("sidecar.gate.tolerance=-1", r"^sidecar\.gate\.tolerance must be in \[0, 64\] \(.*\), got -1"),
        ("sidecar.gate.tolerance=nan", r"^sidecar\.gate\.tolerance must be in \[0, 64\] \(.*\), got nan"),
        ("sidecar.gate.tolerance=inf", r"^sidecar\.gate\.tolerance must be in \[0, 64\] \(.*\), got inf"),
        ("sidecar.train.objective.lr=inf", r"^sidecar\.train\.objective\.lr must be in \(0, 10\], got inf"),
        ("sidecar.collective_timeout_s=1e300", r"^sidecar\.collective_timeout_s must be in \(0, 604800\]"),
        ("seed=-1", r"^seed must be in \[0, 4294967295\], got -1"),
        (
            "wire.max_message_mb=100000000000000000000000000000",
            r"^wire\.max_message_mb must be in \[1, 65536\]",
        ),
        (
            "sidecar.publish.keep_versions=100000000000000000000000000000",
            r"^sidecar\.publish\.keep_versions must be in",
        ),
        (
            "sidecar.buffer.recency_half_life=nan",
            r"^sidecar\.buffer\.recency_half_life must be > 0 \(inf: uniform sampling\)",
        ),
    ],
)
def test_hostile_numeric_overrides_found_by_the_attacker_fail_at_load(override, match):
    from draft_align.config import CotrainRecipe

    with pytest.raises(RecipeError, match=match):
        load_recipe(None, [override], CotrainRecipe)
    assert load_recipe(
        None, ["sidecar.buffer.recency_half_life=inf"], CotrainRecipe
    ).sidecar.buffer.recency_half_life == float("inf")  # inf means uniform sampling (train/replay.py)


@pytest.mark.parametrize("run", ["../../x", "/tmp/abs", "a/b", "..", ".", "", " x", "a\\b"])
@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_a_run_name_that_leaves_the_output_folder_fails_at_load(run, kind):
    with pytest.raises(RecipeError, match=r"^run .* must be one plain folder name .*set output_dir$"):
        load_recipe(None, [f"run='{run}'"], SCHEMAS[kind])
    recipe = load_recipe(None, ["run=my-run_2.b", "output_dir=/tmp/elsewhere"], SCHEMAS[kind])
    assert recipe.run_dir.parent == Path("/tmp/elsewhere")


def test_the_sidecars_default_sequence_cap_keeps_one_step_in_its_documented_budget():
    """docs/sizing.md §6: one train step ≤ (a·M/T + c)·cap + b; for the SmolLM2-sized draft (H 576, I 1536,
    K 7, three aux layers of a 576-wide target, P 14.6 M) the default cap must keep it near 2 GiB, the step's
    share of a 24 GiB machine beside vLLM (8,192 gave ≈ 3.1 GB).  The docs state the default the schema has."""
    from draft_align.config.sections import SidecarTrainConfig

    cap = SidecarTrainConfig().max_seq_tokens
    h, i, k, h_t, p = 576, 1536, 7, 576, 14.6e6
    a = 4 * k * (14 * h + 4 * i)  # per chain start
    c = 4 * (3 * h_t + 8 * h)  # per position
    b = 16 * p + 4 * (16 + 32) * 2**20
    step = (a * 0.75 + c) * cap + b
    assert step <= 2 * 2**30, f"default max_seq_tokens={cap}: one step ≈ {step / 2**30:.2f} GiB"
    sizing = (Path(__file__).resolve().parents[1] / "docs" / "sizing.md").read_text()
    assert f"**The default, {cap:,}**" in sizing


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rl.policy.lr=1e300", "rl.policy.lr must be in (0, 10]"),
        ("sidecar.train.objective.lr=18446744073709551616", "sidecar.train.objective.lr must be in (0, 10]"),
        (
            "sidecar.train.objective.grad_clip=1e300",
            "sidecar.train.objective.grad_clip must be in (0, 1000000]",
        ),
        ("sidecar.gate.tolerance=1e300", "sidecar.gate.tolerance must be in [0, 64]"),
        ("ray.num_gpus=1e300", "ray.num_gpus must be in [0, 1000000]"),
        ("rl.policy.kl_coef=1e300", "rl.policy.kl_coef must be in [0, 1000000]"),
        ("output_dir=" + "x" * 5000, "output_dir is 5000 characters long"),
        ("run=" + "r" * 300, "run is 300 bytes long"),
        ('ray.namespace="a\\tb"', "holds the control character"),
        ("rl.policy.save_merged_at=[" + ",".join(["1"] * 20000) + "]", "not valid YAML values"),
    ],
)
def test_hostile_overrides_are_refused_in_one_line(override, message):
    """Issue 38 row 12: values that load as their type but no run can use (a learning rate of 1e300, a
    5,000-character path, a control character in a name, a list past the YAML node limit) are refused with one
    line naming the key."""
    with pytest.raises(RecipeError) as e:
        load_recipe(RECIPES[0].parent / "smollm2_task_cotrain.yaml", [override], CotrainRecipe)
    assert message in str(e.value) and "\n" not in str(e.value)
