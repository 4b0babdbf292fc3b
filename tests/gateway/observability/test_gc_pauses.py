"""The collector's pauses: timed by a gc callback, exposed as a histogram at scrape time."""

from __future__ import annotations

import gc
import itertools

import pytest

from gateway.observability.gc_pauses import GcPauses, process_gc_pauses
from gateway.observability.metrics import GatewayMetrics
from policies.tiers import TierTable


def _timed_full_collection(pause_s: float) -> GcPauses:
    """A recorder whose clock makes every collection last pause_s (it reads the clock twice
    per collection), installed for one forced full collection."""
    ticks = itertools.count(0.0, pause_s)
    pauses = GcPauses(clock=lambda: next(ticks))
    pauses.install()
    try:
        gc.collect(2)
    finally:
        pauses.uninstall()
    return pauses


def test_each_collection_is_timed_into_its_generation_and_bucket() -> None:
    pauses = _timed_full_collection(0.02)
    full = pauses.cumulative(2)
    assert full[-1] == ("+Inf", pytest.approx(sum(pauses.counts[2])))
    assert sum(pauses.counts[2]) >= 1  # at least the one asked for
    # 20 ms is the upper bound of its bucket (le is inclusive): nothing below it, all in it
    assert dict(full)["0.01"] == 0
    assert dict(full)["0.02"] == sum(pauses.counts[2])
    assert pauses.sums_s[2] == pytest.approx(0.02 * sum(pauses.counts[2]))
    # uninstalled: collections are no longer counted
    before = [list(c) for c in pauses.counts]
    gc.collect(2)
    assert pauses.counts == before


def test_the_metrics_expose_the_pauses_by_generation() -> None:
    pauses = _timed_full_collection(0.04)
    metrics = GatewayMetrics(TierTable(), gc_pauses=pauses)
    registry = metrics.registry
    num_full = sum(pauses.counts[2])
    labels = {"generation": "2"}
    assert registry.get_sample_value("tiergate_gc_pause_seconds_count", labels) == num_full
    assert registry.get_sample_value("tiergate_gc_pause_seconds_sum", labels) == pytest.approx(
        0.04 * num_full
    )
    assert registry.get_sample_value(
        "tiergate_gc_pause_seconds_bucket", {**labels, "le": "0.03"}
    ) == 0
    assert registry.get_sample_value(
        "tiergate_gc_pause_seconds_bucket", {**labels, "le": "0.05"}
    ) == num_full


def test_the_process_has_one_recorder_installed_once() -> None:
    first = process_gc_pauses()
    assert process_gc_pauses() is first
    assert sum(cb == first._on_collection for cb in gc.callbacks) == 1
    before = sum(first.counts[2])
    gc.collect(2)
    assert sum(first.counts[2]) == before + 1
