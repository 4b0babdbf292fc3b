"""Pauses of Python's cyclic garbage collector in this process, for /metrics.

A collection holds the GIL from start to end: the event loop (every refusal, every token
written to a stream) and the engine loop stand still meanwhile. The startup heap is frozen
out of its reach (`serve.freeze_startup_heap`); what requests create since is not, and under
load full collections over it came again and again, each long enough to take an ordinary
429 past its 50 ms (ops/bench/journal.md, "Runs 24 and 25").

The callback runs inside whatever allocation set the collection off, in any thread, possibly
while a prometheus_client lock is held: it only adds to plain counters, and the exposition
reads them at scrape time (`GcPauseCollector`). Collections never overlap (they run under
the GIL), so one start time serves.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

__all__ = ["PAUSE_BUCKETS_S", "GcPauseCollector", "GcPauses", "process_gc_pauses"]

# From the young collections' sub-millisecond pauses to the full ones of an unfrozen heap.
PAUSE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
NUM_GENERATIONS = 3


class GcPauses:
    """Collections and their durations by generation, counted by a gc callback."""

    def __init__(
        self,
        buckets_s: tuple[float, ...] = PAUSE_BUCKETS_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.buckets_s = buckets_s
        self._clock = clock
        # per generation: collections per bucket (the last is +Inf, not cumulative)
        self.counts = [[0] * (len(buckets_s) + 1) for _ in range(NUM_GENERATIONS)]
        self.sums_s = [0.0] * NUM_GENERATIONS
        self._started_s: float | None = None
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_collection)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_collection)
            self._installed = False

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_s = self._clock()
            return
        if self._started_s is None:  # installed during a collection
            return
        elapsed_s = self._clock() - self._started_s
        self._started_s = None
        generation = info["generation"]
        self.counts[generation][bisect.bisect_left(self.buckets_s, elapsed_s)] += 1
        self.sums_s[generation] += elapsed_s

    def cumulative(self, generation: int) -> list[tuple[str, float]]:
        """Prometheus buckets of one generation: (upper bound, collections up to it)."""
        bounds = [*(repr(b) for b in self.buckets_s), "+Inf"]
        total = 0
        out = []
        for bound, count in zip(bounds, list(self.counts[generation]), strict=True):
            total += count
            out.append((bound, float(total)))
        return out


class GcPauseCollector(Collector):
    """Exposes a GcPauses as the histogram ``tiergate_gc_pause_seconds{generation}``."""

    def __init__(self, pauses: GcPauses) -> None:
        self._pauses = pauses

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "tiergate_gc_pause_seconds",
            "Time the cyclic garbage collector held the process (event loop and engine loop "
            "alike), per collection, by generation (2: full).",
            labels=["generation"],
        )
        for generation in range(NUM_GENERATIONS):
            family.add_metric(
                [str(generation)],
                self._pauses.cumulative(generation),
                self._pauses.sums_s[generation],
            )
        yield family


_PROCESS_GC_PAUSES: GcPauses | None = None


def process_gc_pauses() -> GcPauses:
    """The process's one recorder (gc callbacks are process-wide), installed on first use."""
    global _PROCESS_GC_PAUSES
    if _PROCESS_GC_PAUSES is None:
        _PROCESS_GC_PAUSES = GcPauses()
        _PROCESS_GC_PAUSES.install()
    return _PROCESS_GC_PAUSES
