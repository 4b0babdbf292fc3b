"""Printed tables and the JSON document of a run or a sweep."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

from bench.serve.calibration import CapacityAttempt
from bench.serve.engine_activity import EngineActivity
from bench.serve.loadgen import CLIENT_LATE_S, RequestResult
from bench.serve.plan import HEAVY_TENANT, LIGHT_TENANT
from bench.serve.session import RunRecord
from bench.serve.stats import GroupSummary, RunSummary, share_of_requests, time_weighted
from bench.serve.sweep import FairnessRun, LoadPoint, SweepResult, repeat_tag
from bench.stats import Percentiles

__all__ = ["format_run", "format_sweep", "headline", "run_json", "sweep_json"]

_HEADER = (
    f"{'run':24} {'tier':9} {'sent':>5} {'shed%':>6} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
    f"{'TPOT p50':>9} {'p90':>6} {'p99':>6} {'ITL p99':>8} {'E2E p99':>8} {'SLO%':>6} "
    f"{'good/s':>7} {'tok/s':>7}"
)


# Sweep tables add the machine's 1-minute load average just before each run, the share of
# the machine's CPUs the server used during it, and the share the hypervisor took (steal).
_MACHINE_COLUMNS = f" {'load':>5} {'cpu%':>5} {'steal%':>6}"


def _row(label: str, g: GroupSummary) -> str:
    return (
        f"{label:24} {g.name:9} {g.num_requests:5d} {100 * g.shed_rate:6.1f} "
        f"{g.ttft_s.p50:9.3f} {g.ttft_s.p90:7.3f} {g.ttft_s.p99:7.3f} "
        f"{g.tpot_s.p50:9.3f} {g.tpot_s.p90:6.3f} {g.tpot_s.p99:6.3f} {g.itl_s.p99:8.3f} "
        f"{g.e2e_s.p99:8.3f} {100 * g.slo_attainment:6.1f} {g.goodput_rps:7.3f} "
        f"{g.output_tokens_per_s:7.1f}"
    )


def _rows(summary: RunSummary, machine: str = "") -> list[str]:
    return [_row(summary.label, g) + machine for g in [*summary.tiers, summary.overall]]


def _machine_columns(point: LoadPoint) -> str:
    share = "" if point.server_cpu_share is None else f"{100 * point.server_cpu_share:.0f}"
    return f" {point.load_average_1m:5.1f} {share:>5} {_percent(point.record.host_steal_share):>6}"


def _percent(share: float | None) -> str:
    return "" if share is None else f"{100 * share:.1f}"


def format_run(record: RunRecord) -> str:
    """One run: a row per tier and one for all requests (latencies in seconds), then what the
    engine did."""
    summary = record.summary
    lines = [
        f"offered {summary.offered_rps:.2f} req/s over {summary.duration_s:.1f} s "
        f"(generator at most {1000 * summary.max_send_lag_s:.0f} ms late)",
        _HEADER,
        *_rows(summary),
    ]
    shed = summary.overall.shed_response_s
    if shed.num_samples:
        lines.append(
            f"{shed.num_samples} shed, answered in p50 {1000 * shed.p50:.1f} ms, "
            f"p99 {1000 * shed.p99:.1f} ms"
        )
    if record.engine is not None:
        engine = _engine_row("engine", record.engine, record.summary.duration_s)
        lines += ["", _engine_header(), engine]
    return "\n".join(lines)


# What the server's engine did during each run (EngineActivity): steps, mean step time, the
# share of the run its steps took, prompt tokens and new tokens per step (the latter the
# batch the steps decoded), preemptions, tokens recomputed after them, steps the
# under-share lane took, the gateway process's full garbage collections with their mean
# pause (not the engine process's), and its event loop's heartbeats more than 50 ms late.
def _engine_header(title: str = "engine during the run") -> str:
    return (
        f"{title:24} {'steps':>6} {'step ms':>8} {'busy%':>6} {'prompt/step':>11} "
        f"{'new/step':>8} {'preempted':>9} {'recomputed':>10} {'lane steps':>10} {'full gc':>7} "
        f"{'gc ms':>6} {'loop>50ms':>9}"
    )


def _engine_row(label: str, activity: EngineActivity | None, duration_s: float) -> str:
    if activity is None:
        return f"{label:24} {'(no engine counters)':>6}"
    busy = 100 * activity.busy_s / duration_s if duration_s > 0 else math.nan
    steps = activity.num_steps
    prompt_per_step = activity.num_prompt_tokens / steps if steps else math.nan
    return (
        f"{label:24} {steps:6d} {1000 * activity.mean_step_s:8.1f} {busy:6.1f} "
        f"{prompt_per_step:11.1f} {activity.mean_generated_per_step:8.1f} "
        f"{activity.num_preemptions:9d} {activity.num_recomputed_tokens:10d} "
        f"{activity.num_lane_steps:10d} {activity.num_full_gcs:7d} "
        + (f"{1000 * activity.mean_full_gc_s:6.1f}" if activity.num_full_gcs else f"{'-':>6}")
        + f" {activity.num_late_beats:9d}"
    )


def _engine_rows(result: SweepResult) -> list[str]:
    """What the engine did over each run, then over each load run's arrivals alone: the
    window of its tokens/s "while arrivals last", without the drain after it (a shedding
    server's batch empties within seconds of the last arrival, FCFS's backlog keeps a full
    batch for as long again), so the two configurations' steps compare at a full batch."""
    records = [p.record for p in result.points]
    records += [r for f in result.fairness for r in (f.alone, f.shared)]
    if all(r.engine is None for r in records):
        return []
    lines = ["", _engine_header(), *[_whole_run_row(r) for r in records]]
    arriving = [p.record for p in result.points if p.record.engine_while_arriving is not None]
    if arriving:
        lines += ["", _engine_header("engine while arriving")]
        lines += [
            _engine_row(r.summary.label, r.engine_while_arriving, r.summary.arrival_window_s)
            for r in arriving
        ]
    return lines


