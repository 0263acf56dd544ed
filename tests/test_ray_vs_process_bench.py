"""benchmarks/ray_vs_process.py's summary: medians per mode, Ray / process ratios, the RESULTS.md section it
writes is indexed (no Ray or sidecar is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import ray_vs_process as rvp


def _trials() -> list[rvp.Trial]:
    t = rvp.Trial
    return [
        t(
            "process",
            0,
            startup_s=10.0,
            sidecar_rss_mib=1000.0,
            ingest_tokens_per_s=3000.0,
            kill_to_publish_s=20,
        ),
        t(
            "process",
            1,
            startup_s=14.0,
            sidecar_rss_mib=1100.0,
            ingest_tokens_per_s=None,
            kill_to_publish_s=30,
        ),
        t("process", 2, startup_s=12.0, sidecar_rss_mib=1200.0, ingest_tokens_per_s=5000.0, error="x"),
        t("ray", 0, startup_s=18.0, sidecar_rss_mib=1300.0, ray_rss_mib=700.0, ingest_tokens_per_s=2000.0),
        t("ray", 1, startup_s=24.0, sidecar_rss_mib=1100.0, ray_rss_mib=900.0, kill_to_publish_s=50),
    ]


def test_medians_ratios_and_missing_figures() -> None:
    s = rvp.summarize(_trials())
    assert s["startup_s"]["median_process"] == 12.0 and s["startup_s"]["median_ray"] == 21.0
    assert s["startup_s"]["ratio_ray_over_process"] == pytest.approx(1.75)
    # a None figure is left out of its median, not counted as 0
    assert s["ingest_tokens_per_s"]["median_process"] == 4000.0 and s["ingest_tokens_per_s"]["n_process"] == 2
    assert s["ingest_tokens_per_s"]["ratio_ray_over_process"] == pytest.approx(0.5)
    # total memory: the sidecar plus Ray's own processes (none in process mode)
    assert s["total_rss_mib"]["median_process"] == 1100.0
    assert s["total_rss_mib"]["median_ray"] == pytest.approx(2000.0)
    # only one mode measured it: no ratio
    assert s["ray_rss_mib"]["median_process"] is None and s["ray_rss_mib"]["ratio_ray_over_process"] is None
    assert s["kill_to_publish_s"]["ratio_ray_over_process"] == pytest.approx(2.0)


def test_section_names_failed_trials_and_is_indexed_in_results_md() -> None:
    trials = _trials()
    r = {
        "command": "python benchmarks/ray_vs_process.py --repeats 3",
        "date": "2026-12-03",
        "draft": "checkpoints/smollm2-demo",
        "repeats": 3,
        "tokens_per_batch": 1024,
        "batches_per_step": 4,
        "warm_s": 10.0,
        "feed_s": 40.0,
        "step_s": 1.0,
        "summary": rvp.summarize(trials),
        "trials": [rvp.asdict(t) for t in trials],
    }
    md = rvp.markdown(r)
    assert md.startswith(rvp.SECTION + "\n")
    assert (
        "| start-up to ready (spawn / actor creation → sockets bound) (s; lower is better) | 12.00 | 21.00 | 1.75× |"
        in md
    )
    assert "Trials that failed: process #2: x." in md
    results = (Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md").read_text()
    head = rvp.SECTION.removeprefix("## ")
    preamble = results.partition("\n## ")[0]
    assert any(f"[{head}](#" in ln and "`make bench-ray-vs-process`" in ln for ln in preamble.splitlines())
