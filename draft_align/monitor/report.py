"""End-of-run report of a co-training run: ``report.png`` (three panels: acceptance with the measured points'
intervals, the serving draft version, KL and reward) and ``report.md`` (summary + table).

Reads ``<run>/sidecar/monitor.jsonl``, or ``<run>/rl/steps.jsonl`` when the sidecar log is absent.  Records
of the same step are merged (later non-null values win) and sorted by step; missing, null or non-finite
values are left out of plots and means, never counted as zero.

Summary (``write_report``'s return value), with the *last half* = the last ⌈n/2⌉ of the n steps:

    accept_adapted = mean of accept_measured_adapted over the last half (steps that have it)
    accept_frozen  = mean of accept_measured_frozen  over the last half
    accept_margin  = accept_adapted − accept_frozen
    first_step_adapted_ahead = first step with accept_measured_adapted − accept_measured_frozen > 0.02
                               (among steps served by a published draft, draft_version > 0)

and the same three for the estimates (``accept_est_*``).  Drops, rejections and published versions are
cumulative counters in the log: their totals are the last reported values.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from draft_align.acceptance import length_stderr
from draft_align.monitor.live import COLUMNS, DROP_KEYS, MONITOR_LOG, RL_LOG, iter_jsonl, number
from draft_align.monitor.step_profile import LABELS, OTHER, STAGES, StepProfile

logger = logging.getLogger(__name__)

REPORT_MD = "report.md"  # the run folder's report (beside report.png)
AHEAD_THRESHOLD = 0.02  # mean acceptance length: "adapted ahead of frozen" once the gap exceeds this


def find_log(run_dir: str | os.PathLike[str]) -> Path:
    """``sidecar/monitor.jsonl`` if present, else ``rl/steps.jsonl``; FileNotFoundError if neither exists."""
    run = Path(run_dir)
    for rel in (MONITOR_LOG, RL_LOG):
        if (run / rel).is_file():
            return run / rel
    raise FileNotFoundError(f"no step log in {run}: neither {run / MONITOR_LOG} nor {run / RL_LOG} exists")


def load_steps(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of a step log merged per step (later non-null values win), sorted by step.  The file is
    streamed (memory: the merged records, not the file); bad lines are skipped and counted in one warning
    (monitor/live.py :func:`iter_jsonl`), records without a ``step`` in another.
    """
    by_step: dict[int, dict[str, Any]] = {}
    skipped = 0
    for rec in iter_jsonl(path):
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, int | float) or not float(step).is_integer():
            skipped += 1
            continue
        merged = by_step.setdefault(int(step), {})
        merged.update({k: v for k, v in rec.items() if v is not None})
        merged["step"] = int(step)
    if skipped:
        logger.warning("%s: skipped %d record(s) without an integer step", path, skipped)
    return [by_step[s] for s in sorted(by_step)]


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where ``key`` holds a finite number."""
    xs, ys = [], []
    for r in records:
        v = number(r.get(key))
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _last(records: Sequence[dict[str, Any]], key: str) -> float | None:
    _, ys = series(records, key)
    return ys[-1] if ys else None


def _last_of(records: Sequence[dict[str, Any]], keys: Sequence[str]) -> float | None:
    """The last value of the first of ``keys`` the records hold."""
    return next((v for v in (_last(records, k) for k in keys) if v is not None), None)


def _first_ahead(records: Sequence[dict[str, Any]], adapted: str, frozen: str) -> int | None:
    """First step where the adapted draft leads by more than the threshold; steps still served by the
    starting draft (``draft_version`` 0: adapted and frozen are the same draft there) do not count."""
    for r in records:
        if number(r.get("draft_version")) == 0:
            continue
        a, f = number(r.get(adapted)), number(r.get(frozen))
        if a is not None and f is not None and a - f > AHEAD_THRESHOLD:
            return r["step"]
    return None


def _acceptance_summary(records: Sequence[dict[str, Any]], adapted: str, frozen: str) -> dict[str, Any]:
    half = records[len(records) // 2 :]
    a = _mean(series(half, adapted)[1])
    f = _mean(series(half, frozen)[1])
    return {
        "adapted": a,
        "frozen": f,
        "margin": a - f if a is not None and f is not None else None,
        "first_step_ahead": _first_ahead(records, adapted, frozen),
    }


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The report's numbers from merged, step-sorted records (see the module docstring)."""
    if not records:
        raise ValueError("no step records to summarize")
    meas = _acceptance_summary(records, "accept_measured_adapted", "accept_measured_frozen")
    est = _acceptance_summary(records, "accept_est_adapted", "accept_est_frozen")
    _, stale = series(records, "staleness")
    published = _last(records, "published_versions")
    return {
        "steps": len(records),
        "first_step": records[0]["step"],
        "last_step": records[-1]["step"],
        "final_kl": _last(records, "kl_to_initial"),
        "final_reward": _last(records, "reward_mean"),
        "last_half_from_step": records[len(records) // 2]["step"],
        "accept_adapted": meas["adapted"],
        "accept_frozen": meas["frozen"],
        "accept_margin": meas["margin"],
        "first_step_adapted_ahead": meas["first_step_ahead"],
        "accept_est_adapted": est["adapted"],
        "accept_est_frozen": est["frozen"],
        "accept_est_margin": est["margin"],
        "published_versions": None if published is None else int(published),
        "staleness_mean": _mean(stale),
        "staleness_median": statistics.median(stale) if stale else None,
        "staleness_max": max(stale) if stale else None,
        "tap_to_serve_s_median": _median_of(records, "draft_tap_to_serve_s"),
        "serve_lag_s_median": _median_of(records, "draft_serve_lag_s"),
        "sidecar_busy_frac_median": _median_of(records, "sidecar_busy_frac"),
        "tap_dropped_messages": _int_or_none(_last_of(records, DROP_KEYS)),
        "wire_rejected": _int_or_none(_last(records, "wire_rejected")),
        "gate_rejections": _int_or_none(_last(records, "gate_rejections")),
    }


def _median_of(records: Sequence[dict[str, Any]], key: str) -> float | None:
    _, xs = series(records, key)
    return statistics.median(xs) if xs else None


def _int_or_none(v: float | None) -> int | None:
    return None if v is None else int(v)


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temp file beside ``path``, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


Z95 = 1.96  # the measured points' error bars: ±1.96 standard errors (length_stderr), about 95%


def measured_interval(record: dict[str, Any], kind: str) -> float | None:
    """Half-width of the ~95% interval of a step's measured acceptance length of draft ``kind``
    (``adapted``/``frozen``), from the step's rounds and per-position rates (``accept_rounds_<kind>``,
    ``accept_r<i>_<kind>``); None when the record lacks them."""
    rounds = number(record.get(f"accept_rounds_{kind}"))
    rates = []
    while (r := number(record.get(f"accept_r{len(rates)}_{kind}"))) is not None:
        rates.append(r)
    if rounds is None or not rates:
        return None
    se = length_stderr(rounds, rates)
    return Z95 * se if math.isfinite(se) else None


def plot(records: Sequence[dict[str, Any]], out_png: Path, title: str = "") -> None:
    """:func:`figure` written atomically as PNG."""
    fig = figure(records, title)
    _atomic_write(out_png, lambda tmp: fig.savefig(tmp, format="png"))


def figure(records: Sequence[dict[str, Any]], title: str = "") -> Any:
    """Three panels against RL step: acceptance lengths (measured solid with ~95% error bars over the step's
    rounds, estimated dashed); the draft version that served the adapted rollouts (and the sidecar's newest
    published one); KL-to-initial (left axis) with mean reward (right axis).  A matplotlib Figure (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg, without touching pyplot's state
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8.0, 9.0), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_acc, ax_ver, ax_kl = fig.subplots(3, 1, sharex=True, height_ratios=(3, 1.2, 2))
    for kind, label, color, marker in (
        ("adapted", "measured, adapted draft", "C0", "o"),
        ("frozen", "measured, frozen draft", "C1", "s"),
    ):
        key = f"accept_measured_{kind}"
        xs, ys = series(records, key)
        if xs:
            by_step = {r["step"]: r for r in records}
            err = [measured_interval(by_step[x], kind) for x in xs]
            yerr = [e if e is not None else 0.0 for e in err] if any(e is not None for e in err) else None
            ax_acc.errorbar(
                xs,
                ys,
                yerr=yerr,
                label=label + (" (±95%, rounds)" if yerr else ""),
                color=color,
                marker=marker,
                markersize=4,
                linestyle="-",
                capsize=3,
                elinewidth=0.8,
            )
    est_lines = (
        ("accept_est_adapted", "estimated, adapted draft", "C0", "--"),
        ("accept_est_frozen", "estimated, frozen draft", "C1", "--"),
        ("accept_est_adapted_prob", "estimated (prob.), adapted", "C0", ":"),
        ("accept_est_frozen_prob", "estimated (prob.), frozen", "C1", ":"),
    )
    for key, label, color, style in est_lines:
        xs, ys = series(records, key)
        if xs:
            ax_acc.plot(xs, ys, label=label, color=color, linestyle=style)
    ax_acc.set_ylabel("mean acceptance length")
    ax_acc.set_title(title or "acceptance length vs RL step")
    ax_acc.grid(alpha=0.3)
    if ax_acc.lines or ax_acc.containers:
        ax_acc.legend(fontsize=8)
    else:
        ax_acc.text(0.5, 0.5, "no acceptance data", ha="center", va="center", transform=ax_acc.transAxes)

    for key, label, color, style in (
        ("draft_version", "serving the adapted rollouts", "C0", "-"),
        ("sidecar_draft_version", "newest published (sidecar)", "C7", ":"),
    ):
        xs, ys = series(records, key)
        if xs:
            ax_ver.step(xs, ys, where="mid", color=color, linestyle=style, marker=".", label=label)
    ax_ver.set_ylabel("draft version")
    ax_ver.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_ver.grid(alpha=0.3)
    if ax_ver.lines:
        ax_ver.legend(fontsize=8, loc="upper left")

    handles = []
    xs, ys = series(records, "kl_to_initial")
    if xs:
        handles += ax_kl.plot(xs, ys, color="C2", marker=".", label="KL to initial policy")
    ax_kl.set_ylabel("KL to initial")
    ax_kl.set_xlabel("RL step")
    ax_kl.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_kl.grid(alpha=0.3)
    xs, ys = series(records, "reward_mean")
    if xs:
        ax_r = ax_kl.twinx()
        handles += ax_r.plot(xs, ys, color="C3", marker=".", label="mean reward")
        ax_r.set_ylabel("mean reward")
    if handles:
        ax_kl.legend(handles=handles, fontsize=8, loc="best")
    return fig


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def stage_section(records: Sequence[dict[str, Any]]) -> list[str]:
    """``## Step profile``: each step's seconds and share per stage (:mod:`.step_profile`), and their mean over
    every step but the first (engine warm-up); no lines when no step logged ``step_s``."""
    rows = [(r, p) for r in records if (p := StepProfile.from_metrics(r)) is not None]
    if not rows:
        return []
    mean = StepProfile.mean([p for _, p in (rows[1:] if len(rows) > 1 else rows)])
    stages = (*STAGES, OTHER)
    lines = [
        "## Step profile (seconds and share of the step, measured)",
        "",
        "Stages as NeMo RL reports a GRPO step, plus draft refresh and the Tap; other = the step's time no "
        "timer covers. Mean over "
        + (f"steps {rows[1][0].get('step')}–{rows[-1][0].get('step')}" if len(rows) > 1 else "the step")
        + ".",
        "",
        "| stage | mean s / step | mean share |",
        "|---|---:|---:|",
    ]
    for st in stages:
        share = mean.share(st)
        lines.append(
            f"| {LABELS[st]} | {mean.stage_s(st):.3f} | {'–' if share is None else f'{100 * share:.1f}%'} |"
        )
    lines += [f"| **step** | **{mean.step_s:.3f}** | 100% |", ""]
    lines.append("| step | " + " | ".join(st.replace("_", " ") for st in stages) + " | step s |")
    lines.append("|" + "|".join("---:" for _ in range(len(stages) + 2)) + "|")
    for r, p in rows:
        cells = []
        for st in stages:
            share = p.share(st)
            cells.append(f"{p.stage_s(st):.2f} ({'–' if share is None else f'{100 * share:.0f}%'})")
        lines.append(f"| {r.get('step')} | " + " | ".join(cells) + f" | {p.step_s:.2f} |")
    return lines + [""]


def markdown(
    records: Sequence[dict[str, Any]], summary: dict[str, Any], run_name: str, source: Path, png: str | None
) -> str:
    """The report's markdown: summary list, the figure (``png``: its path relative to the .md), a step table."""
    s = summary
    lines = [
        f"# Co-training report: {run_name}",
        "",
        f"Source: `{source}`",
        "",
        "## Summary",
        "",
        f"- steps: {s['steps']} (step {s['first_step']} to {s['last_step']})",
        f"- final KL to initial policy: {_fmt(s['final_kl'], 4)}; final mean reward: {_fmt(s['final_reward'])}",
        f"- mean measured acceptance length over the last half (from step {s['last_half_from_step']}): "
        f"adapted {_fmt(s['accept_adapted'])} vs frozen {_fmt(s['accept_frozen'])}, "
        f"margin {_fmt(s['accept_margin'])}",
        f"- estimated, same window: adapted {_fmt(s['accept_est_adapted'])} vs frozen "
        f"{_fmt(s['accept_est_frozen'])}, margin {_fmt(s['accept_est_margin'])}",
        f"- first step where adapted exceeds frozen by more than {AHEAD_THRESHOLD}: "
        f"{_fmt(s['first_step_adapted_ahead'])}",
        f"- published draft versions: {_fmt(s['published_versions'])}; gate rejections: "
        f"{_fmt(s['gate_rejections'])}",
        f"- staleness (policy versions): mean {_fmt(s['staleness_mean'], 2)}, median "
        f"{_fmt(s['staleness_median'], 1)}, max {_fmt(s['staleness_max'], 0)}; a new policy version's taps → a "
        f"draft trained on it served: median {_fmt(s['tap_to_serve_s_median'], 1)} s (from its update "
        f"{_fmt(s['serve_lag_s_median'], 1)} s); sidecar busy (optimizer steps) median "
        f"{_fmt(s['sidecar_busy_frac_median'], 2)} of its time",
        f"- tap drops: {_fmt(s['tap_dropped_messages'])}; wire rejections: {_fmt(s['wire_rejected'])}",
        "",
    ]
    if png is not None:
        lines += [f"![acceptance and KL vs step]({png})", ""]
    lines += stage_section(records)
    lines += ["## Steps", ""]
    lines.append("| " + " | ".join(c.title for c in COLUMNS) + " |")
    lines.append("|" + "|".join("---:" for _ in COLUMNS) + "|")
    for r in records:
        cells = []
        for c in COLUMNS:
            v = c.value(r)
            cells.append("–" if v is None else c.fmt(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(
    run_dir: str | os.PathLike[str], out_png: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """Write ``report.png`` (default ``<run_dir>/report.png``) and ``<run_dir>/report.md``; return the summary.

    FileNotFoundError when the run has neither log; ValueError when its log holds no step records.
    """
    run = Path(run_dir)
    source = find_log(run)
    records = load_steps(source)
    if not records:
        raise ValueError(f"{source} holds no step records")
    summary = summarize(records)
    png = Path(out_png) if out_png is not None else run / "report.png"
    name = run.resolve().name
    plot(records, png, title=f"{name}: acceptance length vs RL step")
    md_path = run / REPORT_MD
    png_ref = os.path.relpath(png.resolve(), md_path.parent.resolve())
    text = markdown(records, summary, name, source, png_ref)
    _atomic_write(md_path, lambda tmp: tmp.write_text(text))
    summary.update(source=str(source), png=str(png), markdown=str(md_path))
    logger.info("report: %s, %s", png, md_path)
    return summary
