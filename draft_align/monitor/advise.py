"""``draft-align advise RUN``: what speculative decoding buys a co-training run, from the run's own logs.

Read from the run folder (``sidecar/monitor.jsonl``, else ``rl/steps.jsonl``; ``cotrain_recipe.yaml``;
``round_cost.json`` when a calibration wrote one):

- the **stage profile** of the RL step, measured: mean seconds and share per step over every step but the first
  (it warms the engine up) of data, weight sync, generation, log-prob, train, draft refresh, Tap, checkpoint and
  other (:mod:`.step_profile`);
- the **acceptance** of the serving (adapted) and frozen drafts, measured: cumulative per-position rates
  P_1..P_k pooled over the last half of the steps from the engine's counters (Σ_steps r_i·rounds / Σ rounds), in
  the run's verify mode; and, where the sidecar logged them, its estimates on the tapped data per verify mode
  (mean over the same steps), also measured: the estimator on real taps;
- the **round cost** c(k) of a speculative engine step relative to a plain one at the run's batch size (the
  rollouts of one draft kind per ``generate`` call), measured by a calibration (:mod:`.round_cost`);
- the **projection** (:mod:`.projection`): tokens per round, rollout speed-up and the best k for k = 1..7 per
  verify mode, and the whole step's speed-up by Amdahl over the stage profile;
- the **update cadence** (:mod:`.cadence`), when the run has a cadence table (``cadence.json``, measured by
  replaying its recorded taps): how often the sidecar should train and publish.

Every number printed carries its label: *measured* or *projected*.  The advice lines follow fixed rules:
an acceptance rate (accepted / proposed draft tokens) below :data:`LOW_ACCEPTANCE` asks for a larger or
in-domain draft; a chosen k beyond the best k says so; a best projected speed-up below 1 says to decode that
batch size without a draft, and at which calibrated batch size, if any, it pays.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_align.config import RESOLVED_RECIPE
from draft_align.conventions import AUTO_VERIFY_MODE, DRAFT_KINDS
from draft_align.monitor.cadence import CadenceError, Recommendation, load_table, recommend
from draft_align.monitor.live import number
from draft_align.monitor.projection import (
    K_MAX,
    PROJECTED,
    CostModel,
    KRow,
    Labelled,
    amdahl,
    best_k,
    project,
    tokens_per_round,
)
from draft_align.monitor.report import find_log, load_steps
from draft_align.monitor.round_cost import ROUND_COST_FILE, RoundCostTable
from draft_align.monitor.step_profile import LABELS, OTHER, STAGES, StepProfile

SECTION_HEAD = "## Speculative decoding: profile, projection, advice"
LOW_ACCEPTANCE = 0.60  # accepted / proposed draft tokens below this: a larger or in-domain draft
TAP_MODES = (("greedy_draft", ""), ("probabilistic", "_prob"))  # the sidecar's estimate key suffixes


class AdviseError(ValueError):
    """A run folder advise cannot read: missing, empty, or without the measurements it needs."""


# ------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Stage:
    name: str
    seconds: float  # mean per step, measured


@dataclass(frozen=True)
class StageProfile:
    """Mean seconds per RL step of each stage over ``steps`` (measured); stages sum to ``step_s``."""

    stages: tuple[Stage, ...]
    step_s: float
    steps: tuple[int, ...]
    generation_by_kind: Mapping[str, float]  # per draft kind, when the run logged ``generate_s_<kind>``

    @property
    def generation_s(self) -> float:
        return next(s.seconds for s in self.stages if s.name == LABELS["generation"])

    @property
    def rest_s(self) -> float:
        return max(self.step_s - self.generation_s, 0.0)


def _mean_of(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    vals = [v for r in records if (v := number(r.get(key))) is not None]
    return sum(vals) / len(vals) if vals else None


def stage_profile(records: Sequence[Mapping[str, Any]]) -> StageProfile:
    """The stage profile of ``records`` (merged, step-sorted), the first step left out when there are more:
    the mean of each step's :class:`~draft_align.monitor.step_profile.StepProfile` (its ``stage_*`` keys, or
    for older logs the same stages derived from their raw timers); ``other`` = ``step_s`` − the rest."""
    timed = [(r, p) for r in records if (p := StepProfile.from_metrics(r)) is not None]
    if not timed:
        raise AdviseError("no stage timings (step_s) in any step record")
    use = timed[1:] if len(timed) > 1 else timed
    mean = StepProfile.mean([p for _, p in use])
    rows = [r for r, _ in use]
    by_kind = {k: v for k in DRAFT_KINDS if (v := _mean_of(rows, f"generate_s_{k}")) is not None}
    stages = tuple(Stage(LABELS[s], mean.stage_s(s)) for s in (*STAGES, OTHER))
    return StageProfile(stages, mean.step_s, tuple(int(r["step"]) for r in rows), by_kind)


@dataclass(frozen=True)
class AcceptanceSeries:
    """Cumulative per-position acceptance P_1..P_k of one draft in one verify mode (measured)."""

    draft: str  # adapted | frozen
    verify_mode: str
    source: str  # "engine counters" | "estimator on taps"
    rates: tuple[float, ...]
    steps: tuple[int, ...]
    rounds: float | None = None  # pooled verification rounds (engine counters only)

    @property
    def k(self) -> int:
        return len(self.rates)

    @property
    def mean_length(self) -> float:
        return 1.0 + sum(self.rates)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens at this k: Σ_i P_i / k."""
        return sum(self.rates) / self.k


