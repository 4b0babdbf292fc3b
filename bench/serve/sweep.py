"""The sweep: measure the machine, then offer the same workload at several multiples of the
measured capacity to each server configuration, every run on a server started for it.

1. Calibration server (FCFS, nothing shed): unloaded 1024-token prefill -> SLO scale, and a
   closed-loop run of the workload's first requests -> capacity, in a few attempts, the
   middle one of each kept (see calibration.py). With capacity_each_turn, the capacity is
   measured again before every turn (one load's repetition on every configuration), one
   attempt on a fresh FCFS server of its own (`capacity-<load>x-<repetition>`), and that
   turn's loads are multiples of it: on a host whose speed drifts within a command, a load
   labelled 2x stays 2x of what the host does minutes before the runs, not of what it did at
   the start (FCFS sustained ever less of the calibration's tokens/s over run 57's ten
   repetitions, its steps slowing: ops/bench/journal.md, "Runs 57-61"). The SLO scale and
   the fairness test keep the calibration's figures.
2. Every load run on a fresh server of its configuration (tiered, fcfs, tiered-noshed;
   server.py) with the scaled tier table, stopped after it. A fresh process per run makes the
   repetitions independent samples of everything a server process carries (its allocator,
   where its threads land, what its engine and admission layer learned in earlier runs),
   so a command's spread over its repetitions includes that too.
   Loads in ascending order; at each load every configuration in turn (the order rotating
   from one load to the next), each run starting once every request of the one before has
   ended. Interleaving keeps the comparison at one load fair on a machine whose other work
   comes and goes: the configurations run minutes apart, not a quarter of an hour. With
   repeats, every configuration runs once, then again, the order rotating each time (two
   configurations: A B, B A, A B, ...), before the next load: a pair's two runs stay minutes
   apart, and drift of the host over the repetitions falls on both alike. Repetition r of
   load i uses prompt seed workload.seed + i x repeats + r everywhere, so each repetition
   sees the same prompts on every server.
3. Fairness (on the chosen configurations): two standard tenants, `heavy` at heavy_ratio x
   the rate of `light`, together offering fairness_load_factor x capacity; first the light
   tenant's requests alone, then the same requests with the heavy tenant's, both on one
   fresh server; with repeats, each repetition with arrivals and prompts of its own and a
   server of its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from bench.serve.calibration import (
    Calibration,
    CapacityAttempt,
    calibration_of,
    measure_capacity,
    measure_reference_prefill_s,
)
from bench.serve.machine import MachineInfo
from bench.serve.plan import HEAVY_TENANT, LIGHT_TENANT, retime, two_tenant_workload
from bench.serve.server import VARIANTS, BenchServer
from bench.serve.session import BenchTarget, RunRecord
from bench.serve.sweep_config import SweepConfig, run_duration_s
from bench.workload import Workload
from policies import TierTable

__all__ = ["FairnessRun", "LoadPoint", "SweepResult", "repeat_tag", "run_order", "run_sweep"]

_FAIRNESS_TIER = "standard"


@dataclass(frozen=True)
class LoadPoint:
    """One configuration at one offered load."""

    variant: str  # server configuration name
    load_factor: float  # offered load over measured capacity
    repeat: int  # which repetition of this load (0-based)
    load_average_1m: float  # the machine's load average just before the run
    # The server's CPU use during the run over the run's duration x CPUs of the machine
    # (None without /proc): low when other work on the machine took the cores.
    server_cpu_share: float | None
    record: RunRecord
    # The capacity run of this point's turn (capacity_each_turn); None: the load is a
    # multiple of the calibration's capacity.
    turn_capacity: CapacityAttempt | None = None


@dataclass(frozen=True)
class FairnessRun:
    """The light tenant alone, then with the heavy one, on one configuration."""

    variant: str
    repeat: int  # which repetition of the test (0-based)
    light_rate_rps: float
    heavy_rate_rps: float
    alone: RunRecord
    shared: RunRecord

    @property
    def light_ttft_p99_ratio(self) -> float:
        """Light tenant's TTFT p99 with the heavy tenant over its p99 alone."""
        alone = self.alone.summary.tenant(LIGHT_TENANT).ttft_s.p99
        return self.shared.summary.tenant(LIGHT_TENANT).ttft_s.p99 / alone