def _whole_run_row(record: RunRecord) -> str:
    return _engine_row(record.summary.label, record.engine, record.summary.duration_s)


def format_sweep(result: SweepResult) -> str:
    m, c = result.machine, result.calibration
    tier_lines = [
        f"  {t.name}: TTFT {_seconds(t.ttft_slo_s)}, TPOT {_seconds(t.tpot_slo_s)}"
        for t in result.tiers
    ]
    if c.reference_prefill_s is not None:
        scale = (
            f"unloaded 1024-token prefill {c.reference_prefill_s:.3f} s "
            f"({_prefill_medians(c.prefill_attempts_s)}); SLO scale {c.slo_scale:.2f} = "
            "10 x prefill / GPU premium TTFT SLO"
        )
    else:
        scale = f"SLO scale {c.slo_scale:.2f} (given)"
    kept = c.capacity
    if kept is not None:
        capacity = (
            f"capacity {c.capacity_rps:.3f} req/s, {kept.output_tokens_per_s:.1f} output "
            f"tokens/s (FCFS, closed loop with {c.capacity_concurrency} in flight: "
            f"{kept.num_completions} completions over {kept.window_s:.1f} s"
            + ("" if kept.steal_share is None
               else f"; host steal {100 * kept.steal_share:.1f} %")
            + _attempts(c.capacity_attempts) + ")"
        )  # fmt: skip
    else:
        capacity = f"capacity {c.capacity_rps:.3f} req/s (given)"
    lines = [
        f"machine: {m.cpu_model}, {m.num_cpus} CPU(s), {m.memory_gib:.0f} GiB, {m.system}; "
        f"Python {m.python}, torch {m.torch}; started {m.started_at}, "
        f"load average {m.load_average_1m:.1f}",
        scale,
        capacity,
        *_turn_capacities(result),
        "scaled objectives:",
        *tier_lines,
        f"arrivals per load run: {result.duration_s:.1f} s",
        "",
        _HEADER + _MACHINE_COLUMNS,
    ]
    for point in result.points:
        lines += _rows(point.record.summary, _machine_columns(point))
    lines += ["", *headline(result)]
    if result.fairness:
        lines += ["", _fairness_header(), *_fairness_rows(result)]
    lines += _engine_rows(result)
    return "\n".join(lines)


