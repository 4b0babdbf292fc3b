"""Shedding counts its own admissions until the engine shows them; limiter peeks."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from engine import SchedulerStats, TierStats
from policies import (
    FailurePolicy,
    MemoryRateLimiter,
    RedisLimiterConfig,
    RedisRateLimiter,
    ShedConfig,
    SloShedder,
    TenantLimits,
    TierTable,
)
from tests.manual_clock import ManualClock
from tests.policies.conftest import ThrowawayRedis

RATE = 1000.0


def _stats(
    pending: dict[int, int], taken_in_at_s: float | None = None, step_s: float | None = None
) -> SchedulerStats:
    names = {0: "premium", 1: "standard", 2: "batch"}
    tiers = {
        p: TierStats(p, names[p], num_waiting=1, num_pending_prefill_tokens=n)
        for p, n in pending.items()
    }
    if 0 in tiers:
        tiers[0].num_kv_blocks, tiers[0].num_kv_blocks_reserved = 300, 300
    return SchedulerStats(
        tiers=tiers,
        num_kv_blocks_total=1000,
        num_kv_blocks_used=1000,
        prefill_tokens_per_s=RATE,
        mean_step_time_s=step_s,
        taken_in_at_s=taken_in_at_s,
    )


def test_admissions_count_until_the_engine_statistics_show_them() -> None:
    clock = ManualClock()
    shedder = SloShedder(TierTable(), clock=clock)
    stats = _stats({}, taken_in_at_s=clock(), step_s=0.05)
    clock.advance(0.01)
    # 100-token prompts against 1.6 s at 1000 tokens/s: 16 fit in one step's stale snapshot
    for _ in range(16):
        assert shedder.check(stats, "standard", 100) is None
        shedder.admitted("standard", 100)
    shed = shedder.check(stats, "standard", 100)
    assert shed is not None and shed.estimated_wait_s == pytest.approx(1.7)
    # batch admissions are not ahead of standard (they are under FCFS)
    shedder.admitted("batch", 10_000)
    # statistics of a step that took requests in before them do not have them, however long
    # that step took (a long prefill step's statistics come out long after its start)
    clock.advance(2.0)
    assert shedder.check(stats, "standard", 100)
    # those of the step that took them in do
    assert shedder.check(replace(stats, taken_in_at_s=clock()), "standard", 100) is None
    # statistics not published by the engine loop say nothing: counted for at most 10 s
    shedder.admitted("standard", 1600)
    unknown = replace(stats, taken_in_at_s=None)
    assert shedder.check(unknown, "standard", 100) is not None
    clock.advance(10.1)
    assert shedder.check(unknown, "standard", 100) is None


def test_a_prompt_over_the_threshold_is_admitted_when_nothing_is_ahead() -> None:
    shedder = SloShedder(TierTable(), clock=ManualClock())
    assert shedder.check(_stats({}), "standard", 5000) is None  # 5 s alone, 1.6 s threshold
    shed = shedder.check(_stats({1: 300}), "standard", 5000)
    assert shed is not None and shed.retry_after_s == pytest.approx(0.3)  # until nothing ahead


def test_shed_requests_are_promised_retry_times_one_prompt_apart() -> None:
    clock = ManualClock()
    shedder = SloShedder(TierTable(), ShedConfig(slo_fraction=0.8), clock=clock)
    stats = _stats({1: 3000}, step_s=0.05)  # 3.1 s for a 100-token prompt, 1.6 s threshold
    retries = [shedder.check(stats, "standard", 100) for _ in range(3)]
    # a 1.6 s drain (to its own 0.1 s prompt under the threshold) plus one step (the
    # statistics' age), then one 0.1 s prompt apart
    assert [r.retry_after_s for r in retries if r] == pytest.approx([1.65, 1.75, 1.85])
    clock.advance(10)  # promises due long ago take nothing from a new one
    again = shedder.check(stats, "standard", 100)
    assert again is not None and again.retry_after_s == pytest.approx(1.65)


def test_memory_peek_charges_nothing() -> None:
    limiter = MemoryRateLimiter(ManualClock())
    limits = TenantLimits(requests_per_minute=60, tokens_per_minute=6000)
    fresh = limiter.peek_now("a", limits)
    assert fresh.requests == 60 and fresh.tokens == 6000 and fresh.num_concurrent == 0
    lease = limiter.acquire_now("a", limits, 1000)
    assert limiter.peek_now("a", limits).snapshot(limits) == lease.snapshot
    assert limiter.peek_now("a", limits).snapshot(limits) == lease.snapshot


def test_redis_peek_charges_nothing_and_follows_the_failure_policy(
    redis_url: str, key_prefix: str, throwaway_redis: ThrowawayRedis
) -> None:
    limits = TenantLimits(requests_per_minute=1, burst_requests=10, max_concurrent_requests=3)

    async def main() -> None:
        limiter = RedisRateLimiter.from_url(
            redis_url, RedisLimiterConfig(key_prefix=key_prefix, timeout_s=5.0)
        )
        try:
            lease = await limiter.acquire("t", limits, 1)
            for _ in range(2):
                peeked = await limiter.peek("t", limits)
                assert peeked is not None and peeked.requests is not None
                assert int(peeked.requests) == 9 and peeked.num_concurrent == 1
            assert lease.snapshot.requests is not None and lease.snapshot.requests.remaining == 9
        finally:
            await limiter.aclose()
        for policy, expected in ((FailurePolicy.FAIL_OPEN, 5), (FailurePolicy.FAIL_CLOSED, None)):
            config = RedisLimiterConfig(on_failure=policy, num_replicas=2, timeout_s=0.2)
            down = RedisRateLimiter.from_url(throwaway_redis.url, config)
            try:
                throwaway_redis.kill()
                assert await down.peek("t", limits) is None  # the failed call itself
                share = await down.peek("t", limits)  # marked down: no Redis call
                remaining = None if share is None or share.requests is None else int(
                    share.requests
                )
                assert remaining == expected
            finally:
                await down.aclose()
                throwaway_redis.start()

    asyncio.run(main())


def test_admissions_of_tiers_never_shed_do_not_pile_up() -> None:
    clock = ManualClock()
    shedder = SloShedder(TierTable(), clock=clock)
    for _ in range(1000):
        shedder.admitted("batch", 100)
        clock.advance(0.1)
    fcfs = replace(_stats({}), priority_preemption=False)
    # under FCFS batch is ahead of standard: only the last 10 s of admissions still count
    shed = shedder.check(fcfs, "standard", 0)
    assert shed is not None and shed.estimated_wait_s == pytest.approx(10.0, abs=0.15)
