"""The queue-wait estimate: measured rates, what the tiers above bring in, places in the batch."""

from __future__ import annotations

import pytest

from engine import SchedulerStats, TierStats
from engine.core.rates import ArrivalRates, Arrivals, StepRates
from policies.queue_wait import (
    TenantShare,
    Unseen,
    estimate_queue_wait_s,
    free_places,
    kv_places,
    place_service_rate,
    prefill_service_rate,
)


def test_arrivals_are_counted_over_the_window_and_then_forgotten() -> None:
    arrivals = ArrivalRates(window_s=5.0)
    assert arrivals.rates(0.0) == {}
    arrivals.record(0, 100, 10.0)
    # a single arrival: counted over at least a second
    assert arrivals.rates(10.0) == {0: Arrivals(1.0, 100.0)}
    arrivals.record(0, 300, 12.0)
    arrivals.record(1, 500, 13.0)
    # three seconds since the first arrival: the span is three seconds, not the window
    rates = arrivals.rates(13.0)
    assert rates[0].requests_per_s == pytest.approx(2 / 3)
    assert rates[0].prompt_tokens_per_s == pytest.approx(400 / 3)
    assert rates[1].prompt_tokens_per_s == pytest.approx(500 / 3)
    # at 15.5 the arrival at 10.0 has left the 5-s window
    assert arrivals.rates(15.5) == {0: Arrivals(0.2, 60.0), 1: Arrivals(0.2, 100.0)}
    assert arrivals.rates(30.0) == {}


def test_requests_leaving_the_batch_are_counted_per_second_of_steps() -> None:
    rates = StepRates(window_steps=4, finish_window_steps=3)
    rates.record(0, 64, 0.5)
    assert rates.finished_requests_per_s is None  # nobody has left yet
    rates.record(0, 64, 0.5, num_finished=3)
    rates.record(0, 64, 1.0, num_finished=1)
    assert rates.finished_requests_per_s == pytest.approx(4 / 2.0)
    rates.record(0, 64, 1.0, num_finished=2)  # the first step leaves the window
    assert rates.finished_requests_per_s == pytest.approx(6 / 2.5)


def _stats(**fields: object) -> SchedulerStats:
    stats = SchedulerStats(prefill_tokens_per_s=1000.0, **fields)  # type: ignore[arg-type]
    return stats


def test_a_tier_is_served_with_what_the_tiers_above_leave() -> None:
    stats = _stats(
        finished_requests_per_s=10.0,
        max_num_seqs=8,
        arrivals={0: Arrivals(6.0, 600.0), 1: Arrivals(3.0, 300.0), 2: Arrivals(50.0, 5000.0)},
    )
    assert prefill_service_rate(stats, 0) == 1000.0  # nothing above premium
    assert place_service_rate(stats, 0) == 10.0
    assert prefill_service_rate(stats, 1) == pytest.approx(400.0)  # premium's 600 come first
    assert place_service_rate(stats, 1) == pytest.approx(4.0)
    # premium and standard bring in 900 of the 1000: batch keeps the 5 % floor, not less
    assert prefill_service_rate(stats, 2) == pytest.approx(100.0)
    assert place_service_rate(stats, 2) == pytest.approx(1.0)  # 9 of 10 places, floored at 0.5
    stats.arrivals = {0: Arrivals(20.0, 2000.0)}
    assert prefill_service_rate(stats, 1) == pytest.approx(50.0)
    assert place_service_rate(stats, 1) == pytest.approx(0.5)
    # under FCFS later arrivals are behind a queued request whatever their tier
    stats.priority_preemption = False
    assert prefill_service_rate(stats, 2) == 1000.0 and place_service_rate(stats, 2) == 10.0
    assert prefill_service_rate(SchedulerStats(arrivals={0: Arrivals(1.0, 10.0)}), 1) is None
    # an unknown batch size or no request ever finished: no place rate
    assert place_service_rate(_stats(finished_requests_per_s=10.0), 1) is None
    assert place_service_rate(_stats(max_num_seqs=8), 1) is None


def _full_batch(num_premium: int, num_standard: int, **fields: object) -> SchedulerStats:
    return _stats(
        tiers={
            0: TierStats(0, "premium", num_running=num_premium),
            1: TierStats(1, "standard", num_running=num_standard),
        },
        max_num_seqs=64,
        finished_requests_per_s=16.0,
        **fields,
    )