def _prefill_medians(attempts: list[list[float]]) -> str:
    if len(attempts) == 1:
        return f"median of {len(attempts[0])}"
    medians = ", ".join(f"{statistics.median(samples):.3f}" for samples in attempts)
    return (f"the middle of {len(attempts)} attempts' medians of {len(attempts[0])} probes: "
            f"{medians} s")


def _turn_capacities(result: SweepResult) -> list[str]:
    """The capacity each turn measured before its runs (capacity_each_turn), if any."""
    turns = {(p.load_factor, p.repeat): p.turn_capacity for p in result.points}
    measured = [(key, c) for key, c in turns.items() if c is not None]
    if not measured:
        return []
    each = ", ".join(
        f"{factor:g}x{repeat_tag(repeat, result.repeats)} {c.capacity_rps:.3f} "
        f"({c.output_tokens_per_s:.0f})"
        for (factor, repeat), c in measured
    )
    return [f"capacity measured again before each turn, its loads multiples of it (FCFS, "
            f"closed loop, one attempt on a fresh server), req/s (output tokens/s): {each}"]


def _attempts(attempts: list[CapacityAttempt]) -> str:
    if len(attempts) == 1:
        return ""
    each = ", ".join(
        f"{a.output_tokens_per_s:.0f}"
        + ("" if a.steal_share is None else f" ({100 * a.steal_share:.1f} % steal)")
        for a in attempts
    )
    return f"; the middle of {len(attempts)} attempts' output tokens/s: {each}"


def headline(result: SweepResult) -> list[str]:
    """The comparisons the issue asks for, where the sweep has the runs they need; with
    repeats, over every repetition's requests together, then each repetition's."""
    lines = []
    for factor in sorted({p.load_factor for p in result.points}):
        try:
            tiered = [p.record.summary for p in result.points_at("tiered", factor)]
            fcfs = [p.record.summary for p in result.points_at("fcfs", factor)]
        except KeyError:
            continue
        together = f", {len(tiered)} repetitions together" if len(tiered) > 1 else ""
        lines.append(
            f"at {factor:g}x{together}: premium TTFT within SLO {_share(tiered)} tiered vs "
            f"{_share(fcfs)} FCFS; standard goodput tiered/FCFS "
            f"{_ratio(_goodput(tiered), _goodput(fcfs))}; output tokens/s tiered/FCFS "
            f"{_ratio(_tokens_per_s(tiered), _tokens_per_s(fcfs))} over the run, "
            f"{_ratio(_tokens_per_s_while_arriving(tiered), _tokens_per_s_while_arriving(fcfs))}"
            " while arrivals last"
        )
        if len(tiered) > 1:
            lines.append(_each_repetition(tiered, fcfs))
    return lines + _shed_answers(result) + _capacity_check(result) + _light_tenant(result)


def _each_repetition(tiered: list[RunSummary], fcfs: list[RunSummary]) -> str:
    pairs = list(zip(tiered, fcfs, strict=True))
    premium = ", ".join(f"{_share([t], unit='')}/{_share([f], unit='')}" for t, f in pairs)
    goodput = ", ".join(_ratio(_goodput([t]), _goodput([f])) for t, f in pairs)
    ratios = [
        t.output_tokens_per_s_while_arriving / f.output_tokens_per_s_while_arriving
        for t, f in pairs if f.output_tokens_per_s_while_arriving > 0
    ]  # fmt: skip
    spread = (
        f" (mean {statistics.fmean(ratios):.3f}, sd {statistics.stdev(ratios):.3f})"
        if len(ratios) > 1 else ""
    )
    return (
        f"  each repetition: premium {premium} %; standard goodput {goodput}; output "
        f"tokens/s while arrivals last {', '.join(f'{r:.3f}' for r in ratios)}{spread}"
    )


