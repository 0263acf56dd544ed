"""draft_align.cli: help, exit codes, eval --json on the tiny warm-started draft, incompatible targets."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draft_align import cli
from draft_align.monitor.evaluate import REQUIRED_KEYS

REPO = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ["fetch", "warmstart", "eval", "export"]
EVAL_KEYS = REQUIRED_KEYS
pytestmark = pytest.mark.usefixtures("tiny_env")


def test_module_help_in_a_subprocess():
    out = subprocess.run(
        [sys.executable, "-m", "draft_align", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: draft-align")
    for sub in SUBCOMMANDS:
        assert sub in out.stdout


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_subcommand_help(sub, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([sub, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: draft-align {sub}")


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train-everything"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_missing_recipe_exits_2_with_a_clear_message(caplog, tmp_path):
    missing = tmp_path / "nonexistent.yaml"
    with caplog.at_level(logging.ERROR, logger="draft_align"):
        assert cli.main(["warmstart", str(missing)]) == 2
    assert f"recipe {missing} does not exist" in caplog.text


def test_bad_override_exits_2_naming_the_key(caplog):
    with caplog.at_level(logging.ERROR, logger="draft_align"):
        assert cli.main(["warmstart", str(REPO / "recipes" / "smollm2_demo.yaml"), "train.nope=1"]) == 2
    assert "nope" in caplog.text


def eval_args(tiny_run, *extra: str, engine: str = "reference", pool: str = "8") -> list[str]:
    """eval on the tiny run (the reference decoder unless told: vLLM cannot serve the tiny target's head_dim 16)."""
    return [
        "eval",
        "--draft",
        str(tiny_run.run_dir),
        "--data",
        str(tiny_run.world.data),
        "--prompts-pool",
        pool,
        "--prompts",
        "2",
        "--max-new-tokens",
        "6",
        "--k",
        "2",
        "--json",
        "--engine",
        engine,
        *extra,
    ]


def eval_json(capsys) -> dict:
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1
    return json.loads(lines[0])


def test_eval_json_prints_one_object_with_the_required_keys(tiny_run, capsys):
    assert cli.main(eval_args(tiny_run)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert EVAL_KEYS <= res.keys()
    assert res["engine"] == "reference"
    assert res["k"] == 2 and res["verify_mode"] == "greedy" and res["temperature"] == 0.0
    assert res["num_prompts"] == 2 and res["num_tokens"] > 0
    assert 1.0 <= res["acceptance_length_measured"] <= 3.0 and 1.0 <= res["acceptance_length_est"] <= 3.0
    assert len(res["per_position_measured"]) == 2


def test_eval_of_a_small_file_evaluates_all_of_it(tiny_run, capsys, caplog):
    """The tiny data file holds 40 conversations: with the default pool of 64 it is evaluated whole (as with
    --heldout-seed -1) instead of failing on a held-out split larger than the file."""
    n = len(tiny_run.world.data.read_text().splitlines())
    assert n < 64
    every = (
        "--prompts",
        "64",
        "--max-new-tokens",
        "2",
    )  # as many prompts as there are: the count shows the set
    with caplog.at_level(logging.INFO, logger="draft_align"):
        assert cli.main(eval_args(tiny_run, *every, pool="64")) == 0
    whole = eval_json(capsys)
    assert f"holds {n} conversations (≤ --prompts-pool 64): evaluating all of them" in caplog.text
    assert cli.main(eval_args(tiny_run, *every, "--heldout-seed", "-1")) == 0
    everything = eval_json(capsys)
    assert cli.main(eval_args(tiny_run, *every)) == 0  # a pool of 8 < 40: the held-out split
    held = eval_json(capsys)
    same = ("acceptance_length_measured", "per_position_measured", "num_tokens", "num_prompts")
    assert [whole[k] for k in same] == [everything[k] for k in same]
    assert whole["num_prompts"] > 8 >= held["num_prompts"]


def test_eval_engine_choice(tiny_run, capsys, caplog, monkeypatch):
    """auto: vLLM when installed, else (and for a mode vLLM lacks) the reference decoder, said in the log and
    the JSON; --engine vllm insists, with a one-line error."""
    from draft_align.engines.vllm import start

    monkeypatch.setattr(start, "vllm_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="draft_align"):
        assert cli.main(eval_args(tiny_run, engine="auto")) == 0
        assert eval_json(capsys)["engine"] == "reference"
        assert "vLLM is not installed; measuring with the reference decoder" in caplog.text
        caplog.clear()
        assert cli.main(eval_args(tiny_run, engine="vllm")) == 2
        assert "error: ImportError: --engine vllm: vLLM is not installed" in caplog.text
        monkeypatch.setattr(
            start, "vllm_available", lambda: True
        )  # nothing starts before the mode is checked
        caplog.clear()
        greedy_t1 = ("--verify-mode", "greedy", "--temperature", "1.0")
        assert cli.main(eval_args(tiny_run, *greedy_t1, engine="vllm")) == 2
        assert "vLLM has no argmax-everywhere verification at T > 0" in caplog.text
        caplog.clear()
        assert cli.main(eval_args(tiny_run, *greedy_t1, engine="auto")) == 0
        res = eval_json(capsys)
        assert res["engine"] == "reference" and res["temperature"] == 1.0
        assert "measuring with the reference decoder" in caplog.text


@pytest.mark.parametrize(
    "verbose, preset, expected", [(False, None, "WARNING"), (True, None, None), (False, "DEBUG", "DEBUG")]
)
def test_vllm_info_logging_is_quiet_unless_verbose(verbose, preset, expected, monkeypatch, tmp_path):
    """Without -v the CLI sets VLLM_LOGGING_LEVEL=WARNING (before anything imports vllm); -v leaves vLLM's INFO
    lines on; a level the user set is kept.  vLLM logs to stderr (stdout is the table's) unless told."""
    import os

    for name in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"):
        monkeypatch.setenv(name, "x")  # recorded, so the test's end restores the environment
        monkeypatch.delenv(name)
    if preset is not None:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", preset)
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "level", vllm_logger.level)
    assert cli.main(["-v"] * verbose + ["report", str(tmp_path / "missing")]) == 2
    assert os.environ.get("VLLM_LOGGING_LEVEL") == expected
    assert os.environ.get("VLLM_LOGGING_STREAM") == "ext://sys.stderr"


def test_eval_with_too_long_prompts_exits_2(tiny_run, caplog):
    with caplog.at_level(logging.ERROR, logger="draft_align"):
        assert cli.main(eval_args(tiny_run, "--max-prompt-tokens", "3")) == 2
    assert "no prompts of at most 3 tokens" in caplog.text


def test_export_speculators_dialect(tiny_run, tmp_path, capsys):
    out = tmp_path / "spec"
    assert (
        cli.main(["export", "--draft", str(tiny_run.run_dir), "--out", str(out), "--dialect", "speculators"])
        == 0
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    from draft_align.publish import load_draft

    a, _ = load_draft(tiny_run.run_dir / "drafts" / "v0001")
    b, _ = load_draft(out)
    sa, sb = a.engine_state_dict(), b.engine_state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --------------------------------------------------------------------------------- incompatible targets
def test_target_with_another_tokenizer_is_refused(tiny_run, tmp_path, caplog):
    """Same architecture and vocab size, but another token ↔ id map: the draft's vocab would be wrong."""
    other = tiny_run.world.save_target(
        tmp_path / "other_tok", tokenizer=tiny_run.world.tokenizer(shuffle_seed=1)
    )
    with caplog.at_level(logging.ERROR, logger="draft_align"):
        assert cli.main(eval_args(tiny_run, "--target", str(other))) == 2
    assert "tokenizer fingerprint mismatch" in caplog.text


def test_target_with_another_hidden_size_is_refused(tiny_run, tmp_path, caplog):
    """A draft trained for hidden 64 (fc reads 3·64) on a hidden-32 target: a clear error, no matmul crash."""
    other = tiny_run.world.save_target(tmp_path / "narrow", hidden=32)
    with caplog.at_level(logging.ERROR, logger="draft_align"):
        assert cli.main(eval_args(tiny_run, "--target", str(other))) == 2
    assert "hidden size mismatch: draft trained for 64, target has 32" in caplog.text

    from transformers import AutoConfig

    from draft_align.publish import load_draft
    from draft_align.publish.eagle3_format import validate_draft
    from draft_align.publish.folder import ExportError

    draft, _ = load_draft(tiny_run.run_dir / "drafts" / "v0001")
    with pytest.raises(ExportError, match="hidden size mismatch"):
        validate_draft(draft, AutoConfig.from_pretrained(other))


def test_monitor_and_report_commands_on_a_run_folder(tmp_path, capsys):
    import json

    from draft_align.cli import main

    run = tmp_path / "run"
    (run / "sidecar").mkdir(parents=True)
    rows = [
        {
            "step": s,
            "policy_version": s + 1,
            "kl_to_initial": 0.01 * s,
            "reward_mean": 0.1 * s,
            "accept_measured_adapted": 1.3 + 0.01 * s,
            "accept_measured_frozen": 1.3 - 0.02 * s,
            "accept_est_adapted": 1.31,
            "accept_est_frozen": 1.29,
            "draft_version": s,
        }
        for s in range(4)
    ]
    (run / "sidecar" / "monitor.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["monitor", str(run), "--once"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[0] == "step" and len(out) == 5 and "1.330" in out[-1]
    assert main(["report", str(run)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 4 and (run / "report.png").is_file()
    assert summary["accept_margin"] > 0
    assert main(["report", str(tmp_path / "missing")]) == 2


# ----------------------------------------------------------------------------- operator input: one-line errors
@pytest.mark.parametrize(
    "bad", [["--max-new-tokens", "0"], ["--prompts", "0"], ["--k", "0"], ["--prompts", "x"]]
)
def test_eval_refuses_zero_counts(tiny_run, capsys, bad):
    with pytest.raises(SystemExit) as e:
        cli.main(eval_args(tiny_run, *bad))
    assert e.value.code == 2
    assert bad[0] in capsys.readouterr().err


def test_eval_with_latest_as_a_directory_is_one_line(tiny_run, tmp_path, caplog):
    run = tmp_path / "run"
    (run / "latest").mkdir(parents=True)
    args = eval_args(tiny_run)
    args[args.index("--draft") + 1] = str(run)
    with caplog.at_level(logging.ERROR, logger="draft_align"):
        assert cli.main(args) == 2
    assert f"error: ExportError: {run / 'latest'} is a directory" in caplog.text
    assert not any(r.exc_info for r in caplog.records)  # no traceback without -v


@pytest.fixture
def sidecar_cli(tiny_run, tmp_path):
    """``draft-align sidecar`` in this process on the tiny run, restoring what cmd_sidecar sets process-wide."""
    import signal

    recipe = tmp_path / "cotrain.yaml"
    recipe.write_text("kind: cotrain\n")
    n, handlers = torch.get_num_threads(), {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def run(*overrides: str, verbose: bool = False) -> int:
        argv = ["-v"] if verbose else []
        return cli.main(
            [
                *argv,
                "sidecar",
                str(recipe),
                *tiny_run.cotrain_overrides(tmp_path / "out"),
                *overrides,
                "--max-seconds",
                "0",
            ]
        )

    yield run
    torch.set_num_threads(n)
    for s, h in handlers.items():
        signal.signal(s, h)


def test_sidecar_operator_mistakes_are_one_line_errors(sidecar_cli, tmp_path, caplog):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    (tmp_path / "keydir").mkdir()
    cases = [
        (["wire.key_file=" + str(tmp_path / "keydir")], "is not a regular file"),
        ([f"sidecar.monitor.prometheus_port={busy.getsockname()[1]}"], f"127.0.0.1:{busy.getsockname()[1]}"),
        (["wire.endpoint=ipc:///etc/hostname/tap"], "/etc/hostname"),
        (["sidecar.train.batch_tokens=0"], "sidecar.train.batch_tokens must be ≥ 1"),
    ]
    if not torch.cuda.is_available():
        cases.append((["device=cuda"], "CUDA is not available"))
    try:
        for overrides, match in cases:
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="draft_align"):
                assert sidecar_cli(*overrides) == 2, overrides
            errors = [
                r
                for r in caplog.records
                if r.levelno >= logging.ERROR and r.getMessage().startswith("error:")
            ]
            assert len(errors) == 1 and match in errors[0].getMessage(), (overrides, caplog.text)
            assert "\n" not in errors[0].getMessage() and errors[0].exc_info is None
    finally:
        busy.close()


def test_verbose_keeps_the_traceback(sidecar_cli, caplog):
    with caplog.at_level(logging.ERROR, logger="draft_align"):
        assert sidecar_cli("sidecar.train.batch_tokens=0", verbose=True) == 2
    assert any(r.exc_info for r in caplog.records)


def test_yaml_syntax_error_and_directory_recipe(tmp_path, caplog):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: cotrain\nsidecar: {lr: [\n")
    with caplog.at_level(logging.ERROR, logger="draft_align"):
        assert cli.main(["sidecar", str(bad)]) == 2
        assert cli.main(["sidecar", str(tmp_path)]) == 2
    assert "not valid YAML" in caplog.text and "is a directory" in caplog.text


def test_a_hub_id_without_network_fails_at_once_from_the_cache(monkeypatch, tmp_path):
    """No route to the hub: a hub id loads from the cache only (no network retries) and fails in one line."""
    import socket
    import time

    from draft_align import assets

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache

    def refuse(*a, **k):
        raise OSError("no route")

    monkeypatch.setattr(socket, "create_connection", refuse)
    assert assets.hub_reachable() is False
    t0 = time.monotonic()
    with pytest.raises(assets.AssetError, match="could not load target model 'nobody/no-such-model'"):
        assets.load_target("nobody/no-such-model", torch.float32, "cpu")
    assert time.monotonic() - t0 < 10.0  # the cache alone: no retry loop
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert assets.hub_reachable() is False


@pytest.mark.parametrize("verbose", [False, True])
def test_library_warnings_go_to_the_run_log_and_the_console_only_with_v(verbose, tmp_path, monkeypatch):
    """After route_library_logs (a run command, once its folder is known): vLLM's and other libraries'
    warnings, python warnings among them, land in <run>/logs/<command>.log; the console shows them only with
    -v, and always shows draft_align's own lines and any error.  release_run_logs undoes it."""
    import io
    import warnings

    from draft_align.cli import logs

    for name in ("VLLM_CONFIGURE_LOGGING", "TORCH_CPP_LOG_LEVEL"):
        monkeypatch.setenv(name, "x")  # recorded, so the test's end restores it
        monkeypatch.delenv(name)
    vllm_logger = logging.getLogger("vllm")  # as an unconfigured vLLM leaves it, whatever ran before here
    monkeypatch.setattr(vllm_logger, "level", vllm_logger.level)
    monkeypatch.setattr(vllm_logger, "propagate", True)
    monkeypatch.setattr(vllm_logger, "handlers", [])
    root = logging.getLogger()
    console = io.StringIO()
    handler = logging.StreamHandler(console)
    monkeypatch.setattr(root, "level", logging.INFO)
    root.addHandler(handler)
    try:
        logs.setup_logging(verbose)
        assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"  # vLLM's records reach our handlers
        assert os.environ.get("TORCH_CPP_LOG_LEVEL") == (None if verbose else "ERROR")  # C++ warnings on fd 2
        path = logs.route_library_logs(tmp_path / "run", "cotrain", verbose)
        logging.getLogger("vllm.platforms.cpu").warning("libtcmalloc is not found in LD_PRELOAD")
        logging.getLogger("draft_align.cotrain").info("step 0 done")
        logging.getLogger("transformers.x").error("a library error")
        warnings.warn("a library's python warning", UserWarning, stacklevel=1)
    finally:
        logs.release_run_logs()
        root.removeHandler(handler)
    assert path == tmp_path / "run" / "logs" / "cotrain.log"
    in_file, shown = path.read_text(), console.getvalue()
    for line in ("libtcmalloc", "step 0 done", "a library error", "a library's python warning"):
        assert line in in_file
    assert "step 0 done" in shown and "a library error" in shown
    assert ("libtcmalloc" in shown) is verbose and ("a library's python warning" in shown) is verbose
    assert not any(isinstance(h, logs.RunLogHandler) for h in root.handlers)
    assert logs.ours not in handler.filters


@pytest.mark.parametrize("verbose", [False, True])
def test_transformers_progress_bars_are_off_without_v(verbose, tmp_path):
    """transformers' tqdm bars (from_pretrained's "Loading weights") are not log records: a run command turns
    them off without -v, and release_run_logs turns them on again."""
    from transformers.utils import logging as hf_logging

    from draft_align.cli import logs

    assert hf_logging.is_progress_bar_enabled()
    try:
        logs.route_library_logs(tmp_path / "run", "cotrain", verbose)
        assert hf_logging.is_progress_bar_enabled() is verbose
    finally:
        logs.release_run_logs()
    assert hf_logging.is_progress_bar_enabled()


def test_vllm_configure_logging_set_by_the_user_is_kept(monkeypatch):
    from draft_align.cli import logs

    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "1")
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "level", vllm_logger.level)
    logs.setup_logging(False)
    logs.release_run_logs()
    assert os.environ["VLLM_CONFIGURE_LOGGING"] == "1"


def test_console_keeps_only_warnings_of_the_per_refresh_loggers():
    import logging

    from draft_align.cli.logs import ours

    def rec(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "x", None, None)

    assert not ours(rec("draft_align.rl.drafts", logging.INFO))
    assert not ours(rec("draft_align.engines.vllm.refresher", logging.INFO))
    # the per-step lines: the live table has a row per step
    assert not ours(rec("draft_align.rl.grpo", logging.INFO))
    assert not ours(rec("draft_align.engines.vllm.vllm_rollouts", logging.INFO))
    assert ours(rec("draft_align.rl.grpo", logging.WARNING))
    assert ours(rec("draft_align.rl.drafts", logging.WARNING))
    assert ours(rec("draft_align.cotrain", logging.INFO)) and ours(rec("vllm.engine", logging.ERROR))
    assert not ours(rec("vllm.engine", logging.WARNING))