def _rate_keys(records: Sequence[Mapping[str, Any]], prefix: str, suffix: str) -> int:
    """How many consecutive ``{prefix}{i}{suffix}`` keys (i = 0, 1, …) the records hold."""
    k = 0
    while any(f"{prefix}{k}{suffix}" in r for r in records):
        k += 1
    return k


def counter_acceptance(records: Sequence[Mapping[str, Any]], kind: str, mode: str) -> AcceptanceSeries | None:
    """Engine counters of draft ``kind`` pooled over ``records``: P_i = Σ r_i·rounds / Σ rounds (None: no rounds)."""
    k = _rate_keys(records, "accept_r", f"_{kind}")
    if k == 0:
        return None
    num, rounds, steps = [0.0] * k, 0.0, []
    for r in records:
        n = number(r.get(f"accept_rounds_{kind}"))
        rates = [number(r.get(f"accept_r{i}_{kind}")) for i in range(k)]
        if n is None or n <= 0 or any(x is None for x in rates):
            continue
        rounds += n
        num = [a + n * x for a, x in zip(num, rates, strict=True)]  # type: ignore[operator]
        steps.append(int(r["step"]))
    if rounds <= 0:
        return None
    return AcceptanceSeries(
        kind, mode, "engine counters", tuple(a / rounds for a in num), tuple(steps), rounds
    )


def tap_acceptance(records: Sequence[Mapping[str, Any]], kind: str) -> list[AcceptanceSeries]:
    """The sidecar's per-position estimates (``accept_est_r{i}_{kind}[_prob]``) averaged over ``records``."""
    out = []
    for mode, suffix in TAP_MODES:
        k = _rate_keys(records, "accept_est_r", f"_{kind}{suffix}")
        rows: list[tuple[int, list[float]]] = []
        for r in records if k else ():
            vals = [number(r.get(f"accept_est_r{i}_{kind}{suffix}")) for i in range(k)]
            if all(v is not None for v in vals):
                rows.append((int(r["step"]), vals))  # type: ignore[arg-type]
        if rows:
            rates = tuple(statistics.fmean(v[i] for _, v in rows) for i in range(k))
            out.append(AcceptanceSeries(kind, mode, "estimator on taps", rates, tuple(s for s, _ in rows)))
    return out


@dataclass(frozen=True)
class RunSettings:
    """What the run decoded with (from its resolved recipe where present, else from its logs)."""

    k: int
    verify_mode: str
    temperature: float | None
    engine: str  # vllm | reference
    batch_size: int  # requests per generate call of the serving draft (median over the profiled steps)