def _shed_answers(result: SweepResult) -> list[str]:
    """How fast shed requests were answered, per offered load (the issue's bound is at 2x),
    with the gateway's own part of each slowest answer (its openai-processing-ms) and the most
    this generator's event loop was late while it waited for it: the rest is the accept
    queue and both processes' share of the same cores."""
    by_load: dict[float, list[tuple[RequestResult, RunRecord]]] = {}
    for point in result.points:
        by_load.setdefault(point.load_factor, []).extend(
            (r, point.record) for r in point.record.results if r.is_shed
        )
    parts = []
    for factor, shed in sorted(by_load.items()):
        if not shed:
            continue
        slowest, record = max(shed, key=lambda pair: pair[0].e2e_s)
        notes = []
        if slowest.server_s is not None:
            notes.append(f"{1000 * slowest.server_s:.0f} in the gateway")
        if record.client_loop_lag is not None:
            lag = record.client_loop_lag
            late_s = lag.most_late_within(slowest.sent_s, slowest.finish_s)
            notes.append(
                f"the generator's loop {1000 * late_s:.0f} late" if late_s
                else f"the generator's loop under {1000 * CLIENT_LATE_S:.0f} late"
            )
            stall = lag.stall_within(slowest.sent_s, slowest.finish_s)
            if stall is not None:
                notes.append(f"the stall: {stall.times()}")
        own = f" ({', '.join(notes)})" if notes else ""
        parts.append(f"{len(shed)} at {factor:g}x, slowest {1000 * slowest.e2e_s:.1f} ms{own}")
    return [f"shed requests answered: {'; '.join(parts)}"] if parts else []


def _capacity_check(result: SweepResult) -> list[str]:
    """FCFS at 2x and over runs at what the machine sustains, its queue never empty: its
    output tokens/s then against the capacity its load multiplied (the calibration's, or its
    turn's) say whether the loads' labels held (a capacity measured in a fast minute of the
    host makes the loads heavier than their labels)."""
    kept = result.calibration.capacity
    overloaded = [p for p in result.points if p.variant == "fcfs" and p.load_factor >= 2]
    parts, against = [], ""
    for p in overloaded:
        measured = p.turn_capacity or kept
        if measured is None:
            return []  # the capacity was given: nothing measured to check
        # Every point has a turn's capacity, or none has (SweepConfig.capacity_each_turn).
        against = ("its turn's capacity run" if p.turn_capacity is not None
                   else f"the calibration's {measured.output_tokens_per_s:.0f}")
        sustained = p.record.summary.output_tokens_per_s_while_arriving
        parts.append(f"{sustained:.0f} at {p.load_factor:g}x{repeat_tag(p.repeat, result.repeats)}"
                     f" ({sustained / measured.output_tokens_per_s:.2f})")
    if not parts:
        return []
    return [f"capacity check: FCFS output tokens/s while arrivals last {', '.join(parts)}, "
            f"against {against}"]


def _light_tenant(result: SweepResult) -> list[str]:
    """The light tenant's TTFT p99 beside the heavy tenant over its p99 alone, per
    configuration; with repeats, over every repetition's light requests together."""
    lines = []
    for variant in dict.fromkeys(run.variant for run in result.fairness):
        runs = [run for run in result.fairness if run.variant == variant]
        alone, shared = _light_ttfts(runs)
        together = f", {len(runs)} repetitions together" if len(runs) > 1 else ""
        each = (
            "; each " + ", ".join(f"{run.light_ttft_p99_ratio:.2f}x" for run in runs)
            if len(runs) > 1 else ""
        )
        lines.append(
            f"light tenant's TTFT p99 with the heavy tenant over alone, {variant}"
            f"{together}: {shared.p99 / alone.p99:.2f}x ({shared.p99:.3f} against "
            f"{alone.p99:.3f} s){each}"
        )
    return lines


