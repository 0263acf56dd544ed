"""``draft-align advise``'s text: :func:`format_advice` (markdown, also readable in a terminal) and the
section it puts into a run's ``report.md`` (:func:`add_to_report`).  The numbers come from
:func:`~draft_align.monitor.advise.advise_run`; every one printed carries its label, *measured* or *projected*."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from draft_align.monitor.advise import SECTION_HEAD, Advice, advise_run, speedup_text
from draft_align.monitor.projection import Labelled
from draft_align.monitor.report import REPORT_MD


def _n(v: float | None, digits: int = 3) -> str:
    return "–" if v is None or not math.isfinite(v) else f"{v:.{digits}f}"


def _lab(v: Labelled | None, digits: int = 3) -> str:
    return "–" if v is None else f"{v.value:.{digits}f} {v.label}"


def _steps(steps: Sequence[int]) -> str:
    if not steps:
        return "no steps"
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]} ({len(steps)})"


def format_advice(a: Advice, heading: str = "##") -> str:
    """The advice as markdown (also readable in a terminal): profile, acceptance, round cost, projection, advice."""
    st, p = a.settings, a.profile
    temp = "–" if st.temperature is None else f"{st.temperature:g}"
    h3 = heading + "#"
    out = [
        f"{heading} {SECTION_HEAD.removeprefix('## ')}",
        "",
        f"Run `{a.run}` (source `{a.source}`): rollouts by {st.engine}, k={st.k}, verify mode {st.verify_mode}, "
        f"T={temp}, {st.batch_size} request(s) per generate call of the serving draft.",
        "",
        f"{h3} Stage profile of the RL step (measured, mean over {_steps(p.steps)})",
        "",
        "| stage | s / step | share |",
        "|---|---:|---:|",
    ]
    for s in p.stages:
        share = s.seconds / p.step_s if p.step_s > 0 else math.nan
        out.append(f"| {s.name} | {_n(s.seconds)} measured | {_n(100 * share, 0)}% |")
    out.append(f"| **step** | **{_n(p.step_s)}** measured | 100% |")
    out += [
        "",
        f"{h3} Acceptance (measured; P_i = the probability that the first i drafts were all accepted)",
        "",
        "| draft | verify mode | source | steps | P_1..P_k | mean acceptance length | acceptance rate |",
        "|---|---|---|---|---|---:|---:|",
    ]
    for s in a.acceptance:
        out.append(
            f"| {s.draft} | {s.verify_mode} | {s.source} | {_steps(s.steps)} | "
            f"{', '.join(_n(r) for r in s.rates)} | {_n(s.mean_length)} measured | "
            f"{_n(100 * s.acceptance_rate, 1)}% measured |"
        )
    out += ["", f"{h3} Round cost (one speculative engine step ÷ one plain decode step, same batch size)", ""]
    if a.costs is None or a.cost_table is None:
        out.append("Not measured for this run (no `round_cost.json`): `draft-align advise RUN --calibrate`.")
    else:
        c = a.costs
        pts = ", ".join(f"c({k})={v:.3f} measured" for k, v in sorted(c.measured.items()))
        model = (
            f"c(k) = {c.a:.3f} + {c.b:.3f}·k (least squares through the measured points; other k projected)"
            if c.b is not None
            else "one measured k: the other k's cost is unknown"
        )
        out.append(
            f"Source: {a.cost_table.source}; batch size {c.batch_size}"
            + ("" if c.batch_size == st.batch_size else f" (nearest calibrated to the run's {st.batch_size})")
            + f". {pts}. {model}."
        )
        plain = a.cost_table.step_s(c.batch_size, 0)
        out.append(
            f"Plain decode step {_n(plain, 4)} s measured (calibration)"
            + (
                f"; the run's speculative generates: {_n(a.run_spec_step_s, 4)} s per engine step measured "
                "(prefill and the batch's tail included)"
                if a.run_spec_step_s is not None
                else ""
            )
            + "."
        )
    for proj in a.projections:
        s = proj.series
        out += [
            "",
            f"{h3} Projection: {s.draft} draft, {s.verify_mode} ({s.source}), batch size {proj.batch_size}",
            "",
            "| k | tokens / round | round cost | rollout speed-up vs plain | step speed-up vs plain | step s |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in proj.rows:
            out.append(
                f"| {r.k} | {_lab(r.tokens_per_round)} | {_lab(r.round_cost)} | {speedup_text(r.speedup)} | "
                f"{speedup_text(proj.step_speedup.get(r.k))} | {_lab(proj.step_s.get(r.k), 2)} |"
            )
        if proj.best is not None:
            out += ["", f"Best k = {proj.best.k} ({speedup_text(proj.best.speedup)})."]
    if a.plain_generation_s is not None:
        out += [
            "",
            f"Rates beyond k={a.serving.k} hold the last measured conditional rate (an upper bound); "
            f"speed-ups assume the batch stays at {a.projections[0].batch_size} requests and every rollout is "
            "decoded with the projected draft; the step speed-up is Amdahl's over the stage profile with "
            f"generation sped up alone. Generation without a draft: {_lab(a.plain_generation_s, 2)} s per step "
            f"({_n(p.generation_s, 2)} s measured with k={st.k}).",
        ]
    out += ["", f"{h3} Advice", "", *(f"- {line}" for line in a.lines), ""]
    return "\n".join(out)


def advice_section(run_dir: str | os.PathLike[str]) -> str:
    """``format_advice`` for report.md; a one-line note instead when the run cannot be advised on."""
    try:
        return format_advice(advise_run(run_dir))
    except (ValueError, OSError) as e:  # AdviseError, a malformed round_cost.json or recipe, a missing log
        return f"{SECTION_HEAD}\n\nNot available: {' '.join(str(e).split())}\n"


def add_to_report(run_dir: str | os.PathLike[str]) -> Path:
    """Put :func:`advice_section` at the end of ``<run_dir>/report.md`` (written by ``monitor.report``), in place
    of an earlier one."""
    md = Path(run_dir) / REPORT_MD
    text = md.read_text(encoding="utf-8")
    text = text.split("\n" + SECTION_HEAD)[0].rstrip("\n") + "\n\n" + advice_section(run_dir)
    tmp = md.with_name(f".{md.name}.advice.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, md)
    return md
