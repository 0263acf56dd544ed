"""End-to-end warm-start on a tiny random target, offline: publish, reload, caches, resume, failures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draft_align import data, warmstart
from draft_align.config import load_recipe
from draft_align.monitor.evaluate import REQUIRED_KEYS
from draft_align.publish import load_draft
from draft_align.publish.versions import read_latest
from draft_align.train.store import HiddenStore, ResponseCache
from draft_align.train.trainer import DraftTrainer, OptimSettings, lr_factor
from draft_align.warmstart import preparation as warmstart_prepare

EVAL_KEYS = REQUIRED_KEYS
pytestmark = pytest.mark.usefixtures("tiny_env")


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_rows(run_dir: Path) -> list[dict]:
    """The per-step training rows (the final summary row has no 'lr')."""
    return [r for r in metric_rows(run_dir) if "lr" in r]


def trainer_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    t = load_file(str(run_dir / "trainer" / "state.safetensors"))
    return {k[len("draft.") :]: v for k, v in t.items() if k.startswith("draft.")}


def progress(run_dir: Path) -> dict:
    return json.loads((run_dir / "trainer" / "progress.json").read_text())["progress"]


def versions(run_dir: Path) -> list[str]:
    d = run_dir / "drafts"
    return sorted(p.name for p in d.iterdir() if p.name.startswith("v")) if d.is_dir() else []


# --------------------------------------------------------------------------------- the tiny run
def test_publishes_a_draft_that_reloads_with_the_trained_weights(tiny_run):
    run_dir, summary = tiny_run.run_dir, tiny_run.summary
    out = Path(summary["draft"])
    assert out == run_dir / "drafts" / "v0001"
    assert {p.name for p in out.iterdir()} == {"manifest.json", "config.json", "model.safetensors"}
    assert read_latest(run_dir) == out
    assert (run_dir / "latest").read_text().strip() == "drafts/v0001"

    draft, manifest = load_draft(out)
    trained = trainer_weights(run_dir)
    loaded = draft.engine_state_dict()
    assert set(loaded) == {k for k in trained if not k.startswith("rotary.")}
    for k, v in loaded.items():
        want = trained[k].to(torch.bfloat16).float() if trained[k].is_floating_point() else trained[k]
        assert torch.equal(v, want), k  # exported in bf16: exactly the trainer's weights, rounded
    assert manifest["aux_layer_ids"]["hf"] == [1, 3, 4]
    assert manifest["draft_vocab_size"] == 48 == draft.cfg.draft_vocab_size
    assert manifest["target"]["num_hidden_layers"] == 6 and manifest["target"]["hidden_size"] == 64
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 48 and cfg["vocab_size"] == 103
    assert manifest["metrics"]["steps"] == 6


def test_training_metrics_and_summary(tiny_run):
    run_dir = tiny_run.run_dir
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # log_every=1
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    assert rows[0]["lr"] == pytest.approx(3e-3 * 0.5)  # warmup step 1 of 2
    assert progress(run_dir)["step"] == 6
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["draft"] == tiny_run.summary["draft"]
    m = on_disk["metrics"]
    assert m["steps"] == 6 and m["skipped_nonfinite"] == 0
    assert m["train_sequences"] == 24 and m["aux_layer_ids"] == [1, 3, 4]
    assert 0.0 <= m["vocab_lost_mass"] < 1.0 and 0.0 <= m["vocab_oov_argmax_rate"] <= 1.0
    ev = on_disk["eval"]
    assert [(r["verify_mode"], r["temperature"]) for r in ev] == [
        ("greedy", 0.0),
        ("greedy_draft", 1.0),
        ("probabilistic", 1.0),
    ]
    for r in ev:
        assert EVAL_KEYS <= r.keys()
        assert r["k"] == 2 and r["num_tokens"] > 0
        for key in ("acceptance_length_est", "acceptance_length_measured"):
            assert 1.0 <= r[key] <= 3.0, (key, r[key])
        for key in ("per_position_est", "per_position_measured"):
            assert len(r[key]) == 2 and all(0.0 <= x <= 1.0 for x in r[key])
            assert r[key][1] <= r[key][0] + 1e-9  # r_i: all of the first i accepted, non-increasing
        tag = f"{r['verify_mode']}_T{r['temperature']:g}"
        assert m[f"al_est_{tag}"] == r["acceptance_length_est"]
    assert metric_rows(run_dir)[-1]["al_measured_greedy_T0"] == ev[0]["acceptance_length_measured"]


def test_draft_vocab_holds_every_response_token(tiny_run, tiny_world):
    """The response cache is what was trained on: every response token is in the draft vocab (there are
    fewer distinct ones than draft slots), and d2t maps draft ids onto those target ids."""
    caches = list((tiny_world.home / "cache").glob("responses-*.jsonl"))
    assert len(caches) == 1
    seen = set()
    for _, (_, resp) in ResponseCache(caches[0]).load().items():
        seen.update(resp.tolist())
    draft, _ = load_draft(tiny_run.run_dir / "drafts" / "v0001")
    selected = set(draft.draft_to_target.tolist())
    assert len(seen) <= 48
    assert seen <= selected
    assert draft.t2d.nonzero().flatten().tolist() == sorted(selected)


# --------------------------------------------------------------------------------- caches
def test_second_run_reuses_both_caches(tiny_run, tiny_world, monkeypatch):
    home = tiny_world.home / "cache"
    files = sorted(p for p in home.rglob("*") if p.is_file())
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}

    def no_generation(*a, **k):
        raise AssertionError("responses regenerated although cached")

    def no_capture(*a, **k):
        raise AssertionError("target states recaptured although cached")

    monkeypatch.setattr(ResponseCache, "append", no_generation)
    monkeypatch.setattr(HiddenStore, "write_shard", no_capture)
    recipe = load_recipe(None, tiny_world.overrides(run="tiny-again", **{"eval.enabled": "false"}))
    summary = warmstart.run(recipe)
    assert summary["eval"] == []
    assert sorted(p for p in home.rglob("*") if p.is_file()) == files
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files} == before
    # same data, seed and recipe: the same training, bit for bit
    a, b = trainer_weights(tiny_run.run_dir), trainer_weights(recipe.run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------------- resume
class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing in the loop may swallow it."""