def test_free_places_are_those_not_held_by_its_own_tier_or_above() -> None:
    stats = _full_batch(20, 40)
    assert free_places(stats, 1) == 4
    assert free_places(stats, 0) == 44  # premium preempts standard for a place
    # a standard request could not get in (no KV blocks, say): standard has no place,
    # premium still takes standard's
    stats.blocked_priority = 1
    assert free_places(stats, 1) == 0 and free_places(stats, 0) == 44
    stats.blocked_priority = 0
    assert free_places(stats, 1) == free_places(stats, 0) == 0
    stats.blocked_priority = None
    stats.priority_preemption = False  # FCFS: every running request holds its place
    assert free_places(stats, 0) == free_places(stats, 1) == 4
    stats.blocked_priority = 1  # and whoever is blocked blocks everyone behind
    assert free_places(stats, 0) == 0


def test_places_are_no_more_than_the_kv_blocks_it_may_take_would_hold() -> None:
    # 100 blocks, 30 reserved for premium; 8 requests hold 64: 8 blocks a request
    stats = _stats(
        tiers={
            0: TierStats(0, "premium", num_running=2, num_kv_blocks=10),
            1: TierStats(1, "standard", num_running=6, num_kv_blocks=54, num_waiting=10),
        },
        max_num_seqs=64,
        finished_requests_per_s=16.0,
        num_kv_blocks_total=100,
        num_kv_blocks_used=64,
        kv_reserved_blocks={0: 30},
    )
    # standard: 100 - premium's 30 reserved - its own 54 = 16 blocks, 2 requests, of the 56
    # places the batch has free; no step needs to have been blocked for it to count
    assert stats.blocked_priority is None
    assert kv_places(stats, 1) == 2 and free_places(stats, 1) == 2
    # 10 waiting ahead and itself, 2 places: 9 wait for places freeing at 16/s
    assert estimate_queue_wait_s(stats, 1, 50) == pytest.approx(9 / 16)
    # premium may take standard's blocks too: 90 blocks, 11 requests
    assert kv_places(stats, 0) == free_places(stats, 0) == 11
    # under FCFS everything held stays held (and there are no reservations)
    stats.priority_preemption = False
    stats.kv_reserved_blocks = {}
    assert kv_places(stats, 0) == kv_places(stats, 1) == 4
    # nothing running: no footprint to go by, only the batch's places count
    assert kv_places(_stats(max_num_seqs=64, num_kv_blocks_total=100), 1) is None


def test_a_full_batch_makes_short_prompts_wait_for_places_not_for_prefill() -> None:
    stats = _full_batch(24, 40, arrivals={0: Arrivals(12.0, 1200.0)})
    stats.tiers[1].num_waiting = 30
    stats.tiers[1].num_pending_prefill_tokens = 30 * 50
    # prefill: (1500 + 50) tokens at 1000 - 1200 -> the 5 % floor, 50 tokens/s: 31 s;
    # without premium arrivals: 1.55 s for the prompts, but 31 requests for places freeing
    # at 16/s: 1.94 s
    assert estimate_queue_wait_s(stats, 1, 50) == pytest.approx(1550 / 50)
    stats.arrivals = {}
    assert estimate_queue_wait_s(stats, 1, 50) == pytest.approx(31 / 16)
    # premium arriving at 12 req/s (and few tokens) leaves standard 4 places a second
    stats.arrivals = {0: Arrivals(12.0, 100.0)}
    assert estimate_queue_wait_s(stats, 1, 50) == pytest.approx(31 / 4)
    # premium itself preempts standard: 40 places are there for it
    assert estimate_queue_wait_s(stats, 0, 50) == pytest.approx(50 / 1000)
    # requests admitted since the snapshot queue too
    unseen = Unseen(tokens={(1, "a"): 100}, requests={(1, "a"): 2})
    assert estimate_queue_wait_s(stats, 1, 50, unseen=unseen) == pytest.approx(33 / 4)


def test_fair_sharing_splits_the_requests_ahead_by_tenant() -> None:
    stats = _full_batch(0, 64)
    standard = stats.tiers[1]
    standard.num_waiting = 41
    standard.num_waiting_by_tenant = {"heavy": 40, "light": 1}
    standard.num_pending_prefill_tokens = 41 * 10
    standard.pending_prefill_tokens_by_tenant = {"heavy": 400, "light": 10}
    # light: its own 1, this one, and as many of heavy's: 4 requests for places at 16/s
    assert estimate_queue_wait_s(stats, 1, 10, TenantShare("light")) == pytest.approx(4 / 16)
    # heavy: its 40, light's 1 and this one
    assert estimate_queue_wait_s(stats, 1, 10, TenantShare("heavy")) == pytest.approx(42 / 16)
    assert estimate_queue_wait_s(stats, 1, 10) == pytest.approx(42 / 16)  # no tenant: all ahead