def _light_ttfts(runs: list[FairnessRun]) -> tuple[Percentiles, Percentiles]:
    """The light tenant's TTFTs alone and shared, every run's requests together."""

    def ttfts(records: list[RunRecord]) -> Percentiles:
        return Percentiles.of([
            r.ttft_s for record in records for r in record.results
            if r.tenant == LIGHT_TENANT and r.ttft_s is not None
        ])  # fmt: skip

    return ttfts([run.alone for run in runs]), ttfts([run.shared for run in runs])


def _share(summaries: list[RunSummary], *, unit: str = " %") -> str:
    """The premium requests' share within their TTFT objective, over every run's requests."""
    groups = [g for s in summaries for g in s.tiers if g.name == "premium"]
    share = share_of_requests(groups, lambda g: g.ttft_slo_attainment)
    return "n/a" if math.isnan(share) else f"{100 * share:.1f}{unit}"


def _goodput(summaries: list[RunSummary]) -> float:
    """Standard requests meeting both objectives per second, over every run's time."""
    return time_weighted([(g.goodput_rps, s.duration_s) for s in summaries for g in s.tiers
                          if g.name == "standard"])  # fmt: skip


def _tokens_per_s(summaries: list[RunSummary]) -> float:
    return time_weighted([(s.overall.output_tokens_per_s, s.duration_s) for s in summaries])


def _tokens_per_s_while_arriving(summaries: list[RunSummary]) -> float:
    return time_weighted(
        [(s.output_tokens_per_s_while_arriving, s.arrival_window_s) for s in summaries]
    )


def _ratio(numerator: float, denominator: float) -> str:
    if math.isnan(numerator) or math.isnan(denominator):
        return "n/a"
    return f"{numerator / denominator:.3f}" if denominator else "inf"


def _fairness_header() -> str:
    return (
        f"{'fairness: light TTFT':22} {'light/s':>7} {'heavy/s':>7} {'n':>4} "
        f"{'alone p50':>9} {'p90':>6} {'p99':>6} {'shared p50':>10} {'p90':>6} {'p99':>6} "
        f"{'p99 ratio':>9} {'light shed%':>11} {'heavy shed%':>11} {'steal% alone':>12} "
        f"{'shared':>6}"
    )


def _fairness_rows(result: SweepResult) -> list[str]:
    """A row per run; with repeats, then a row per configuration over every repetition's
    requests together (their percentiles, not an average of each run's)."""
    rows = [_fairness_row(run, result.repeats) for run in result.fairness]
    if result.repeats > 1:
        for variant in dict.fromkeys(run.variant for run in result.fairness):
            rows.append(_pooled_fairness_row(
                variant, [run for run in result.fairness if run.variant == variant]
            ))
    return rows


def _fairness_row(run: FairnessRun, repeats: int) -> str:
    light = run.shared.summary.tenant(LIGHT_TENANT)
    heavy = run.shared.summary.tenant(HEAVY_TENANT)
    alone = run.alone.summary.tenant(LIGHT_TENANT)
    return (
        f"{run.variant + repeat_tag(run.repeat, repeats):22} {run.light_rate_rps:7.2f} "
        f"{run.heavy_rate_rps:7.2f} {light.num_requests:4d} "
        + _light_columns(alone.ttft_s, light.ttft_s)
        + f" {100 * light.shed_rate:11.1f} {100 * heavy.shed_rate:11.1f} "
        f"{_percent(run.alone.host_steal_share):>12} {_percent(run.shared.host_steal_share):>6}"
    )


