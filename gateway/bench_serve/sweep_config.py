"""What a sweep does (see sweep.py): the configurations, the loads, the calibration sizes and
the fairness test. Kept apart from the sweep itself so the command line can read the
defaults without importing the load generator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.workload import Workload
from gateway.bench_serve.errors import BenchConfigError
from gateway.bench_serve.plan import ArrivalProcess, PromptVocabulary
from gateway.bench_serve.server import VARIANTS, EngineLimits

__all__ = ["SweepConfig"]


@dataclass(frozen=True)
class SweepConfig:
    """Everything a sweep does; the command line fills it."""

    workload: Workload  # the whole file; runs take its first requests
    vocabulary: PromptVocabulary  # the served model's prompt ids
    limits: EngineLimits  # model and engine flags of every server
    work_dir: Path  # one subdirectory per server: config, database, log
    variants: tuple[str, ...] = ("tiered", "fcfs", "tiered-noshed")
    load_factors: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 3.0)  # x measured capacity
    duration_s: float = 20.0  # arrivals of each run span this long
    arrivals: ArrivalProcess = ArrivalProcess.WORKLOAD
    # Closed-loop capacity run: requests kept in flight (None: the servers' max_num_seqs, a
    # full batch) and completions it counts before stopping.
    capacity_concurrency: int | None = None
    num_capacity_completions: int = 64
    num_prefill_probes: int = 5  # lone 1024-token requests for the SLO scale
    slo_scale: float | None = None  # None: measured
    capacity_rps: float | None = None  # None: measured
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
        if min(self.duration_s, self.fairness_duration_s) <= 0:
            raise BenchConfigError("durations must be positive")
        if self.num_prefill_probes < 1 or self.capacity_slots < 1:
            raise BenchConfigError("probes and capacity concurrency must be positive")
        if self.num_capacity_completions < 2:
            raise BenchConfigError("the capacity run needs at least 2 completions")
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
