import io
import json
import logging
import math
import os
import threading
import time

import pytest

from draft_align.monitor.live import (
    COLUMNS,
    HEADER,
    LiveTable,
    _Tail,
    follow,
    format_row,
    metrics_url,
    parse_metrics,
    read_jsonl,
    sample_key,
)
from draft_align.monitor.sinks import write_port_file

REC = {
    "time": 1.7e9,
    "step": 12,
    "policy_version": 12,
    "draft_version": 4,
    "staleness": 2,
    "reward_mean": 0.4567,
    "kl_to_initial": 0.01234,
    "accept_measured_adapted": 2.3456,
    "accept_measured_frozen": 1.9876,
    "accept_est_adapted": 2.25,
    "accept_est_frozen_prob": 1.5,  # only the probabilistic estimate: the column falls back to it
    "buffer_fill": 0.456,
    "wire_dropped": 3,
    "wire_rejected": 1,
    "sidecar_train_tokens_per_s": 12345.6,
    "some_future_key": "ignored",
}


def row_cells(row: str) -> list[str]:
    return row.split()


def test_format_row_values_and_widths():
    row = format_row(REC)
    assert row_cells(row) == "12 12 4 2 0.457 0.0123 2.346 1.988 2.250 1.500 46% 3 1 12346".split()
    assert len(row) == len(HEADER)
    assert row_cells(HEADER)[0] == "step" and len(COLUMNS) == 14


def test_format_row_missing_null_and_bad_values_print_dash():
    row = format_row({"step": 3, "reward_mean": None, "kl_to_initial": float("nan"), "staleness": "x"})
    cells = row_cells(row)
    assert cells[0] == "3" and cells[1:] == ["-"] * 13
    assert len(row) == len(HEADER)
    with pytest.raises(TypeError, match="must be a mapping"):
        format_row([1, 2])


def write_lines(path, records, partial: str = ""):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(partial)


def test_follow_once_prints_complete_rows(tmp_path):
    recs = [dict(REC, step=s, reward_mean=0.1 * s) for s in range(3)]
    write_lines(tmp_path / "sidecar" / "monitor.jsonl", recs, partial='{"step": 99, "rew')
    out = io.StringIO()
    assert follow(tmp_path, once=True, out=out) == 3
    lines = out.getvalue().splitlines()
    assert lines[0] == HEADER
    assert [row_cells(x)[:5] for x in lines[1:]] == [
        ["0", "12", "4", "2", "0.000"],
        ["1", "12", "4", "2", "0.100"],
        ["2", "12", "4", "2", "0.200"],
    ]  # the partial line (step 99) is not shown yet


def test_follow_once_without_log_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no monitor log"):
        follow(tmp_path, once=True, out=io.StringIO())


@pytest.mark.parametrize("kw, match", [({"interval_s": 0}, "interval_s"), ({"max_wait_s": -1}, "max_wait_s")])
def test_follow_rejects_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        follow(tmp_path, out=io.StringIO(), **kw)


def test_follow_skips_malformed_lines_with_a_warning(tmp_path, caplog):
    p = tmp_path / "sidecar" / "monitor.jsonl"
    p.parent.mkdir(parents=True)
    p.write_text('{"step": 1}\nnot json\n[1, 2]\n\n{"step": 2}\n')
    out = io.StringIO()
    with caplog.at_level(logging.WARNING, logger="draft_align.monitor.live"):
        assert follow(tmp_path, once=True, out=out) == 2
    assert [row_cells(x)[0] for x in out.getvalue().splitlines()[1:]] == ["1", "2"]
    warned = [r.getMessage() for r in caplog.records]
    assert (
        len(warned) == 1 and "skipped 2 bad line(s)" in warned[0] and "monitor.jsonl:2: not JSON" in warned[0]
    )