def _pooled_fairness_row(variant: str, runs: list[FairnessRun]) -> str:
    def shed_percent(records: list[RunRecord], tenant: str) -> float:
        results = [r for record in records for r in record.results if r.tenant == tenant]
        return 100 * sum(r.is_shed for r in results) / len(results) if results else math.nan

    shared = [run.shared for run in runs]
    alone_ttft, shared_ttft = _light_ttfts(runs)
    num_light = sum(run.shared.summary.tenant(LIGHT_TENANT).num_requests for run in runs)
    return (
        f"{f'{variant}, all {len(runs)}':22} {runs[0].light_rate_rps:7.2f} "
        f"{runs[0].heavy_rate_rps:7.2f} {num_light:4d} "
        + _light_columns(alone_ttft, shared_ttft)
        + f" {shed_percent(shared, LIGHT_TENANT):11.1f}"
        f" {shed_percent(shared, HEAVY_TENANT):11.1f}"
    )


def _light_columns(alone: Percentiles, shared: Percentiles) -> str:
    return (
        f"{alone.p50:9.3f} {alone.p90:6.3f} {alone.p99:6.3f} {shared.p50:10.3f} "
        f"{shared.p90:6.3f} {shared.p99:6.3f} {shared.p99 / alone.p99:9.2f}"
    )


def _seconds(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f} s"


# -- JSON ------------------------------------------------------------------------------------


def run_json(record: RunRecord) -> dict[str, Any]:
    """A run's summary and its requests (without the per-token gaps, summarized instead)."""
    return _finite(
        {
            "summary": dataclasses.asdict(record.summary),
            "engine": None if record.engine is None else dataclasses.asdict(record.engine),
            "engine_while_arriving": (
                None if record.engine_while_arriving is None
                else dataclasses.asdict(record.engine_while_arriving)
            ),
            "host_steal_share": record.host_steal_share,
            "client_loop_lag": (
                None if record.client_loop_lag is None
                else dataclasses.asdict(record.client_loop_lag)
            ),
            "requests": [_request_json(r) for r in record.results],
        }
    )


def sweep_json(result: SweepResult) -> dict[str, Any]:
    return _finite(
        {
            "machine": dataclasses.asdict(result.machine),
            "calibration": {
                **dataclasses.asdict(result.calibration),
                "reference_prefill_s": result.calibration.reference_prefill_s,
                "capacity": (
                    None if result.calibration.capacity is None
                    else dataclasses.asdict(result.calibration.capacity)
                ),
                "is_slo_scale_measured": result.calibration.is_slo_scale_measured,
                "is_capacity_measured": result.calibration.is_capacity_measured,
            },
            "repeats": result.repeats,
            "tiers": [dataclasses.asdict(t) for t in result.tiers],
            "duration_s": result.duration_s,
            "runs": [
                {
                    "variant": p.variant,
                    "load_factor": p.load_factor,
                    "repeat": p.repeat,
                    "load_average_1m": p.load_average_1m,
                    "server_cpu_share": p.server_cpu_share,
                    "capacity_rps": result.capacity_rps_for(p.turn_capacity),
                    "turn_capacity": (
                        None if p.turn_capacity is None else dataclasses.asdict(p.turn_capacity)
                    ),
                    **run_json(p.record),
                }
                for p in result.points
            ],
            "fairness": [
                {
                    "variant": f.variant,
                    "repeat": f.repeat,
                    "light_rate_rps": f.light_rate_rps,
                    "heavy_rate_rps": f.heavy_rate_rps,
                    "light_ttft_p99_ratio": f.light_ttft_p99_ratio,
                    "alone": run_json(f.alone),
                    "shared": run_json(f.shared),
                }
                for f in result.fairness
            ],
            "headline": headline(result),
            "server_exit_codes": result.server_exit_codes,
        }
    )


def _request_json(result: RequestResult) -> dict[str, Any]:
    fields = dataclasses.asdict(result)
    gaps: Sequence[float] = fields.pop("itl_s")
    return {**fields, "num_token_gaps": len(gaps), "tpot_s": result.tpot_s}


def _finite(value: Any) -> Any:
    """NaN (a percentile of nothing) as null, so the document is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
