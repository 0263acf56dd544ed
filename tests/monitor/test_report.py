import json
import math
import statistics
import struct

import pytest

from draft_align.monitor.report import (
    Z95,
    figure,
    load_steps,
    measured_interval,
    series,
    summarize,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

ADAPTED = [2.00, 2.00, 2.01, 2.10, 2.20, 2.30]
FROZEN = [2.00, 1.99, 1.98, 1.90, 1.90, 1.80]  # step 2: adapted − frozen = 0.03 > 0.02 first
EST_ADAPTED = [1.9, None, 2.0, float("nan"), 2.1, 2.4]  # missing and non-finite values are skipped
EST_FROZEN = [1.9, 1.9, 1.9, 1.8, 1.8, 1.7]
STALENESS = [0, 1, 1, 2, 0, 1]
PUBLISHED = [0, 1, 1, 2, 3, 3]


def synthetic_records() -> list[dict]:
    recs = []
    for s in range(6):
        recs.append(
            {
                "time": 1.7e9 + s,
                "step": s,
                "policy_version": s,
                "draft_version": PUBLISHED[s],
                "reward_mean": 0.1 * s,
                "kl_to_initial": 0.002 * s * s,
                "accept_measured_adapted": ADAPTED[s],
                "accept_measured_frozen": FROZEN[s],
                "accept_est_adapted": EST_ADAPTED[s],
                "accept_est_frozen": EST_FROZEN[s],
                "staleness": STALENESS[s],
                "published_versions": PUBLISHED[s],
                "wire_dropped": 2 * s,
                "wire_rejected": 1 if s >= 3 else 0,
                "buffer_fill": 0.1 * s,
                # the first steps served by drafts trained on a new version carry the lags
                **(
                    {"draft_tap_to_serve_s": 10.0 * s, "draft_serve_lag_s": 10.0 * s + 5}
                    if s in (1, 2, 4)
                    else {}
                ),
            }
        )
    return recs


def write_log(path, records, tail: str = ""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run1"
    recs = synthetic_records()
    # Out of order, one step reported in two pieces (the second adds the KL without erasing the rest),
    # a record with no step, and a half-written last line.
    kl5 = recs[5].pop("kl_to_initial")
    recs = [recs[i] for i in (0, 2, 1, 3, 5, 4)] + [{"step": 5, "kl_to_initial": kl5, "reward_mean": None}]
    recs.insert(3, {"time": 1.0, "note": "no step"})
    write_log(run / "sidecar" / "monitor.jsonl", recs, tail='{"step": 6, "accept_me')
    return run


def test_load_steps_merges_and_sorts(run_dir):
    recs = load_steps(run_dir / "sidecar" / "monitor.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4, 5]
    assert recs[5]["kl_to_initial"] == pytest.approx(0.05) and recs[5]["reward_mean"] == pytest.approx(0.5)
    assert series(recs, "accept_est_adapted") == ([0, 2, 4, 5], [1.9, 2.0, 2.1, 2.4])


def test_report_summary_numbers(run_dir):
    s = write_report(run_dir)
    assert s["steps"] == 6 and (s["first_step"], s["last_step"]) == (0, 5)
    assert s["last_half_from_step"] == 3
    assert s["final_kl"] == pytest.approx(0.05)
    assert s["final_reward"] == pytest.approx(0.5)
    assert s["accept_adapted"] == pytest.approx((2.1 + 2.2 + 2.3) / 3)
    assert s["accept_frozen"] == pytest.approx((1.9 + 1.9 + 1.8) / 3)
    assert s["accept_margin"] == pytest.approx(2.2 - 5.6 / 3)  # 0.3333
    assert s["first_step_adapted_ahead"] == 2
    assert s["accept_est_adapted"] == pytest.approx((2.1 + 2.4) / 2)  # NaN at step 3 is skipped
    assert s["accept_est_frozen"] == pytest.approx((1.8 + 1.8 + 1.7) / 3)
    assert s["accept_est_margin"] == pytest.approx(2.25 - 5.3 / 3)
    assert s["published_versions"] == 3
    assert s["staleness_mean"] == pytest.approx(5 / 6) and s["staleness_max"] == 2
    assert s["staleness_median"] == statistics.median(STALENESS)
    assert s["tap_to_serve_s_median"] == 20.0 and s["serve_lag_s_median"] == 25.0
    assert s["sidecar_busy_frac_median"] is None  # no row carried it
    assert s["tap_dropped_messages"] == 10 and s["wire_rejected"] == 1 and s["gate_rejections"] is None


def test_report_png_and_markdown(run_dir):
    s = write_report(run_dir)
    png = run_dir / "report.png"
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (800, 900)
    assert len(data) > 20_000  # three panels with lines and text, not a blank canvas
    assert s["png"] == str(png)
    md = (run_dir / "report.md").read_text()
    assert "# Co-training report: run1" in md
    assert "margin 0.333" in md and "adapted 2.200 vs frozen 1.867" in md
    assert "more than 0.02: 2" in md and "published draft versions: 3" in md
    assert "![acceptance and KL vs step](report.png)" in md
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| step")]
    assert len(table) == 6
    assert table[3].split("|")[1:4] == [" 3 ", " 3 ", " 2 "]  # step, policy version, draft version
    assert "–" in table[1]  # the missing estimate at step 1
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "report.md",
        "report.png",
        "sidecar",
    ]  # no temp files


def test_report_falls_back_to_rl_log_and_custom_png(tmp_path):
    run = tmp_path / "run2"
    keep = ("step", "reward_mean", "kl_to_initial", "accept_measured_adapted", "accept_measured_frozen")
    write_log(run / "rl" / "steps.jsonl", [{k: r[k] for k in keep} for r in synthetic_records()[:4]])
    out_png = tmp_path / "elsewhere" / "plot.png"
    s = write_report(run, out_png=out_png)
    assert s["source"] == str(run / "rl" / "steps.jsonl")
    assert s["steps"] == 4 and s["final_kl"] == pytest.approx(0.018)
    assert s["accept_margin"] == pytest.approx((2.01 + 2.10) / 2 - (1.98 + 1.90) / 2)
    assert s["accept_est_margin"] is None and s["published_versions"] is None and s["staleness_max"] is None
    assert out_png.read_bytes()[:8] == PNG_SIGNATURE
    assert not (run / "report.png").exists()
    assert "](../elsewhere/plot.png)" in (run / "report.md").read_text()


def test_report_without_any_log_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"neither .*monitor\.jsonl nor .*steps\.jsonl exists"):
        write_report(tmp_path)


def test_report_on_empty_log_is_a_value_error(tmp_path):
    write_log(tmp_path / "sidecar" / "monitor.jsonl", [{"note": "no step"}], tail="{")
    with pytest.raises(ValueError, match="holds no step records"):
        write_report(tmp_path)


def test_summarize_with_no_acceptance_and_single_step():
    s = summarize([{"step": 7, "kl_to_initial": math.inf}])
    assert s["steps"] == 1 and s["last_half_from_step"] == 7
    assert s["final_kl"] is None and s["accept_margin"] is None and s["first_step_adapted_ahead"] is None
    with pytest.raises(ValueError, match="no step records"):
        summarize([])


def with_rounds(rec: dict, kind: str, counts: list[int], k: int = 3) -> dict:
    """``rec`` plus the step's measured tally for ``kind`` as the RL job logs it (rounds, r_i, mean length)."""
    from draft_align.acceptance import AcceptanceTally

    t = AcceptanceTally.empty(k)
    for n in counts:
        t.add(n)
    rec = dict(rec, **{f"accept_rounds_{kind}": t.rounds, f"accept_measured_{kind}": t.mean_length()})
    rec.update({f"accept_r{i}_{kind}": r for i, r in enumerate(t.per_position())})
    return rec


def test_measured_interval_from_the_steps_rounds():
    counts = [0, 1, 3, 2, 3, 1, 0, 2]
    rec = with_rounds({"step": 0}, "adapted", counts)
    mean = sum(counts) / len(counts)
    sd = math.sqrt(sum((n - mean) ** 2 for n in counts) / len(counts))
    assert measured_interval(rec, "adapted") == pytest.approx(Z95 * sd / math.sqrt(len(counts)))
    assert measured_interval(rec, "frozen") is None  # no tally logged for it
    assert measured_interval(with_rounds({"step": 0}, "frozen", [2]), "frozen") is None  # one round


def test_report_figure_shows_intervals_and_the_serving_draft_version():
    recs = synthetic_records()
    few, many = [0, 3, 1, 3], [0, 3, 1, 3] * 16  # the same spread over 4 and 64 rounds
    recs = [with_rounds(r, "adapted", few if r["step"] < 3 else many) for r in recs]
    recs = [dict(r, sidecar_draft_version=r["draft_version"] + 1) for r in recs]
    fig = figure(recs)
    ax_acc, ax_ver, _, _ = fig.axes  # acceptance, draft versions, KL (+ its reward twin)
    bars = [c for c in ax_acc.containers if c.get_label().startswith("measured, adapted")]
    assert len(bars) == 1 and "95%" in bars[0].get_label()
    _, _, (segments,) = bars[0].lines
    half = [(seg[1][1] - seg[0][1]) / 2 for seg in segments.get_segments()]
    assert half[0] == pytest.approx(measured_interval(recs[0], "adapted"))
    assert half[0] == pytest.approx(4 * half[5])  # 16× the rounds: a quarter of the width
    frozen = [c for c in ax_acc.containers if c.get_label().startswith("measured, frozen")]
    assert len(frozen) == 1 and "95%" not in frozen[0].get_label()  # no rounds logged: no error bars
    serving = {line.get_label(): list(line.get_ydata()) for line in ax_ver.lines}
    assert serving["serving the adapted rollouts"] == PUBLISHED
    assert serving["newest published (sidecar)"] == [v + 1 for v in PUBLISHED]
