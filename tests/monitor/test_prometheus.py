import math
import threading
import urllib.error
import urllib.request

import pytest

from draft_align.monitor.live import parse_metrics, scrape
from draft_align.monitor.prometheus import (
    CONTENT_TYPE,
    PromExporter,
    read_port_file,
    write_port_file,
)


@pytest.fixture
def exporter():
    with PromExporter() as e:
        yield e


def test_render_exact_page(exporter):
    exporter.set_gauge("da_fill", 0.25, help="buffer fill\nline two \\ end")
    exporter.inc_counter("da_rejected_total", 2, help="rejected", labels={"reason": "mac"})
    exporter.inc_counter("da_rejected_total", labels={"reason": "mac"})
    exporter.set_gauge("da_accept", 2.5, labels={"draft": "adapted", "mode": "greedy"})
    assert exporter.render() == (
        "# TYPE da_accept gauge\n"
        'da_accept{draft="adapted",mode="greedy"} 2.5\n'
        "# HELP da_fill buffer fill\\nline two \\\\ end\n"
        "# TYPE da_fill gauge\n"
        "da_fill 0.25\n"
        "# HELP da_rejected_total rejected\n"
        "# TYPE da_rejected_total counter\n"
        'da_rejected_total{reason="mac"} 3\n'
    )


def test_scrape_round_trip_with_escaped_labels_nan_inf_and_none(exporter):
    nasty = 'a "quoted" \\ back\nslash, {braces} = x'
    exporter.set_gauge("da_step", 17, help="RL step")
    exporter.set_gauge("da_kl", 0.0123)
    exporter.set_gauge("da_nan", float("nan"))
    exporter.set_gauge("da_inf", float("-inf"))
    exporter.set_gauge("da_gone", 1.0)
    exporter.set_gauge("da_gone", None)  # a gauge set to None has no sample
    exporter.set_gauge("da_lab", 4.0, labels={"name": nasty, "b": "2"})
    exporter.set_counter("da_tokens_total", 1e6)
    got = scrape(exporter.url)
    lab = 'da_lab{b="2",name="a \\"quoted\\" \\\\ back\\nslash, {braces} = x"}'  # sorted labels, escaped
    assert set(got) == {"da_step", "da_kl", "da_nan", "da_inf", lab, "da_tokens_total"}
    assert got["da_step"] == 17.0 and got["da_kl"] == 0.0123 and got["da_tokens_total"] == 1e6
    assert got[lab] == 4.0
    assert math.isnan(got["da_nan"]) and got["da_inf"] == -math.inf
    page = exporter.render()
    assert "\nda_nan NaN\n" in page and "\nda_inf -Inf\n" in page
    assert "# TYPE da_gone gauge\n# TYPE da_inf" in page  # the family stays, without a sample


def test_http_content_type_and_404(exporter):
    exporter.set_gauge("x", 1)
    with urllib.request.urlopen(exporter.url, timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == CONTENT_TYPE
        assert r.read() == b"# TYPE x gauge\nx 1\n"
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/other", timeout=5)
    assert ei.value.code == 404


@pytest.mark.parametrize("name", ["", "1abc", "a-b", "a b", "é", "a{b}"])
def test_invalid_metric_names_rejected(exporter, name):
    with pytest.raises(ValueError, match="invalid Prometheus metric name"):
        exporter.set_gauge(name, 1.0)
    with pytest.raises(ValueError, match="invalid Prometheus metric name"):
        exporter.inc_counter(name)


@pytest.mark.parametrize("label", ["__reserved", "a-b", "1a", "a:b", ""])
def test_invalid_label_names_rejected(exporter, label):
    with pytest.raises(ValueError, match="invalid Prometheus label name"):
        exporter.set_gauge("ok_name", 1.0, labels={label: "v"})


def test_valid_names_accepted(exporter):
    exporter.set_gauge("a:b_c9", 1.0, labels={"_x": "y"})
    assert parse_metrics(exporter.render()) == {'a:b_c9{_x="y"}': 1.0}


def test_non_numeric_value_is_a_type_error(exporter):
    with pytest.raises(TypeError, match="real number"):
        exporter.set_gauge("g", "3")
    with pytest.raises(TypeError, match="real number"):
        exporter.inc_counter("c", "1")


def test_counter_is_monotone(exporter):
    assert exporter.inc_counter("c_total") == 1.0
    assert exporter.inc_counter("c_total", 2.5) == 3.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="increment must be finite and >= 0"):
            exporter.inc_counter("c_total", bad)
    exporter.set_counter("c_total", 10)
    exporter.set_counter("c_total", 10)  # equal is fine
    with pytest.raises(ValueError, match="went down from 10.0 to 9.0"):
        exporter.set_counter("c_total", 9)
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        exporter.set_counter("d_total", -1)
    exporter.set_counter("c_total", None)  # None changes nothing
    assert exporter.inc_counter("c_total", 1) == 11.0
    assert parse_metrics(exporter.render())["c_total"] == 11.0


def test_kind_conflict_rejected(exporter):
    exporter.set_gauge("m", 1.0)
    with pytest.raises(ValueError, match="is a gauge, cannot use it as a counter"):
        exporter.inc_counter("m")


def test_concurrent_increments_are_not_lost(exporter):
    def work():
        for _ in range(500):
            exporter.inc_counter("n_total", labels={"k": "v"})

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    seen = [scrape(exporter.url).get('n_total{k="v"}', 0.0) for _ in range(10)]  # pages served mid-update
    assert seen == sorted(seen)
    for t in threads:
        t.join()
    assert scrape(exporter.url)['n_total{k="v"}'] == 2000.0


def test_close_releases_port_and_is_idempotent():
    e = PromExporter()
    url = e.url
    e.close()
    e.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_port_file_round_trip_atomic(tmp_path, exporter):
    p = exporter.write_port_file(tmp_path / "sidecar" / "prometheus.port")
    assert p.read_text() == f"{exporter.port}\n"
    assert read_port_file(p) == exporter.port
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


@pytest.mark.parametrize(
    "line, match",
    [
        ("1x 2", "no metric name"),
        ("x", "expected 'name"),
        ("x 1 2 3", "expected 'name"),
        ("x abc", "bad sample value"),
        ('x{a="1" 2', "expected ',' or '}'"),
        ('x{a="1', "unterminated label value"),
        ('x{a="\\t"} 1', "bad escape"),
        ("x{a=1} 1", "bad label"),
        ('x{a="1"}2', "expected 'name"),
    ],
)
def test_parse_metrics_rejects_malformed(line, match):
    with pytest.raises(ValueError, match=match):
        parse_metrics("# ok\n" + line + "\n")
