"""draft_align.sidecar.launch: the starting draft, the world every rank must agree on, and the CLI entry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from draft_align.config import CotrainRecipe, load_recipe
from draft_align.sidecar.launch import SidecarError, starting_draft, world_config

REPO = Path(__file__).resolve().parents[2]


def test_starting_draft_from_the_warmstart_a_folder_or_an_error(tiny_run, tiny_env, tmp_path):
    recipe = load_recipe(None, tiny_run.cotrain_overrides(tmp_path), CotrainRecipe)
    start = starting_draft(recipe)
    assert (start / "manifest.json").is_file()
    assert starting_draft(recipe, str(start)) == start  # a draft folder as given
    with pytest.raises(SidecarError, match="no starting draft"):
        starting_draft(recipe, str(tmp_path / "nowhere"))

    def never(ws):
        raise AssertionError("a named draft is never warm-started")

    # a launcher's warm_start runs only for the warm-start recipe's own draft: not for a named one, not when published
    with pytest.raises(SidecarError, match="no starting draft"):
        starting_draft(recipe, str(tmp_path / "nowhere"), warm_start=never)
    assert starting_draft(recipe, warm_start=never) == starting_draft(recipe)


def test_world_config_flattens_the_recipe_and_the_start(tiny_run, tmp_path):
    recipe = load_recipe(None, tiny_run.cotrain_overrides(tmp_path), CotrainRecipe)
    flat = world_config(recipe, tmp_path / "d")
    assert flat["start_draft"] == str((tmp_path / "d").resolve())
    assert (
        flat["sidecar.train.objective.lr"] == recipe.sidecar.train.objective.lr and flat["run"] == recipe.run
    )
    assert not any(isinstance(v, dict) for v in flat.values())
    # keys each rank sets for itself (a Ray rank's endpoint on its own node) are not compared
    local = world_config(recipe, tmp_path / "d", ("wire.endpoint", "wire.notify_endpoint"))
    assert "wire.endpoint" in flat and "wire.endpoint" not in local and "wire.notify_endpoint" not in local
    assert {k: v for k, v in flat.items() if not k.startswith("wire.") or "endpoint" not in k} == local


def test_cli_sidecar_refuses_a_missing_starting_draft(tiny_run, tiny_env, tmp_path):
    ov = tiny_run.cotrain_overrides(tmp_path, draft=str(tmp_path / "nowhere"))
    r = subprocess.run(
        [sys.executable, "-m", "draft_align", "sidecar", str(REPO / "recipes" / "smollm2_cotrain.yaml"), *ov],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "no starting draft" in r.stderr or "does not exist" in r.stderr