@dataclass(frozen=True)
class SweepResult:
    machine: MachineInfo
    calibration: Calibration
    tiers: TierTable  # the scaled table every server got
    duration_s: float  # arrivals of each load run span this long
    points: list[LoadPoint] = field(default_factory=list)
    fairness: list[FairnessRun] = field(default_factory=list)
    server_exit_codes: dict[str, int | None] = field(default_factory=dict)  # by server

    @property
    def repeats(self) -> int:
        """How many times each load ran on each configuration."""
        return 1 + max((p.repeat for p in self.points), default=0)

    def capacity_rps_for(self, turn_capacity: CapacityAttempt | None) -> float:
        """Requests/s a run's load factor multiplies: its turn's capacity (None: not measured
        every turn), or the calibration's."""
        if turn_capacity is not None:
            return turn_capacity.capacity_rps
        return self.calibration.capacity_rps

    def points_at(self, variant: str, load_factor: float) -> list[LoadPoint]:
        """Every repetition of one configuration at one load, in order."""
        points = [p for p in self.points if p.variant == variant and p.load_factor == load_factor]
        if not points:
            raise KeyError(f"no run of {variant} at {load_factor}x")
        return sorted(points, key=lambda p: p.repeat)


Log = Callable[[str], None]


def run_sweep(config: SweepConfig, log: Log = print) -> SweepResult:
    machine = MachineInfo.current()
    workload = config.workload
    tenants = sorted({(r.tenant, r.tier) for r in workload.requests})
    exit_codes: dict[str, int | None] = {}
    log(f"{machine.num_cpus} CPU(s), load average {machine.load_average_1m:.1f}")
    calibration = _calibrate(config, tenants, exit_codes, log)
    tiers = TierTable().scaled(calibration.slo_scale)
    duration_s = config.duration_s or run_duration_s(tiers)
    log(f"SLO scale {calibration.slo_scale:.2f}, capacity {calibration.capacity_rps:.3f} req/s, "
        f"{duration_s:.1f} s of arrivals per load run")
    result = SweepResult(machine, calibration, tiers, duration_s, server_exit_codes=exit_codes)
    # Every run's requests are planned before any server starts: a plan that cannot be made
    # fails here, not after the load points have run.
    loads = sorted(config.load_factors)

    def planned_run(factor: float, repeat: int, capacity_rps: float) -> Workload:
        index = loads.index(factor)
        return replace(
            retime(workload, factor * capacity_rps, arrivals=config.arrivals,
                   duration_s=duration_s, seed=config.seed + index * config.repeats + repeat),
            seed=workload.seed + index * config.repeats + repeat,
        )

    planned = {
        (factor, repeat): planned_run(factor, repeat, calibration.capacity_rps)
        for factor in loads
        for repeat in range(config.repeats)
    }
    fairness_plans = [_FairnessPlan.of(config, calibration, r) for r in range(config.repeats)]
    run_tenants = [*tenants, (LIGHT_TENANT, _FAIRNESS_TIER), (HEAVY_TENANT, _FAIRNESS_TIER)]

    @contextlib.contextmanager
    def fresh(name: str, variant: str) -> Iterator[tuple[BenchServer, BenchTarget]]:
        with _started(name, variant, tiers, config, exit_codes) as server:
            yield server, _target(server, run_tenants, config)

    turn_capacities: dict[tuple[float, int], CapacityAttempt] = {}
    for factor, repeat, variant in run_order(config.variants, loads, config.repeats):
        turn_capacity = turn_capacities.get((factor, repeat))
        if config.capacity_each_turn and turn_capacity is None:
            name = f"capacity-{factor:g}x-{repeat + 1}"
            turn_capacity = turn_capacities[factor, repeat] = _measure_turn_capacity(
                name, config, tenants, exit_codes, attempt=len(turn_capacities), log=log
            )
            planned[factor, repeat] = planned_run(factor, repeat, turn_capacity.capacity_rps)
        capacity_rps = result.capacity_rps_for(turn_capacity)
        label = f"{variant} @ {factor:g}x{repeat_tag(repeat, config.repeats)}"
        with fresh(f"{variant}-{factor:g}x-{repeat + 1}", variant) as (server, target):
            load_average = os.getloadavg()[0]
            cpu_before_s = server.cpu_time_s()
            record = target.run(planned[factor, repeat], label, tiers, factor * capacity_rps)
            cpu_share = _cpu_share(cpu_before_s, server.cpu_time_s(),
                                   record.summary.duration_s, machine.num_cpus)
        result.points.append(
            LoadPoint(variant, factor, repeat, load_average, cpu_share, record, turn_capacity)
        )
    for plan in fairness_plans:
        for variant in _rotated(config.fairness_variants, plan.repeat):
            with fresh(f"{variant}-fairness-{plan.repeat + 1}", variant) as (_, target):
                result.fairness.append(plan.run(target, variant, tiers, config.repeats))
    return result


