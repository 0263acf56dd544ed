"""``draft-align export --check {vllm,sglang,speculators}``: the real loader when the client is installed,
the rule-based check when it is not (forced here by hiding the package), and the output says which ran."""

from __future__ import annotations

import importlib.util

import pytest

from draft_align import cli
from draft_align.engines import client_check

HAS = {p: importlib.util.find_spec(p) is not None for p in ("vllm", "speculators")}


def export_check(run_dir, out, client, dialect="hf"):
    return cli.main(
        ["export", "--draft", str(run_dir), "--out", str(out), "--dialect", dialect, "--check", client]
    )


@pytest.mark.skipif(
    not HAS["speculators"], reason="speculators not installed (pip install -e '.[speculators]')"
)
def test_check_speculators_real_loader(tiny_run, tmp_path, capsys):
    assert export_check(tiny_run.run_dir, tmp_path / "s", "speculators", "speculators") == 0
    text = capsys.readouterr().out
    assert "speculators: ran real loader: speculators 0.9" in text and "Eagle3DraftModel" in text
    assert "speculators: compatible" in text


@pytest.mark.skipif(not HAS["vllm"], reason="vllm not installed (pip install -e '.[vllm]')")
def test_check_vllm_real_loader(tiny_run, tmp_path, capsys):
    assert export_check(tiny_run.run_dir, tmp_path / "v", "vllm") == 0
    text = capsys.readouterr().out
    assert "vllm: ran real loader: vLLM" in text and "Eagle3LlamaForCausalLM.load_weights" in text
    assert "vllm: compatible" in text


@pytest.mark.parametrize("client, dialect", [("vllm", "hf"), ("speculators", "speculators")])
def test_rule_based_when_not_installed(tiny_run, tmp_path, capsys, monkeypatch, client, dialect):
    monkeypatch.setattr(client_check, "_installed", lambda pkg: None)
    assert export_check(tiny_run.run_dir, tmp_path / "r", client, dialect) == 0
    text = capsys.readouterr().out
    assert f"{client}: ran rule-based ({client} not installed)" in text
    assert f"{client}: compatible" in text


def test_speculators_rules_refuse_hf_dialect(tiny_run, tmp_path, capsys):
    assert export_check(tiny_run.run_dir, tmp_path / "h", "speculators", "hf") == 1
    assert "not a speculators-dialect folder" in capsys.readouterr().out


def test_sglang_says_which_ran(tiny_run, tmp_path, capsys):
    from draft_align.publish.sglang_client import sglang_available

    rc = export_check(tiny_run.run_dir, tmp_path / "g", "sglang")
    text = capsys.readouterr().out
    if sglang_available() is None:
        assert "sglang: ran real loader" in text
    else:
        assert "sglang: ran rule-based (SGLang's loader not importable here:" in text
    assert ("sglang: compatible" in text) == (rc == 0)