def test_resume_after_a_kill_matches_an_uninterrupted_run(tiny_run, tiny_world, monkeypatch, tmp_path):
    real_step = DraftTrainer.train_step

    def dies_after_3(self, batch):
        if self.progress.step >= 3:
            raise Killed
        return real_step(self, batch)

    overrides = tiny_world.overrides(
        run="killed", out=tmp_path, **{"train.checkpoint_every": 1, "eval.enabled": "false"}
    )
    recipe = load_recipe(None, overrides)
    monkeypatch.setattr(DraftTrainer, "train_step", dies_after_3)
    with pytest.raises(Killed):
        warmstart.run(recipe)
    assert progress(recipe.run_dir)["step"] == 3
    assert versions(recipe.run_dir) == []
    monkeypatch.setattr(DraftTrainer, "train_step", real_step)

    summary = warmstart.run(recipe)
    assert summary["metrics"]["steps"] == 6
    rows = step_rows(recipe.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # continued at 4, not restarted at 1
    ref = step_rows(tiny_run.run_dir)  # same recipe but for checkpointing and eval: same trajectory
    assert [r["lr"] for r in rows] == [r["lr"] for r in ref]
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]
    a, b = trainer_weights(tiny_run.run_dir), trainer_weights(recipe.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert versions(recipe.run_dir) == ["v0001"]


def test_capture_resumed_after_a_kill_gives_the_same_vocab_and_draft(
    tiny_run, tiny_world, monkeypatch, tmp_path
):
    """Killed after the first of two capture shards: the rerun captures only the second, yet picks the same
    draft vocab (the predicted mass of the first shard still counts) and trains the same draft."""
    home = tmp_path / "home"
    monkeypatch.setenv("DRAFT_ALIGN_HOME", str(home))  # a cold cache: generation and capture run again
    real_write = HiddenStore.write_shard

    def dies_after_first(self, n, records):
        if n >= 1:
            raise Killed
        real_write(self, n, records)

    recipe = load_recipe(None, tiny_world.overrides(run="cap", out=tmp_path, **{"eval.enabled": "false"}))
    monkeypatch.setattr(HiddenStore, "write_shard", dies_after_first)
    with pytest.raises(Killed):
        warmstart.run(recipe)
    (store,) = (home / "cache").glob("hidden-*")
    assert sorted(p.name for p in store.iterdir()) == ["shard-00000.safetensors"]
    monkeypatch.setattr(HiddenStore, "write_shard", real_write)

    warmstart.run(recipe)
    assert sorted(p.name for p in store.iterdir()) == [
        ".complete",
        "shard-00000.safetensors",
        "shard-00001.safetensors",
        "vocab_stats.safetensors",
    ]
    ref_store = tiny_world.home / "cache" / store.name  # the same settings: the same cache key
    got, want = (
        load_file(str(store / "vocab_stats.safetensors")),
        load_file(str(ref_store / "vocab_stats.safetensors")),
    )
    assert torch.equal(got["counts"], want["counts"]) and torch.equal(got["mass"], want["mass"])
    a, _ = load_draft(tiny_run.run_dir / "drafts" / "v0001")
    b, _ = load_draft(recipe.run_dir / "drafts" / "v0001")
    assert torch.equal(a.d2t, b.d2t)
    wa, wb = trainer_weights(tiny_run.run_dir), trainer_weights(recipe.run_dir)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_rerun_with_more_steps_continues_and_publishes_a_new_version(tiny_world, tmp_path):
    first = load_recipe(
        None,
        tiny_world.overrides(run="grow", out=tmp_path, **{"train.max_steps": 3, "eval.enabled": "false"}),
    )
    warmstart.run(first)
    assert progress(first.run_dir)["step"] == 3
    more = load_recipe(
        None,
        tiny_world.overrides(run="grow", out=tmp_path, **{"train.max_steps": 5, "eval.enabled": "false"}),
    )
    summary = warmstart.run(more)
    assert summary["metrics"]["steps"] == 5
    rows = step_rows(more.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert progress(more.run_dir)["total_steps"] == 5
    # the schedule now ends at step 5: steps 4 and 5 run at the cosine of a 5-step schedule
    s = OptimSettings(warmup_steps=2)
    for r in rows[3:]:
        assert r["lr"] == pytest.approx(3e-3 * lr_factor(s, r["step"] - 1, 5))
    assert versions(more.run_dir) == ["v0001", "v0002"]
    assert read_latest(more.run_dir) == more.run_dir / "drafts" / "v0002"
    assert load_draft(more.run_dir / "drafts" / "v0002")[1]["metrics"]["steps"] == 5


def test_train_loss_selects_the_objective_of_the_warmstart(tiny_world, tmp_path):
    """train.objective.loss=expected_length with a soft-CE mix: the logged loss is the chain objective plus λ·Σ_j w_j CE_j
    (K − E[accepted drafts] ≤ K; with soft CE selected instead, loss − λ·Σ_j w_j CE_j measured 8.3 > K = 3)."""
    recipe = load_recipe(
        None,
        tiny_world.overrides(
            run="el",
            out=tmp_path,
            **{
                "train.max_steps": 3,
                "eval.enabled": "false",
                "train.objective.loss": "expected_length",
                "train.objective.soft_ce_weight": 0.5,
            },
        ),
    )
    warmstart.run(recipe)
    rows = step_rows(recipe.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and versions(recipe.run_dir) == ["v0001"]
    k, decay = recipe.train.objective.ttt_steps, 0.8
    for r in rows:
        soft = sum(decay**j * r[f"ce_{j}"] for j in range(k))
        chain = r["loss"] - 0.5 * soft  # K − E[accepted drafts] per chain
        assert 0.5 < chain <= k, (r["loss"], soft, k)


# --------------------------------------------------------------------------------- failures
@pytest.mark.parametrize(
    ("max_bad", "match"),
    [(2, "2 consecutive non-finite losses"), (1000, r"all \d+ training steps had a non-finite loss")],
)
def test_nan_losses_fail_without_publishing(tiny_world, monkeypatch, tmp_path, max_bad, match):
    """NaN captured states: the run stops with a 'non-finite' error (after max_bad in a row, or at the end
    when no step was finite) and publishes nothing."""
    real_records = HiddenStore.records

    def nan_records(self):
        for r in real_records(self):
            aux = r.aux.clone()
            aux[0, 0] = float("nan")
            yield type(r)(r.input_ids, r.loss_mask, aux, r.final)

    monkeypatch.setattr(HiddenStore, "records", nan_records)
    recipe = load_recipe(
        None,
        tiny_world.overrides(
            run="nan", out=tmp_path, **{"train.max_consecutive_nonfinite": max_bad, "eval.enabled": "false"}
        ),
    )
    with pytest.raises(warmstart.WarmstartError, match=match):
        warmstart.run(recipe)
    assert versions(recipe.run_dir) == []
    assert not (recipe.run_dir / "latest").exists()
    assert not (recipe.run_dir / "trainer").exists()


def test_regenerate_false_trains_on_the_original_responses(tiny_world, monkeypatch):
    def no_generation(*a, **k):
        raise AssertionError("generate_responses called with data.regenerate=false")

    monkeypatch.setattr(warmstart_prepare, "generate_responses", no_generation)
    recipe = load_recipe(None, tiny_world.overrides(run="orig", **{"data.regenerate": "false"}))
    prep = warmstart.prepare(recipe)
    convs = data.load_conversations(str(tiny_world.data))
    train_idx, _ = data.split_heldout(list(range(len(convs))), 8, 0)
    chosen = [convs[i] for i in train_idx[:24]]  # data.max_conversations=24 after holding out 8
    want = [data.encode_conversation(prep.tokenizer, c, recipe.data.max_seq_len) for c in chosen]
    assert len(prep.records) == len(want) == 24
    for rec, w in zip(prep.records, want, strict=True):
        assert torch.equal(rec.input_ids, w.input_ids) and torch.equal(rec.loss_mask, w.loss_mask)
    # and those are the dataset's own assistant texts
    first_reply = next(m.content for m in chosen[0].messages if m.role == "assistant")
    resp = prep.tokenizer.decode(prep.records[0].input_ids[prep.records[0].loss_mask])
    assert resp.startswith(first_reply + "<|im_end|>")


def test_default_aux_layers_of_a_six_layer_target_are_rejected_early(tiny_world, monkeypatch):
    """(2, L//2, L-3) = (2, 3, 3) for 6 layers: refused before any generation or capture."""

    def no_generation(*a, **k):
        raise AssertionError("generation started before the aux layers were checked")

    monkeypatch.setattr(warmstart_prepare, "generate_responses", no_generation)
    recipe = load_recipe(None, tiny_world.overrides(run="aux", **{"draft.aux_layer_ids": "null"}))
    with pytest.raises(warmstart.WarmstartError, match=r"\(2, 3, 3\).*distinct.*draft\.aux_layer_ids"):
        warmstart.prepare(recipe)


def test_too_few_conversations(tiny_world, tmp_path):
    recipe = load_recipe(
        None,
        tiny_world.overrides(
            run="few",
            **{"data.source": str(tiny_world.write_chats(tmp_path / "few.jsonl", n=5)), "data.heldout": 8},
        ),
    )
    with pytest.raises(warmstart.WarmstartError, match="5 conversations, need more than heldout=8"):
        warmstart.prepare(recipe)