def run_order(
    variants: Sequence[str], loads: Sequence[float], repeats: int
) -> list[tuple[float, int, str]]:
    """(load, repetition, configuration) in the order the sweep runs them: loads ascending;
    at each, every configuration once per repetition, the order rotating from one turn to
    the next (two configurations: A B, B A, A B, ...), so none always runs first and a
    drift of the host over the repetitions falls on every configuration alike."""
    turns = [(factor, repeat) for factor in loads for repeat in range(repeats)]
    return [
        (factor, repeat, variant)
        for turn, (factor, repeat) in enumerate(turns)
        for variant in _rotated(variants, turn)
    ]


def repeat_tag(repeat: int, repeats: int) -> str:
    """What a run's label says of its repetition: nothing, or with repeats " #1", " #2"..."""
    return f" #{repeat + 1}" if repeats > 1 else ""


def _cpu_share(
    before_s: float | None, after_s: float | None, duration_s: float, num_cpus: int
) -> float | None:
    if before_s is None or after_s is None or duration_s <= 0:
        return None
    return (after_s - before_s) / (duration_s * num_cpus)


def _rotated(names: Sequence[str], turn: int) -> list[str]:
    shift = turn % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def _calibrate(
    config: SweepConfig,
    tenants: list[tuple[str, str]],
    exit_codes: dict[str, int | None],
    log: Log,
) -> Calibration:
    """Measure what was not given, on an FCFS server with the default tiers, in
    config.num_calibrations attempts (each the probes, then a capacity run)."""
    defaults = TierTable()
    if config.slo_scale is not None and config.capacity_rps is not None:
        return calibration_of(defaults, slo_scale_given=config.slo_scale,
                              capacity_rps_given=config.capacity_rps)
    prefills, capacities = [], []
    with _started("calibration", "fcfs", defaults, config, exit_codes) as server:
        target = _target(server, tenants, config)
        premium = next((t for t, tier in tenants if tier == "premium"), tenants[0][0])
        for attempt in range(config.num_calibrations):
            log(f"calibrating ({attempt + 1} of {config.num_calibrations}), "
                f"load average {os.getloadavg()[0]:.1f}")
            if config.slo_scale is None:
                prefills.append(measure_reference_prefill_s(
                    target, premium, "premium", defaults, config.num_prefill_probes,
                    attempt=attempt,
                ))
            if config.capacity_rps is None:
                capacities.append(_capacity_run(target, config, attempt))
    return calibration_of(
        defaults,
        slo_scale_given=config.slo_scale,
        prefill_attempts_s=prefills,
        capacity_rps_given=config.capacity_rps,
        capacity_runs=capacities,
        concurrency=config.capacity_slots,
    )