def run_settings(run: Path, records: Sequence[Mapping[str, Any]], k: int) -> RunSettings:
    mode, temperature = "unknown", None
    recipe_path = run / RESOLVED_RECIPE
    if recipe_path.is_file():
        from draft_align.config import CotrainRecipe, load_recipe

        rl = load_recipe(recipe_path, None, CotrainRecipe).rl
        mode, temperature, k = str(rl.engine.verify_mode), float(rl.task.temperature), int(rl.engine.spec_k)
    if mode == AUTO_VERIFY_MODE:  # measured and chosen by the engine: the mode its latest step served
        served = [v for r in records if (v := number(r.get("verify_probabilistic"))) is not None]
        mode = ("probabilistic" if served[-1] else "greedy_draft") if served else mode
    engine = "vllm" if any(number(r.get("engine_vllm")) for r in records) else "reference"
    sizes = [
        int(v)
        for r in records
        if (v := number(r.get("rollouts_adapted")) or number(r.get("rollouts_frozen")))
    ]
    batch = 1 if engine == "reference" or not sizes else int(statistics.median_low(sizes))
    return RunSettings(k, mode, temperature, engine, batch)


# ------------------------------------------------------------------------------------------- advice
@dataclass(frozen=True)
class Projection:
    """k = 1..7 for one acceptance series at one batch size; ``step_speedup``: S(k) vs plain decoding."""

    series: AcceptanceSeries
    batch_size: int
    rows: tuple[KRow, ...]
    best: KRow | None
    step_speedup: Mapping[int, Labelled]
    step_s: Mapping[int, Labelled]


@dataclass(frozen=True)
class Advice:
    run: str
    source: Path
    settings: RunSettings
    profile: StageProfile
    acceptance: tuple[AcceptanceSeries, ...]  # counters first (serving draft first), then tap estimates
    cost_table: RoundCostTable | None
    costs: CostModel | None  # at ``costs.batch_size``, the calibrated batch nearest the run's
    run_spec_step_s: float | None  # seconds per engine step of the run's speculative generates (measured)
    plain_generation_s: Labelled | None  # the step's generation seconds without a draft (projected)
    projections: tuple[Projection, ...]
    other_batches: Mapping[int, KRow | None]  # best k of the serving draft at other calibrated batch sizes
    lines: tuple[str, ...]
    cadence: Recommendation | None = None  # from the run's measured cadence table, when it has one

    @property
    def serving(self) -> AcceptanceSeries:
        return self.acceptance[0]


def _plain_generation(
    profile: StageProfile,
    counters: Mapping[str, AcceptanceSeries],
    serving: AcceptanceSeries,
    costs: CostModel | None,
    k: int,
) -> Labelled | None:
    """T_plain = Σ_kind generate_s_kind · E_kind(k) / c(k) (projected): the same tokens without a draft."""
    c = costs.cost(k) if costs is not None else None
    if c is None:
        return None
    if profile.generation_by_kind:
        total = 0.0
        for kind, secs in profile.generation_by_kind.items():
            series = counters.get(kind, serving)
            total += secs * tokens_per_round(series.rates, k) / c.value
        return Labelled(total, PROJECTED)
    return Labelled(profile.generation_s * tokens_per_round(serving.rates, k) / c.value, PROJECTED)


def _projection(
    series: AcceptanceSeries,
    costs: CostModel | None,
    batch: int,
    profile: StageProfile,
    plain: Labelled | None,
) -> Projection:
    rows = tuple(project(series.rates, series.k, costs, K_MAX))
    speedups: dict[int, Labelled] = {}
    step_s: dict[int, Labelled] = {}
    if plain is not None:
        for r in rows:
            if r.speedup is not None:
                speedups[r.k] = Labelled(amdahl(plain.value, profile.rest_s, r.speedup.value), PROJECTED)
                step_s[r.k] = Labelled(profile.rest_s + plain.value / r.speedup.value, PROJECTED)
    return Projection(series, batch, rows, best_k(rows), speedups, step_s)


