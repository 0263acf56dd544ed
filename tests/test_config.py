"""draft_align.config: every recipe loads; unknown keys and bad values fail loudly; overrides apply."""

from pathlib import Path

import pytest

from draft_align.config import SCHEMAS, RecipeError, WarmstartRecipe, load_recipe, recipe_kind, recipe_to_dict

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
    for section, values in raw.items():
        if isinstance(values, dict):
            for k, v in values.items():
                assert as_dict[section][k] == v, f"{section}.{k}"
        else:
            assert as_dict[section] == values, section
    assert r.run_dir == Path(r.output_dir) / r.run


def test_defaults_without_a_file():
    r = load_recipe(None)
    assert r == WarmstartRecipe()
    assert r.draft.aux_layer_ids is None and r.train.loss == "soft"


def test_overrides_apply_with_types():
    r = load_recipe(
        RECIPES[0].parent / "smollm2_demo.yaml",
        ["train.lr=3e-4", "draft.aux_layer_ids=[1,3,4]", "data.max_conversations=null", "eval.temperatures=[0.0]",
         "train.max_steps=7", "run=custom", "logging.wandb=false"],
    )
    assert r.train.lr == pytest.approx(3e-4) and isinstance(r.train.lr, float)
    assert r.draft.aux_layer_ids == [1, 3, 4]
    assert r.data.max_conversations is None
    assert r.eval.temperatures == [0.0]
    assert r.train.max_steps == 7
    assert r.run == "custom" and r.logging.wandb is False


def test_unknown_key_in_yaml_names_the_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("run: x\ntrain:\n  learning_rate: 0.1\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml.*learning_rate"):
        load_recipe(p, ["train.lr=1e-3"])
    p.write_text("run: x\ntrainer:\n  lr: 0.1\n")
    with pytest.raises(RecipeError, match="trainer"):
        load_recipe(p)


@pytest.mark.parametrize(
    ("override", "key"), [("train.lrr=1", "lrr"), ("nosuchsection.x=1", "nosuchsection"), ("data.sourcee=x", "sourcee")]
)
def test_unknown_override_names_the_key(override, key):
    with pytest.raises(RecipeError, match=rf"overrides .*{key}"):
        load_recipe(RECIPES[0], ["train.lr=1e-3", override])


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
        ("draft.head=mtp draft.aux_layer_ids=[1,2,3]", "final hidden state only"),
        ("draft.head=mtp draft.mtp_layout=mimo", "mtp_layout"),
        ("train.loss=kl", "train.loss"),
        ("eval.modes=[greedy,typical]", "unknown verify mode 'typical'"),
        ("train.ttt_steps=0", "ttt_steps"),
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

    r = load_recipe(None, ["draft.head=mtp", "draft.mtp_depth=2", "draft.mtp_layout=qwen3_next", "draft.adapt=lora",
                           "draft.lora.rank=4", "draft.lora.target_modules=[q_proj,eh_proj]"])
    assert (r.draft.head, r.draft.mtp_depth, r.draft.lora.rank) == ("mtp", 2, 4)
    assert r.draft.lora.target_modules == ["q_proj", "eh_proj"]
    assert step_decay(r.train.step_decay, "mtp") == 0.6 and step_decay(None, "eagle3") == 0.8
    assert step_decay(0.9, "mtp") == 0.9
    with pytest.raises(RecipeError, match="bogus"):
        load_recipe(None, ["draft.lora.bogus=1"])
    c = load_recipe(None, ["sidecar.adapt=lora", "sidecar.lora.lr=1e-3"], schema=CotrainRecipe)
    assert c.sidecar.adapt == "lora" and c.sidecar.lora.lr == 1e-3
    with pytest.raises(RecipeError, match="sidecar.adapt"):
        load_recipe(None, ["sidecar.adapt=half"], schema=CotrainRecipe)


def test_kind_selects_the_schema_and_a_mismatch_fails(tmp_path):
    from draft_align.config import CotrainRecipe

    cot = RECIPES[0].parent / "smollm2_cotrain.yaml"
    assert recipe_kind(cot) == "cotrain"
    r = load_recipe(cot, schema=CotrainRecipe)
    assert r.rl.steps >= 1 and r.sidecar.batch_tokens <= r.sidecar.buffer_tokens
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
