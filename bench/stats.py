"""Latency percentiles shared by the benchmarks and the simulation: nearest rank, NaN without
a sample."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Percentiles", "percentile"]


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class Percentiles:
    """Nearest-rank percentiles and mean of one latency, in seconds (NaN: no sample)."""

    p50: float
    p90: float
    p99: float
    mean: float
    num_samples: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        ordered = sorted(values)
        mean = statistics.fmean(ordered) if ordered else math.nan
        return cls(
            percentile(ordered, 50), percentile(ordered, 90), percentile(ordered, 99), mean,
            len(ordered),
        )