def _run_spec_step_s(records: Sequence[Mapping[str, Any]]) -> float | None:
    secs = steps = 0.0
    for r in records:
        for kind in DRAFT_KINDS:
            s, n = number(r.get(f"generate_s_{kind}")), number(r.get(f"engine_steps_{kind}"))
            if s is not None and n:
                secs, steps = secs + s, steps + n
    return secs / steps if steps else None


def speedup_text(v: Labelled | None, digits: int = 2) -> str:
    """A labelled speed-up as printed: ``1.23× projected``."""
    return "–" if v is None else f"{v.value:.{digits}f}× {v.label}"


PROMPTS_FILE = "rl/prompts.jsonl"  # the RL job's own prompts, as the co-training run saved them


def in_domain_command() -> str:
    """The command that warm-starts an in-domain draft from a run's own prompts, answered by the policy itself
    (docs/tasks.md: what an in-domain draft measured on the add task)."""
    return (
        "an in-domain draft from this run's own prompts, self-distilled by the policy (RUN: this run's folder): "
        f"`draft-align warmstart recipes/smollm2_task_warmstart.yaml data.source=RUN/{PROMPTS_FILE} "
        "target.model=RUN/policy_merged/vNNNN run=NAME`, then `draft-align cotrain RECIPE --draft checkpoints/NAME`"
    )


def advice_lines(
    settings: RunSettings,
    serving: Projection,
    costs: CostModel | None,
    profile: StageProfile,
    other_batches: Mapping[int, KRow | None],
    run_name: str,
) -> list[str]:
    """The advice rules (module docstring), in order: acceptance, k, on/off at this batch size, end to end."""
    s = serving.series
    lines = []
    rate = s.acceptance_rate
    if rate < LOW_ACCEPTANCE:
        lines.append(
            f"acceptance rate {100 * rate:.0f}% measured (accepted / proposed draft tokens, {s.draft} draft, "
            f"k={s.k}) is below {100 * LOW_ACCEPTANCE:.0f}%: a larger or in-domain draft pays more than tuning k"
        )
        lines.append(in_domain_command())
    else:
        lines.append(
            f"acceptance rate {100 * rate:.0f}% measured is at or above {100 * LOW_ACCEPTANCE:.0f}%: "
            "the draft is not the first thing to change"
        )
    if costs is None:
        lines.append(
            f"the round cost is not measured for this run: `draft-align advise {run_name} --calibrate` "
            "measures it with vLLM (plain vs speculative engine steps at the run's batch size)"
        )
        return lines
    best = serving.best
    if best is None:
        return lines
    chosen = next((r for r in serving.rows if r.k == settings.k), None)
    if costs.b is None:
        lines.append(
            f"only k={', '.join(map(str, sorted(costs.measured)))} has a measured round cost: calibrate a "
            "second k (`--calibrate-k 1,3`) to compare k"
        )
    elif chosen is not None and chosen.speedup is not None and settings.k != best.k:
        if settings.k > best.k:
            lines.append(
                f"rl.engine.spec_k={settings.k} is beyond the best k={best.k} at batch size {serving.batch_size}: "
                f"{speedup_text(chosen.speedup)} vs {speedup_text(best.speedup)}; set rl.engine.spec_k={best.k}"
            )
        else:
            lines.append(
                f"a larger k projects faster at batch size {serving.batch_size}: k={best.k} "
                f"{speedup_text(best.speedup)} vs rl.engine.spec_k={settings.k} {speedup_text(chosen.speedup)} "
                f"(positions beyond k={s.k} are extrapolated)"
            )
    if best.speedup is not None and best.speedup.value < 1.0:
        pays = sorted(
            b
            for b, r in other_batches.items()
            if r is not None and r.speedup is not None and r.speedup.value >= 1.0
        )
        where = (
            "; it pays at batch size "
            + ", ".join(
                f"{b} (k={other_batches[b].k}: {speedup_text(other_batches[b].speedup)})"
                for b in pays  # type: ignore[union-attr]
            )
            if pays
            else f"; it pays at none of the calibrated batch sizes ({', '.join(map(str, sorted(other_batches)))})"
            if other_batches
            else ""
        )
        lines.append(
            f"speculative decoding is projected slower than plain decoding at batch size "
            f"{serving.batch_size} (best k={best.k}: {speedup_text(best.speedup)}): decode batches of this size "
            f"without a draft{where}"
        )
    else:
        lines.append(
            f"best k={best.k} at batch size {serving.batch_size}: rollouts {speedup_text(best.speedup)}"
        )
    if profile.step_s > 0 and best.k in serving.step_speedup:
        share = profile.generation_s / profile.step_s
        lines.append(
            f"generation is {100 * share:.0f}% of the step (measured): at k={best.k} the whole step is "
            f"{speedup_text(serving.step_speedup[best.k])} vs plain decoding (Amdahl)"
        )
    return lines


