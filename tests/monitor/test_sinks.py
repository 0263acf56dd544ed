"""draft_align.monitor.sinks: the Prometheus page (prometheus_client, a registry per sink), JSONL files and the
fan-out a loop hands its rows to; the port file."""

import json
import math
import threading
import urllib.error
import urllib.request
from dataclasses import replace

import pytest

from draft_align.monitor.live import parse_metrics, scrape
from draft_align.monitor.rows import SidecarStats, StepRow
from draft_align.monitor.sinks import JsonlSink, PromSink, Sinks, read_port_file, write_port_file

STATS = SidecarStats(
    draft_version=1,
    draft_policy_version=0,
    buffer_tokens=40,
    buffer_fill=0.25,
    train_steps=4,
    trained_tokens=70,
    train_tokens_per_s=None,
    ingest_tokens_per_s=60.0,
    ingested_tokens=90,
    wire_nonfinite=0,
    wire_mismatched=0,
    nonfinite_steps=0,
    nonfinite_heads=0,
    gate_rejections=0,
    restarts=0,
    rejected={"mac": 3},
)


def row(stats: SidecarStats = STATS, **metrics) -> StepRow:
    return StepRow(time=1.7e9, step=2, policy_version=1, rl=metrics, sidecar=stats)


@pytest.fixture
def prom():
    p = PromSink()
    yield p
    p.close()


def _page(p: PromSink) -> str:
    from prometheus_client import generate_latest

    return generate_latest(p.registry).decode()


def test_page_has_a_gauge_per_number_and_the_rejection_counter(prom):
    prom.observe(row(reward_mean=0.5, ok=True, note="text", nothing=None))
    page = _page(prom)
    assert "# TYPE draft_align_reward_mean gauge\ndraft_align_reward_mean 0.5\n" in page
    assert (
        "# HELP draft_align_wire_rejected_total wire messages rejected\n"
        "# TYPE draft_align_wire_rejected_total counter\n"
        'draft_align_wire_rejected_total{reason="mac"} 3.0\n'
    ) in page
    got = parse_metrics(page)
    want = {
        f"draft_align_{k}": float(v)
        for k, v in row(reward_mean=0.5).to_dict().items()
        if isinstance(v, (int, float)) and k != "time"
    }
    assert got == {
        **want,
        'draft_align_wire_rejected_total{reason="mac"}': 3.0,
        "draft_align_prom_dropped_names_total": 0.0,
    }
    assert "draft_align_time" not in got and "draft_align_ok" not in got and "draft_align_note" not in got
    # a field that is None later keeps its gauge; counters follow the receiver's totals
    prom.observe(replace(STATS, ingest_tokens_per_s=None, train_steps=5, rejected={"mac": 4, "frames": 1}))
    got = parse_metrics(_page(prom))
    assert (
        got["draft_align_sidecar_ingest_tokens_per_s"] == 60.0
        and got["draft_align_sidecar_train_steps"] == 5.0
    )
    assert got['draft_align_wire_rejected_total{reason="mac"}'] == 4.0
    assert got['draft_align_wire_rejected_total{reason="frames"}'] == 1.0


def test_scrape_round_trip_with_escaped_labels_nan_inf(prom):
    nasty = 'a "quoted" \\ back\nslash, {braces} = x'
    prom.observe(row(replace(STATS, rejected={nasty: 2}), kl=0.0123, nan=float("nan"), inf=float("-inf")))
    got = scrape(prom.url)
    assert got["draft_align_kl"] == 0.0123 and got["draft_align_inf"] == -math.inf
    assert math.isnan(got["draft_align_nan"])
    lab = 'draft_align_wire_rejected_total{reason="a \\"quoted\\" \\\\ back\\nslash, {braces} = x"}'
    assert got[lab] == 2.0


def test_http_content_type(prom):
    prom.observe(STATS)
    with urllib.request.urlopen(prom.url, timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert parse_metrics(r.read().decode())["draft_align_published_versions"] == 1.0


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("reward/mean", "draft_align_reward_mean"),
        ("kl-to-initial", "draft_align_kl_to_initial"),
        ("accept len", "draft_align_accept_len"),
        ("a{b}", "draft_align_a_b_"),
        ("é", "draft_align__"),
        ("9lives", "draft_align_9lives"),
    ],
)
def test_any_key_becomes_a_valid_metric_name(prom, key, name):
    prom.observe(row(**{key: 1.5}))
    got = scrape(prom.url)  # the page parses: every name is valid in the text format
    assert got[name] == 1.5


def test_distinct_names_are_bounded_and_the_dropped_ones_counted():
    p = PromSink(max_gauges=30)
    try:
        base = len([k for k, v in row().to_dict().items() if isinstance(v, (int, float)) and k != "time"])
        p.observe(row(**{f"m{i}": float(i) for i in range(100)}))
        got = parse_metrics(_page(p))
        gauges = [k for k in got if not k.endswith("_total") and "_total{" not in k]
        assert len(gauges) == 30
        assert got["draft_align_prom_dropped_names_total"] == base + 100 - 30
        # names already exported keep updating; new ones stay out
        p.observe(row(m0=7.0, fresh=1.0))
        got = parse_metrics(_page(p))
        assert "draft_align_fresh" not in got
        assert got.get("draft_align_m0", 7.0) == 7.0
    finally:
        p.close()