def _big_log(path, mib):
    """~``mib`` MiB of monitor rows over 50 steps (the same steps reported again and again)."""
    row = {**REC, "pad": "z" * 150}
    lines = []
    for i in range(mib * (1 << 20) // (len(json.dumps(row)) + 1)):
        lines.append(json.dumps({**row, "step": i % 50}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def test_monitor_once_and_load_steps_stream_a_large_log(tmp_path):
    """An 8 MiB log is read in bounded pieces: the peak of Python allocations stays far below the file's size
    (reading it whole, as before, took more than twice the file)."""
    import tracemalloc

    from draft_align.monitor.report import load_steps

    n = _big_log(tmp_path / "sidecar" / "monitor.jsonl", 8)
    tracemalloc.start()
    try:
        with open(os.devnull, "w") as out:
            assert follow(tmp_path, once=True, out=out) == n
        _, peak_follow = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        steps = load_steps(tmp_path / "sidecar" / "monitor.jsonl")
        _, peak_load = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [r["step"] for r in steps] == list(range(50))
    assert peak_follow < 5 << 20, peak_follow  # a 1 MiB chunk and its lines
    assert peak_load < 4 << 20, peak_load  # one line and the 50 merged steps


def test_follow_tails_a_file_appended_by_a_thread(tmp_path):
    """The log appears after following starts; lines arrive in pieces; follow stops after max_wait_s idle."""
    path = tmp_path / "sidecar" / "monitor.jsonl"
    steps = [0, 1, 2, 3]

    def writer():
        time.sleep(0.1)  # follow starts before the file exists
        path.parent.mkdir(parents=True)
        with open(path, "a") as f:
            for s in steps:
                line = json.dumps(dict(REC, step=s, kl_to_initial=0.001 * (s + 1))) + "\n"
                half = len(line) // 2
                f.write(line[:half])
                f.flush()
                time.sleep(0.08)  # several polls see only the first half of the line
                f.write(line[half:])
                f.flush()
                time.sleep(0.03)

    t = threading.Thread(target=writer)
    out = io.StringIO()
    t.start()
    start = time.monotonic()
    rows = follow(tmp_path, interval_s=0.02, out=out, max_wait_s=0.4)
    elapsed = time.monotonic() - start
    t.join()
    lines = out.getvalue().splitlines()
    assert rows == 4
    assert lines[0] == HEADER
    assert lines[1] == f"# waiting for {path} ..."
    assert [row_cells(x)[0] for x in lines[2:]] == ["0", "1", "2", "3"]
    assert [row_cells(x)[5] for x in lines[2:]] == ["0.0010", "0.0020", "0.0030", "0.0040"]
    assert 0.4 + 0.1 + 4 * 0.11 - 0.05 < elapsed < 5.0  # ran until the writer finished, then max_wait_s idle


def test_follow_gives_up_after_max_wait_when_nothing_arrives(tmp_path):
    out = io.StringIO()
    start = time.monotonic()
    assert follow(tmp_path, interval_s=0.02, out=out, max_wait_s=0.1) == 0
    assert 0.1 <= time.monotonic() - start < 2.0


def test_tail_restarts_on_replacement_and_truncation(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"st')
    tail = _Tail(p)
    assert tail.poll() == [b'{"step": 1}', b'{"step": 2}']
    assert tail.poll() == []
    with open(p, "a") as f:
        f.write('ep": 3}\n')
    assert tail.poll() == [b'{"step": 3}']
    tmp = tmp_path / "new.jsonl"
    tmp.write_text('{"step": 7}\n' * 5)  # longer than the old file: only the inode changes
    os.replace(tmp, p)
    assert tail.poll() == [b'{"step": 7}'] * 5
    p.write_text('{"step": 8}\n')  # truncated in place
    assert tail.poll() == [b'{"step": 8}']


def test_read_jsonl_skips_partial_last_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"a": 1}\n{"a": 2}\n{"a": 3')
    assert read_jsonl(p) == [{"a": 1}, {"a": 2}]
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")


def test_metrics_url_from_port_file(tmp_path):
    assert metrics_url(tmp_path) is None
    write_port_file(tmp_path / "sidecar" / "prometheus.port", 9123)
    assert metrics_url(tmp_path) == "http://127.0.0.1:9123/metrics"


def test_parse_metrics_format_details():
    text = (
        "# HELP x help with } and {\n"
        "# TYPE x gauge\n"
        "\n"
        "x 1.5 1712345678000\n"  # timestamp ignored
        'h_bucket{le="+Inf"} +Inf\n'
        'y{ a = "1" , b="q\\"z" } 2\n'  # whitespace inside braces, escaped quote
        "x 2\n"  # repeated: last value wins
    )
    assert parse_metrics(text) == {"x": 2.0, 'h_bucket{le="+Inf"}': math.inf, 'y{a="1",b="q\\"z"}': 2.0}
    assert sample_key("n", {"b": "2", "a": 'q"\n'}) == 'n{a="q\\"\\n",b="2"}'


@pytest.mark.parametrize("line", ["1x 2", "x", "x abc", 'x{a="1" 2', 'x{a="1', "x{a=1} 1"])
def test_parse_metrics_rejects_malformed(line):
    with pytest.raises(ValueError):
        parse_metrics("# ok\n" + line + "\n")


# ----------------------------------------------------------------------------- the live table of `cotrain`
SIDECAR_TITLES = ("est.ad", "est.fr", "buf", "drops", "rej", "train tok/s")


def rl_metrics(step: int) -> dict:
    """What the RL job knows of a step (no sidecar keys)."""
    return {
        "step": step,
        "policy_version": step + 1,
        "draft_version": 0,
        "staleness": 1,
        "reward_mean": 0.5,
        "kl_to_initial": 0.01,
        "accept_measured_adapted": 1.8,
        "accept_measured_frozen": 1.7,
        "wire_dropped": 0,
    }


def sidecar_row(step: int) -> dict:
    """The sidecar's monitor.jsonl row of a step (it repeats the RL metrics it was sent)."""
    return {
        **rl_metrics(step),
        "accept_est_adapted": 1.9 + 0.01 * step,
        "accept_est_frozen": 1.85,
        "buffer_fill": 0.25,
        "wire_rejected": 2,
        "sidecar_train_tokens_per_s": 1000.0 + step,
    }


def cells(row: str) -> dict[str, str]:
    """A printed row's cells by column title (cells are right-aligned to the titles' widths)."""
    out, pos = {}, 0
    for c in COLUMNS:
        out[c.title] = row[pos : pos + c.width].strip()
        pos += c.width + 1
    return out


def append(path, rec):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def test_live_table_waits_for_the_sidecar_row_of_each_step(tmp_path, until):
    mon = tmp_path / "sidecar" / "monitor.jsonl"
    out = io.StringIO()
    table = LiveTable(mon, out, row_wait_s=60, poll_s=0.02).start()
    table.add(rl_metrics(0))
    table.add(rl_metrics(1))
    time.sleep(0.2)
    assert out.getvalue() == HEADER + "\n"  # no sidecar row yet: nothing printed, the RL job was not held
    append(mon, sidecar_row(0))
    assert until(lambda: len(table.rows) == 1, 5)
    append(mon, sidecar_row(1))
    assert until(lambda: len(table.rows) == 2, 5)
    table.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == HEADER and len(lines) == 3 and table.merged == 2
    for step, line in enumerate(lines[1:]):
        c = cells(line)
        assert c["step"] == str(step) and c["acc.ad"] == "1.800"
        assert c["est.ad"] == f"{1.9 + 0.01 * step:.3f}" and c["est.fr"] == "1.850"
        assert (c["buf"], c["drops"], c["rej"], c["train tok/s"]) == ("25%", "0", "2", str(1000 + step))


def test_live_table_prints_without_the_sidecar_when_it_is_late_gone_or_skipped(tmp_path, until):
    mon = tmp_path / "sidecar" / "monitor.jsonl"
    out = io.StringIO()
    alive = threading.Event()
    alive.set()
    table = LiveTable(mon, out, row_wait_s=0.3, poll_s=0.02, sidecar_alive=alive.is_set).start()
    t0 = time.monotonic()
    table.add(rl_metrics(0))  # never gets a sidecar row: printed after row_wait_s
    assert until(lambda: len(table.rows) == 1, 5)
    assert time.monotonic() - t0 >= 0.3
    table.add(rl_metrics(1))  # skipped by the sidecar: released as soon as step 2's row arrives
    table.add(rl_metrics(2))
    append(mon, sidecar_row(2))
    assert until(lambda: len(table.rows) == 3, 5)
    table.add(rl_metrics(3))
    alive.clear()  # the sidecar died: no more waiting
    assert until(lambda: len(table.rows) == 4, 5)
    table.add(rl_metrics(4))
    table.close()  # close prints what is still pending
    rows = [cells(x) for x in table.rows]
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4"]
    for r in rows:
        filled = r["step"] == "2"
        assert all((r[t] != "-") == filled for t in SIDECAR_TITLES if t != "drops"), r
        assert r["drops"] == "0" and r["acc.ad"] == "1.800"  # the RL job's own numbers are always there
    assert table.merged == 1


def test_live_table_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="row_wait_s"):
        LiveTable(tmp_path / "m.jsonl", io.StringIO(), row_wait_s=-1)
    table = LiveTable(tmp_path / "m.jsonl", io.StringIO())
    with pytest.raises(ValueError, match="step"):
        table.add({"reward_mean": 1.0})