def advise_run(run_dir: str | os.PathLike[str]) -> Advice:
    """Read a co-training run folder and build its :class:`Advice`; AdviseError / FileNotFoundError (one line)
    for a folder without what it needs."""
    run = Path(run_dir)
    if not run.is_dir():
        raise AdviseError(f"run folder {run} does not exist")
    source = find_log(run)
    records = load_steps(source)
    if not records:
        raise AdviseError(f"{source} holds no step records")
    profile = stage_profile(records)
    half = records[len(records) // 2 :]
    k_logged = _rate_keys(records, "accept_r", "_adapted") or _rate_keys(records, "accept_r", "_frozen")
    settings = run_settings(run, records, k_logged)
    counters = {
        kind: c for kind in DRAFT_KINDS if (c := counter_acceptance(half, kind, settings.verify_mode))
    }
    if not counters:
        raise AdviseError(
            f"{source}: no engine acceptance counters (accept_r<i>_adapted with accept_rounds_adapted > 0) in the "
            "last half of the steps: advise needs rollouts decoded by speculative decoding"
        )
    serving = counters.get("adapted") or counters["frozen"]
    taps = tap_acceptance(half, serving.draft)
    table = RoundCostTable.load(run / ROUND_COST_FILE) if (run / ROUND_COST_FILE).is_file() else None
    costs = None
    other: dict[int, KRow | None] = {}
    if table is not None and (cb := table.nearest_batch(settings.batch_size)) is not None:
        costs = CostModel.fit(table.relative(cb), cb)
        for b in table.batch_sizes():
            if b != cb:
                other[b] = best_k(project(serving.rates, serving.k, CostModel.fit(table.relative(b), b)))
    batch = costs.batch_size if costs is not None else settings.batch_size
    plain = _plain_generation(profile, counters, serving, costs, serving.k)
    projections = [_projection(serving, costs, batch, profile, plain)]
    projections += [
        _projection(t, costs, batch, profile, plain) for t in taps if t.verify_mode != serving.verify_mode
    ]
    acceptance = (serving, *(c for c in counters.values() if c is not serving), *taps)
    lines = advice_lines(settings, projections[0], costs, profile, other, str(run))
    cadence, cadence_line = cadence_advice(run)
    lines.append(cadence_line)
    return Advice(
        run.resolve().name,
        source,
        settings,
        profile,
        acceptance,
        table,
        costs,
        _run_spec_step_s(records),
        plain,
        tuple(projections),
        other,
        tuple(lines),
        cadence,
    )


def cadence_advice(run: Path) -> tuple[Recommendation | None, str]:
    """The cadence line of the advice: the recommendation from ``<run>/cadence.json``, or how to measure one."""
    try:
        table = load_table(run)
    except CadenceError as e:
        return None, f"update cadence: {e}"
    if table is None:
        return None, (
            "update cadence not measured for this run: with `sidecar.recording.enabled=true`, "
            "`python benchmarks/adapt_playback.py --run RUN --arms every1,every5,never,drift` replays its taps "
            "under each cadence and writes the table advise reads"
        )
    rec = recommend(table)
    return rec, f"update cadence {rec.arm.name} (measured on this run's replayed taps): {rec.reason}"
