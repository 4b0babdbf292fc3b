"""The Redis limiter against a real redis-server: replicas share limits exactly, leases expire
with their replica, and an outage degrades as configured and heals when Redis returns."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import redis

from policies import (
    FailurePolicy,
    LimiterBackend,
    LimiterUnavailable,
    LimitName,
    RateLimited,
    RateLimitLease,
    RedisLimiterConfig,
    RedisRateLimiter,
    TenantLimits,
)
from tests.policies.conftest import ThrowawayRedis

T = TypeVar("T")

# Generous: a loaded CI machine must not turn a slow answer into a fallback mid-count.
_PATIENT = {"timeout_s": 5.0}


def _replicas(url: str, prefix: str, n: int, **config: object) -> list[RedisRateLimiter]:
    """n limiters with their own connection pools, like n gateway replicas."""
    settings = RedisLimiterConfig(key_prefix=prefix, **config)  # type: ignore[arg-type]
    return [RedisRateLimiter.from_url(url, settings) for _ in range(n)]


async def _close(limiters: list[RedisRateLimiter]) -> None:
    for limiter in limiters:
        await limiter.aclose()


async def _hammer(
    replicas: list[RedisRateLimiter], tenant: str, limits: TenantLimits, sizes: list[int]
) -> list[RateLimitLease]:
    """Attempt one admission per size, spread over the replicas, 16 in flight per replica."""
    gates = [asyncio.Semaphore(16) for _ in replicas]

    async def attempt(i: int, n: int) -> RateLimitLease | None:
        async with gates[i % len(replicas)]:
            try:
                return await replicas[i % len(replicas)].acquire(tenant, limits, n)
            except RateLimited:
                return None

    results = await asyncio.gather(*(attempt(i, n) for i, n in enumerate(sizes)))
    return [lease for lease in results if lease is not None]


def test_replicas_share_a_request_limit_exactly(redis_url: str, key_prefix: str) -> None:
    n = 150
    # a burst of n refilling at one request a minute: nothing refills during the test
    limits = TenantLimits(requests_per_minute=1, burst_requests=n)

    async def main() -> list[RateLimitLease]:
        replicas = _replicas(redis_url, key_prefix, 4, **_PATIENT)
        try:
            leases = await _hammer(replicas, "tenant-1", limits, [1] * (3 * n))
            assert all(r.is_available for r in replicas)
            return leases
        finally:
            await _close(replicas)

    leases = asyncio.run(main())
    assert len(leases) == n
    assert {lease.backend for lease in leases} == {LimiterBackend.REDIS}


def test_replicas_never_overshoot_a_token_limit(redis_url: str, key_prefix: str) -> None:
    rng = random.Random(3)
    sizes = [rng.randrange(50, 150) for _ in range(300)]
    capacity = 10_000  # about 100 of the 300 fit
    limits = TenantLimits(tokens_per_minute=1, burst_tokens=capacity)

    async def main() -> list[RateLimitLease]:
        replicas = _replicas(redis_url, key_prefix, 4, **_PATIENT)
        try:
            return await _hammer(replicas, "tenant-1", limits, sizes)
        finally:
            await _close(replicas)

    leases = asyncio.run(main())
    num_tokens = sum(lease.num_tokens_reserved for lease in leases)
    # never over; and once a request was refused the bucket held less than it asked
    assert capacity - max(sizes) < num_tokens <= capacity
    assert num_tokens >= 0.98 * capacity


def test_refusal_charges_nothing_and_release_refunds(redis_url: str, key_prefix: str) -> None:
    limits = TenantLimits(requests_per_minute=60, tokens_per_minute=6000, max_concurrent_requests=1)

    async def main() -> None:
        (limiter,) = _replicas(redis_url, key_prefix, 1, **_PATIENT)
        try:
            lease = await limiter.acquire("t", limits, 1000)
            assert lease.snapshot.requests is not None and lease.snapshot.tokens is not None
            assert lease.snapshot.requests.remaining == 59
            assert lease.snapshot.tokens.remaining == 5000
            assert lease.snapshot.num_concurrent == 1
            for _ in range(3):
                with pytest.raises(RateLimited) as refused:
                    await limiter.acquire("t", limits, 1000)
                assert refused.value.limit_name is LimitName.CONCURRENT_REQUESTS
                snapshot = refused.value.snapshot
                assert snapshot is not None and snapshot.requests and snapshot.tokens
                # nothing was charged by the refusals (a refill of under a second's worth at most)
                assert snapshot.requests.remaining == 59
                assert 5000 <= snapshot.tokens.remaining <= 5100
            released = await limiter.release(lease, num_tokens_used=300)
            assert released.num_concurrent == 0
            assert released.tokens is not None and 5700 <= released.tokens.remaining <= 5800
            twice = await limiter.release(lease, num_tokens_used=300)
            assert twice.tokens is not None and twice.tokens.remaining < 5900  # no 2nd refund
            with pytest.raises(RateLimited) as too_large:
                await limiter.acquire("t", limits, 7000)
            assert not too_large.value.should_retry
        finally:
            await limiter.aclose()

    asyncio.run(main())


def test_keys_are_hash_tagged_expire_and_use_redis_time(redis_url: str, key_prefix: str) -> None:
    limits = TenantLimits(requests_per_minute=60, tokens_per_minute=600, max_concurrent_requests=4)

    async def main() -> None:
        (limiter,) = _replicas(redis_url, key_prefix, 1, lease_ttl_s=20.0, **_PATIENT)
        try:
            await limiter.acquire("42", limits, 300)
        finally:
            await limiter.aclose()

    asyncio.run(main())
    client = redis.Redis.from_url(redis_url)
    try:
        keys = sorted(k.decode() for k in client.scan_iter(match=f"{key_prefix}:*"))
        assert keys == [f"{key_prefix}:{{42}}:{name}" for name in ("leases", "requests", "tokens")]
        # each bucket lives until it would be full again; the lease set as long as its lease
        assert 0 < client.pttl(f"{key_prefix}:{{42}}:requests") <= 1000
        assert 29_000 < client.pttl(f"{key_prefix}:{{42}}:tokens") <= 30_000
        assert 19_000 < client.pttl(f"{key_prefix}:{{42}}:leases") <= 20_000
        seconds, micros = client.time()
        stored_us = int(client.hget(f"{key_prefix}:{{42}}:tokens", "ts_us") or 0)
        assert 0 <= seconds * 1_000_000 + micros - stored_us < 5_000_000
    finally:
        client.close()


def test_a_dead_replicas_slots_expire_and_a_live_ones_are_renewed(
    redis_url: str, key_prefix: str
) -> None:
    limits = TenantLimits(max_concurrent_requests=1)

    async def main() -> None:
        alive, dead, other = _replicas(redis_url, key_prefix, 3, lease_ttl_s=0.9, **_PATIENT)
        try:
            held = await alive.acquire("live", limits, 1)
            await dead.acquire("dead", limits, 1)
            await dead.aclose()  # stops renewing without releasing: the replica died
            await asyncio.sleep(2.0)  # over 2 ttl: only renewal keeps a lease alive
            with pytest.raises(RateLimited):
                await other.acquire("live", limits, 1)
            await other.acquire("dead", limits, 1)  # the dead replica's slot freed itself
            await alive.release(held, 1)
            await other.acquire("live", limits, 1)
        finally:
            await _close([alive, other])

    asyncio.run(main())


async def _timed(call: Callable[[], Awaitable[T]]) -> tuple[T | BaseException, float]:
    """The call's result (or exception) and how long it took."""
    start = time.monotonic()
    try:
        result: T | BaseException = await call()
    except Exception as exc:
        result = exc
    return result, time.monotonic() - start