def test_idle_connections_time_out_and_are_bounded():
    import socket
    import time

    p = PromSink(timeout_s=0.5, max_connections=4)
    try:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", p.port)) for _ in range(40)]
        time.sleep(0.2)
        assert threading.active_count() - before <= 4  # at most max_connections handler threads
        # a scrape is served again once the idle ones timed out
        time.sleep(1.0)
        assert "draft_align_prom_dropped_names_total" in scrape(p.url)
        for s in idle:
            s.close()
        time.sleep(0.3)
        assert threading.active_count() - before <= 1
    finally:
        p.close()


def test_busy_or_invalid_port_is_a_prom_error(prom):
    from draft_align.monitor.sinks import PromError

    with pytest.raises(PromError, match=f"127.0.0.1:{prom.port}"):
        PromSink(port=prom.port)
    with pytest.raises(PromError, match="70000"):
        PromSink(port=70000)


def test_each_sink_has_its_own_registry():
    from prometheus_client import REGISTRY

    with_a, with_b = PromSink(), PromSink()
    try:
        with_a.observe(row(only_a=1.0))
        assert "draft_align_only_a" not in parse_metrics(_page(with_b))
        assert REGISTRY.get_sample_value("draft_align_only_a") is None
    finally:
        with_a.close()
        with_b.close()


def test_pages_served_mid_update_are_consistent(prom):
    def work():
        for n in range(1, 501):
            prom.observe(replace(STATS, rejected={"mac": n}))

    t = threading.Thread(target=work)
    t.start()
    key = 'draft_align_wire_rejected_total{reason="mac"}'
    seen = [scrape(prom.url).get(key, 0.0) for _ in range(10)]
    t.join()
    assert seen == sorted(seen)
    assert scrape(prom.url)[key] == 500.0


def test_close_releases_port_and_is_idempotent():
    p = PromSink()
    url = p.url
    p.close()
    p.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_port_file_round_trip_atomic(tmp_path, prom):
    p = prom.write_port_file(tmp_path / "sidecar" / "prometheus.port")
    assert p.read_text() == f"{prom.port}\n"
    assert read_port_file(p) == prom.port
    assert [f.name for f in p.parent.iterdir()] == ["prometheus.port"]  # no temp file left behind
    write_port_file(p, 9100)  # replaces
    assert read_port_file(p) == 9100
    with pytest.raises(ValueError, match="port must be an int in 1..65535"):
        write_port_file(p, 70000)
    p.write_text("not a port\n")
    with pytest.raises(ValueError, match="expected a port number"):
        read_port_file(p)
    with pytest.raises(FileNotFoundError):
        read_port_file(tmp_path / "missing.port")


def test_sinks_fan_out_rows_and_scalars(tmp_path, prom):
    sinks = Sinks(
        JsonlSink(tmp_path / "run" / "metrics.jsonl"),
        monitor=JsonlSink(tmp_path / "run" / "monitor.jsonl"),
        prom=prom,
    )
    sinks.log({"train/loss": 1.5}, step=3)
    r = row(reward_mean=0.5)
    sinks.observe(r)
    sinks.observe_stats(replace(STATS, draft_version=2))
    monitor = [json.loads(x) for x in (tmp_path / "run" / "monitor.jsonl").read_text().splitlines()]
    assert monitor == [r.to_dict()]
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [3, 4]  # the row at the sidecar's train step
    assert metrics[0]["train/loss"] == 1.5 and metrics[1]["rl/reward_mean"] == 0.5
    assert {k for k in metrics[1] if k not in ("step", "time")} == set(r.series())
    assert scrape(prom.url)["draft_align_published_versions"] == 2.0  # the stats after a publish
    sinks.close()


def test_jsonl_write_errors_are_counted_not_raised(tmp_path, monkeypatch, caplog):
    import builtins
    import errno

    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.write({"a": 1})
    real_open = builtins.open

    def full(path, *a, **k):
        if str(path) == str(sink.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", full)
    with caplog.at_level("ERROR"):
        sink.write({"a": 2})
        sink.log({"b": 1}, step=3)
    monkeypatch.undo()
    assert sink.failed == 2 and "No space left" in caplog.text
    sink.write({"a": 3})
    assert [json.loads(x)["a"] for x in sink.path.read_text().splitlines()] == [1, 3]


def test_a_jsonl_file_with_a_cap_is_bounded_whatever_arrives(tmp_path):
    """A flood of signed step reports grew monitor.jsonl without bound (+3.46 MB per 200); with a cap it moves
    to <name>.1 and starts anew: the two files stay under about twice the cap, the newest rows kept."""
    from draft_align.monitor.sinks import JsonlSink

    path = tmp_path / "monitor.jsonl"
    sink = JsonlSink(path, max_bytes=20_000)
    for i in range(2_000):
        sink.write({"step": i, "pad": "x" * 180})
    assert path.stat().st_size <= 20_000 and (tmp_path / "monitor.jsonl.1").stat().st_size <= 20_000
    assert sink.rotations >= 15 and sink.failed == 0
    last = path.read_text().splitlines()[-1]
    assert '"step": 1999' in last
