"""fail_open and the other replicas: a replica that falls back to its local share leaves the
slots the other replicas held at its last Redis answer (for fallback_view_s), and the leases
it admitted locally are adopted into Redis once it answers again, so the others count them.
Against a throwaway redis-server, paused to make the replica fall back."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio

from policies import (
    FailurePolicy,
    LimiterBackend,
    RateLimited,
    RedisLimiterConfig,
    RedisRateLimiter,
    TenantLimits,
)
from tests.manual_clock import ManualClock
from tests.policies.conftest import ThrowawayRedis

PREFIX = "tiergate"
# Short enough to find a paused Redis quickly; lease renewals come after the test.
_CONFIG = {"timeout_s": 0.2, "lease_ttl_s": 300.0, "num_replicas": 3,
           "on_failure": FailurePolicy.FAIL_OPEN, "key_prefix": PREFIX}


def _limiter(url: str, clock: ManualClock | None = None) -> RedisRateLimiter:
    config = RedisLimiterConfig(**_CONFIG)  # type: ignore[arg-type]
    client = redis.asyncio.Redis.from_url(url, **RedisRateLimiter.client_options(config))
    return RedisRateLimiter(client, config, clock=clock or time.monotonic, owns_client=True)


async def _leases(client: redis.asyncio.Redis, tenant: str) -> set[str]:
    ids = await client.zrange(f"{PREFIX}:{{{tenant}}}:leases", 0, -1)
    return {i.decode() for i in ids}


async def _until(condition: object, within_s: float = 5.0) -> None:
    deadline_s = time.monotonic() + within_s
    while not await condition():  # type: ignore[operator]
        assert time.monotonic() < deadline_s, f"not within {within_s} s"
        await asyncio.sleep(0.02)


def test_local_leases_are_adopted_into_redis_and_dropped_when_they_end(
    throwaway_redis: ThrowawayRedis,
) -> None:
    limits = TenantLimits(max_concurrent_requests=6)
    clock = ManualClock()

    async def main() -> None:
        fell_back, other = _limiter(throwaway_redis.url, clock), _limiter(throwaway_redis.url)
        direct = redis.asyncio.Redis.from_url(throwaway_redis.url, socket_timeout=5)
        try:
            throwaway_redis.pause()
            local = [await fell_back.acquire("t", limits, 1) for _ in range(2)]
            assert {lease.backend for lease in local} == {LimiterBackend.FALLBACK}
            throwaway_redis.resume()
            clock.advance(1.0)
            probe = await fell_back.acquire("t", limits, 1)  # Redis again: the local two adopted
            assert probe.backend is LimiterBackend.REDIS

            async def adopted() -> bool:
                return {lease.lease_id for lease in local} <= await _leases(direct, "t")

            await _until(adopted)
            # 3 slots held in Redis: the other replica gets the 3 left, not 5
            taken = 0
            for _ in range(6):
                try:
                    await other.acquire("t", limits, 1)
                    taken += 1
                except RateLimited:
                    pass
            assert taken == 3
            await fell_back.release(local[0], 1)

            async def dropped() -> bool:
                return local[0].lease_id not in await _leases(direct, "t")

            await _until(dropped)
            await other.acquire("t", limits, 1)  # its slot is free for every replica
        finally:
            throwaway_redis.resume()
            await direct.aclose()
            for limiter in (fell_back, other):
                await limiter.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("seconds_since", [0.0, 6.0])
def test_the_local_share_leaves_what_the_others_held_at_the_last_answer(
    throwaway_redis: ThrowawayRedis, seconds_since: float
) -> None:
    """A limit of 6, a share of 2 a replica: 5 slots held by another replica at the watched
    replica's last answer (which took the 6th). Redis then stalls: within fallback_view_s
    (5 s) the watched replica's share is what the limit leaves, 1, which its Redis lease
    fills; past it, the plain share of 2 admits one more locally."""
    limits = TenantLimits(max_concurrent_requests=6)
    clock = ManualClock()

    async def main() -> None:
        watched, other = _limiter(throwaway_redis.url, clock), _limiter(throwaway_redis.url)
        try:
            for _ in range(5):
                await other.acquire("t", limits, 1)
            assert (await watched.acquire("t", limits, 1)).backend is LimiterBackend.REDIS
            clock.advance(seconds_since)
            throwaway_redis.pause()
            if seconds_since < 5.0:
                with pytest.raises(RateLimited):
                    await watched.acquire("t", limits, 1)
            else:
                lease = await watched.acquire("t", limits, 1)
                assert lease.backend is LimiterBackend.FALLBACK
            assert not watched.is_available
        finally:
            throwaway_redis.resume()
            for limiter in (watched, other):
                await limiter.aclose()

    asyncio.run(main())