async def _until(predicate: Callable[[], Awaitable[bool]], within_s: float) -> float:
    """Seconds until predicate() holds, polled every 50 ms; fails after within_s."""
    start = time.monotonic()
    while not await predicate():
        assert time.monotonic() - start < within_s, f"not within {within_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def test_fail_open_falls_back_to_a_local_share_and_heals(
    throwaway_redis: ThrowawayRedis,
) -> None:
    limits = TenantLimits(requests_per_minute=1, burst_requests=10)
    config = {"timeout_s": 0.25, "probe_interval_s": 0.2, "num_replicas": 2}

    async def main() -> None:
        first, second = _replicas(throwaway_redis.url, "tiergate", 2, **config)
        try:
            before = await first.acquire("t", limits, 1)
            assert before.backend is LimiterBackend.REDIS
            loads_before = first.num_script_loads
            assert loads_before == 1  # the first call met NOSCRIPT and loaded the script

            throwaway_redis.kill()
            outcomes = [await _timed(lambda: first.acquire("t", limits, 1)) for _ in range(8)]
            # every call answered quickly, from the fallback holding half the burst
            assert max(seconds for _, seconds in outcomes) < 1.0  # timeout_s 0.25
            admitted = [r for r, _ in outcomes if isinstance(r, RateLimitLease)]
            refused = [r for r, _ in outcomes if isinstance(r, RateLimited)]
            assert (len(admitted), len(refused)) == (5, 3)
            assert {lease.backend for lease in admitted} == {LimiterBackend.FALLBACK}
            assert not first.is_available
            # releasing a Redis lease while Redis is away neither raises nor hangs
            released, seconds = await _timed(lambda: first.release(before, 1))
            assert not isinstance(released, BaseException) and seconds < 1.0
            await first.release(admitted[0], 1)

            throwaway_redis.start()  # empty: no keys, no scripts

            async def back_on_redis() -> bool:
                result, _ = await _timed(lambda: first.acquire("t", limits, 1))
                return isinstance(result, RateLimitLease) and result.backend is LimiterBackend.REDIS

            healed_s = await _until(back_on_redis, within_s=5.0)
            assert healed_s < 3.0
            assert first.is_available
            assert first.num_script_loads == loads_before + 1  # NOSCRIPT after the restart
            # shared again: the replicas together get the burst of 10, one already taken
            taken = 1  # before the outage
            for replica in (first, second):
                for _ in range(10):
                    with contextlib.suppress(RateLimited):
                        lease = await replica.acquire("t", limits, 1)
                        assert lease.backend is LimiterBackend.REDIS
                        taken += 1
            assert taken == 10
        finally:
            await _close([first, second])

    asyncio.run(main())


