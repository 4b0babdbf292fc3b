"""What a sweep does (see sweep.py): the configurations, the loads, the calibration sizes and
the fairness test. Kept apart from the sweep itself so the command line can read the
defaults without importing the load generator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.serve.errors import BenchConfigError
from bench.serve.plan import ArrivalProcess, PromptVocabulary
from bench.serve.server import VARIANTS, EngineLimits
from bench.workload import Workload
from policies import TierTable

__all__ = ["MIN_RUN_DURATION_S", "OBJECTIVES_PER_RUN", "SweepConfig", "run_duration_s"]

# A load run's arrivals span OBJECTIVES_PER_RUN of the slowest scaled TTFT objective, at least
# MIN_RUN_DURATION_S. The objectives scale with the host (calibration.py); a fixed window
# would make a slow host's overload a shorter one in units of its own objectives, and the
# policies' comparison at 2x-3x depends on that ratio: FCFS's requests within objective are
# the ones sent before its queue outgrows the objective, a fixed count, while a shedding
# policy's grow with the window (ops/bench/journal.md, "Why standard goodput moves").
OBJECTIVES_PER_RUN = 5.0
MIN_RUN_DURATION_S = 20.0


def run_duration_s(tiers: TierTable) -> float:
    """Seconds of arrivals of each load run for these (scaled) tiers."""
    objectives = [t.ttft_slo_s for t in tiers if t.ttft_slo_s is not None]
    return max([MIN_RUN_DURATION_S, *(OBJECTIVES_PER_RUN * s for s in objectives)])


@dataclass(frozen=True)
class SweepConfig:
    """Everything a sweep does; the command line fills it."""

    workload: Workload  # the whole file; runs take its first requests
    vocabulary: PromptVocabulary  # the served model's prompt ids
    limits: EngineLimits  # model and engine flags of every server
    work_dir: Path  # one subdirectory per server: config, database, log
    variants: tuple[str, ...] = ("tiered", "fcfs", "tiered-noshed")
    load_factors: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 3.0)  # x measured capacity
    duration_s: float | None = None  # arrivals of each run span this long; None: run_duration_s
    arrivals: ArrivalProcess = ArrivalProcess.WORKLOAD
    # Closed-loop capacity run: requests kept in flight (None: the servers' max_num_seqs, a
    # full batch) and completions it counts before stopping.
    capacity_concurrency: int | None = None
    num_capacity_completions: int = 64
    num_prefill_probes: int = 5  # lone 1024-token requests for the SLO scale
    # Calibration attempts (prefill probes, then a capacity run); the middle one of each kept.
    num_calibrations: int = 3
    # Every load's runs, and the fairness test, this many times: one repetition of every
    # configuration, then the next, the order alternating (sweep.py).
    repeats: int = 1
    slo_scale: float | None = None  # None: measured
    capacity_rps: float | None = None  # None: measured
    # Measure the capacity again before every turn and offer that turn's loads as multiples
    # of it (sweep.py); the fairness test keeps the calibration's.
    capacity_each_turn: bool = False
    fairness_variants: tuple[str, ...] = ("tiered", "fcfs")  # empty: no fairness runs
    fairness_load_factor: float = 1.5  # light + heavy, x measured capacity
    fairness_duration_s: float = 40.0  # arrivals of each fairness run span this long
    heavy_ratio: float = 10.0  # heavy tenant's rate over the light tenant's
    seed: int = 0  # Poisson arrivals (when chosen) and the fairness tenants' arrivals
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = [v for v in (*self.variants, *self.fairness_variants) if v not in VARIANTS]
        if unknown:
            raise BenchConfigError(
                f"unknown configuration(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}"
            )
        if not self.variants or not set(self.fairness_variants) <= set(self.variants):
            raise BenchConfigError("fairness configurations must be among the configurations")
        if not self.load_factors or min(self.load_factors) <= 0:
            raise BenchConfigError("load factors must be positive")
        if self.fairness_duration_s <= 0 or (self.duration_s is not None and self.duration_s <= 0):
            raise BenchConfigError("durations must be positive")
        if self.num_prefill_probes < 1 or self.capacity_slots < 1:
            raise BenchConfigError("probes and capacity concurrency must be positive")
        if self.num_calibrations < 1 or self.repeats < 1:
            raise BenchConfigError("calibration attempts and repeats must be at least 1")
        if self.num_capacity_completions < 2:
            raise BenchConfigError("the capacity run needs at least 2 completions")
        if self.capacity_each_turn and self.capacity_rps is not None:
            raise BenchConfigError("a capacity measured every turn cannot also be given")
        for name in ("slo_scale", "capacity_rps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise BenchConfigError(f"{name} must be positive, got {value}")

    @property
    def capacity_slots(self) -> int:
        """Requests the capacity run keeps in flight."""
        if self.capacity_concurrency is None:
            return self.limits.max_num_seqs
        return self.capacity_concurrency