def _measure_turn_capacity(
    name: str,
    config: SweepConfig,
    tenants: list[tuple[str, str]],
    exit_codes: dict[str, int | None],
    *,
    attempt: int,
    log: Log,
) -> CapacityAttempt:
    """One capacity attempt on a fresh FCFS server with the default tiers, as a calibration
    attempt (prompts of its own: attempt past the calibration's)."""
    with _started(name, "fcfs", TierTable(), config, exit_codes) as server:
        target = _target(server, tenants, config)
        record = _capacity_run(target, config, config.num_calibrations + attempt)
    capacity = CapacityAttempt.of(record)
    log(f"{name}: {capacity.capacity_rps:.3f} req/s, {capacity.output_tokens_per_s:.0f} "
        f"output tokens/s, load average {os.getloadavg()[0]:.1f}")
    return capacity


def _capacity_run(target: BenchTarget, config: SweepConfig, attempt: int) -> RunRecord:
    """One closed-loop capacity attempt (calibration.measure_capacity) on an FCFS server with
    the default tiers, sized by the config."""
    return measure_capacity(target, config.workload, TierTable(), config.capacity_slots,
                            config.num_capacity_completions, attempt=attempt)


@dataclass(frozen=True)
class _FairnessPlan:
    """One repetition of the two-tenant runs: the light tenant's requests alone, then with
    the heavy tenant's."""

    repeat: int
    light_rate_rps: float
    heavy_rate_rps: float
    alone: Workload
    shared: Workload

    @classmethod
    def of(cls, config: SweepConfig, calibration: Calibration, repeat: int) -> _FairnessPlan:
        light_rate = (
            config.fairness_load_factor * calibration.capacity_rps / (1 + config.heavy_ratio)
        )
        shared = two_tenant_workload(
            config.workload, light_rate, config.heavy_ratio, config.fairness_duration_s,
            tier=_FAIRNESS_TIER, seed=config.seed + repeat,
        )
        # Prompt seeds past the sweep's, so nothing is a prefix-cache hit from an earlier run.
        first_seed = config.workload.seed + len(config.load_factors) * config.repeats
        shared = replace(shared, seed=first_seed + 2 * repeat)
        alone = replace(
            shared, requests=[r for r in shared.requests if r.tenant == LIGHT_TENANT],
            seed=shared.seed + 1,
        )
        return cls(repeat, light_rate, config.heavy_ratio * light_rate, alone, shared)

    def run(
        self, target: BenchTarget, variant: str, tiers: TierTable, repeats: int
    ) -> FairnessRun:
        tag = repeat_tag(self.repeat, repeats)
        light_alone = target.run(self.alone, f"{variant}: light alone{tag}", tiers,
                                 self.light_rate_rps)
        both = target.run(self.shared, f"{variant}: light + heavy{tag}", tiers,
                          self.shared.rate_rps)
        return FairnessRun(variant, self.repeat, self.light_rate_rps, self.heavy_rate_rps,
                           light_alone, both)


def _target(
    server: BenchServer, tenants: list[tuple[str, str]], config: SweepConfig
) -> BenchTarget:
    return BenchTarget.provision(
        server.base_url, server.admin_token, tenants, config.vocabulary, progress=config.progress
    )


@contextlib.contextmanager
def _started(
    name: str,
    variant: str,
    tiers: TierTable,
    config: SweepConfig,
    exit_codes: dict[str, int | None],
) -> Iterator[BenchServer]:
    """A BenchServer in work_dir/name; its exit code lands in exit_codes once stopped."""
    server = BenchServer(VARIANTS[variant], tiers, config.limits, config.work_dir / name)
    server.start()
    try:
        yield server
    finally:
        exit_codes[name] = server.stop()