def test_fail_closed_refuses_quickly_and_heals(throwaway_redis: ThrowawayRedis) -> None:
    limits = TenantLimits(requests_per_minute=600)
    config = {
        "timeout_s": 0.25,
        "probe_interval_s": 0.2,
        "on_failure": FailurePolicy.FAIL_CLOSED,
    }

    async def main() -> None:
        (limiter,) = _replicas(throwaway_redis.url, "tiergate", 1, **config)
        try:
            await limiter.acquire("t", limits, 1)
            throwaway_redis.kill()
            for _ in range(5):
                result, seconds = await _timed(lambda: limiter.acquire("t", limits, 1))
                assert isinstance(result, LimiterUnavailable)
                assert result.retry_after_s == 0.2 and seconds < 1.0
            throwaway_redis.start()

            async def admitted() -> bool:
                result, _ = await _timed(lambda: limiter.acquire("t", limits, 1))
                return isinstance(result, RateLimitLease)

            assert await _until(admitted, within_s=5.0) < 3.0
            assert limiter.num_script_loads == 2
        finally:
            await limiter.aclose()

    asyncio.run(main())


def test_a_frozen_redis_costs_one_timeout_per_probe(throwaway_redis: ThrowawayRedis) -> None:
    """A server that accepts but never answers: no call waits much past timeout_s."""
    limits = TenantLimits(requests_per_minute=600)
    config = {"timeout_s": 0.2, "probe_interval_s": 0.5}

    async def main() -> None:
        (limiter,) = _replicas(throwaway_redis.url, "tiergate", 1, **config)
        try:
            await limiter.acquire("t", limits, 1)
            throwaway_redis.pause()
            probe, probe_s = await _timed(lambda: limiter.acquire("t", limits, 1))
            assert isinstance(probe, RateLimitLease) and probe.backend is LimiterBackend.FALLBACK
            assert 0.15 < probe_s < 1.0  # waited for the timeout, then fell back
            # until the next probe Redis is not tried at all
            _, seconds = await _timed(lambda: limiter.acquire("t", limits, 1))
            assert seconds < 0.15
            throwaway_redis.resume()

            async def back_on_redis() -> bool:
                result, _ = await _timed(lambda: limiter.acquire("t", limits, 1))
                return isinstance(result, RateLimitLease) and result.backend is LimiterBackend.REDIS

            assert await _until(back_on_redis, within_s=5.0) < 3.0
        finally:
            throwaway_redis.resume()
            await limiter.aclose()

    asyncio.run(main())
