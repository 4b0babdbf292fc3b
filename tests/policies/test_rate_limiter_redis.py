"""The Redis limiter against a real redis-server: replicas share limits exactly, leases expire
with their replica, and an outage degrades as configured and heals when Redis returns."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from policies import (
    FailurePolicy,
    KeyLimits,
    KeyRateLimited,
    LimiterBackend,
    LimiterUnavailable,
    LimitName,
    RateLimited,
    RateLimitLease,
    RedisLimiterConfig,
    RedisRateLimiter,
    TenantLimits,
)
from policies.rate_limits import EMPTY_SNAPSHOT
from tests.manual_clock import ManualClock
from tests.policies.conftest import ThrowawayRedis

T = TypeVar("T")

# Generous: a loaded CI machine must not turn a slow answer into a fallback mid-count.
_PATIENT = {"timeout_s": 5.0}
# Outage tests: as patient while Redis is up; a lost Redis is probed only when the test moves
# its clock; leases renew every 100 s, after the test, so every script call is the test's own.
_OUTAGE = {**_PATIENT, "probe_interval_s": 1.0, "lease_ttl_s": 300.0}


def _replicas(url: str, prefix: str, n: int, **config: object) -> list[RedisRateLimiter]:
    """n limiters with their own connection pools, like n gateway replicas."""
    settings = RedisLimiterConfig(key_prefix=prefix, **config)  # type: ignore[arg-type]
    return [RedisRateLimiter.from_url(url, settings) for _ in range(n)]


async def _close(limiters: list[RedisRateLimiter]) -> None:
    for limiter in limiters:
        await limiter.aclose()


class _CountingRedis(AsyncRedis):
    """A client that counts the script calls it sends: a test can then say Redis was (not)
    tried rather than time how long a call took."""

    num_script_calls = 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] == "EVALSHA":
            self.num_script_calls += 1
        return await super().execute_command(*args, **options)


def _probed_by_hand(
    url: str, clock: ManualClock, **config: object
) -> tuple[RedisRateLimiter, _CountingRedis]:
    """A limiter that probes a lost Redis only when clock has moved on, and its counting
    client, with the options RedisRateLimiter.from_url gives its own."""
    settings = RedisLimiterConfig(**config)  # type: ignore[arg-type]
    client = _CountingRedis.from_url(url, **RedisRateLimiter.client_options(settings))
    return RedisRateLimiter(client, settings, clock=clock, owns_client=True), client


async def _outcome(call: Callable[[], Awaitable[T]]) -> T | Exception:
    """The call's result or exception."""
    try:
        return await call()
    except Exception as exc:
        return exc


async def _until(predicate: Callable[[], Awaitable[bool]], within_s: float) -> None:
    """Poll predicate() every 50 ms until it holds; fails after within_s."""
    deadline_s = time.monotonic() + within_s
    while not await predicate():
        assert time.monotonic() < deadline_s, f"not within {within_s} s"
        await asyncio.sleep(0.05)


def _us(time_reply: tuple[int, int]) -> int:
    """Microseconds since the epoch from a Redis TIME reply."""
    seconds, micros = time_reply
    return seconds * 1_000_000 + micros


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
    # full bursts refilling at one unit a minute: the counts below are exact for a minute
    limits = TenantLimits(
        requests_per_minute=1,
        burst_requests=60,
        tokens_per_minute=1,
        burst_tokens=6000,
        max_concurrent_requests=1,
    )

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
                # nothing was charged by the refusals
                assert snapshot.requests.remaining == 59
                assert snapshot.tokens.remaining == 5000
            released = await limiter.release(lease, num_tokens_used=300)
            assert released.num_concurrent == 0
            assert released.tokens is not None and released.tokens.remaining == 5700
            twice = await limiter.release(lease, num_tokens_used=300)
            assert twice.tokens is not None and twice.tokens.remaining == 5700  # no 2nd refund
            with pytest.raises(RateLimited) as too_large:
                await limiter.acquire("t", limits, 7000)
            assert not too_large.value.should_retry
        finally:
            await limiter.aclose()

    asyncio.run(main())


def test_a_keys_own_limits_bind_first_across_replicas_and_charge_all_or_nothing(
    redis_url: str, key_prefix: str
) -> None:
    """Two replicas share a key's 5 RPM inside its tenant's 100: the key gets 5 requests
    in all, its refusals charge the tenant nothing, the tenant's charge its key nothing,
    and a release refunds both tokens buckets."""
    tenant = TenantLimits(
        requests_per_minute=1, burst_requests=100, tokens_per_minute=1, burst_tokens=1000
    )
    capped = KeyLimits("7", requests_per_minute=5, tokens_per_minute=60)
    roomy = KeyLimits("8", tokens_per_minute=1200)  # refills 20 tokens a second

    async def attempt(replica: RedisRateLimiter) -> RateLimitLease | KeyRateLimited:
        try:
            return await replica.acquire("t", tenant, 10, key=capped)
        except KeyRateLimited as refused:
            return refused

    async def main() -> None:
        replicas = _replicas(redis_url, key_prefix, 2, **_PATIENT)
        try:
            outcomes = await asyncio.gather(*(attempt(replicas[i % 2]) for i in range(20)))
            leases = [o for o in outcomes if isinstance(o, RateLimitLease)]
            refusals = [o for o in outcomes if isinstance(o, KeyRateLimited)]
            assert len(leases) == 5 and len(refusals) == 15
            for refused in refusals:
                assert refused.code == "key_rate_limit_exceeded"
                assert refused.limit_name is LimitName.REQUESTS
                # the headers show the key's bucket, the one that bound
                assert refused.snapshot is not None and refused.snapshot.requests is not None
                assert refused.snapshot.requests.limit == 5
            # only the five admitted were charged to the tenant
            levels = await replicas[1].peek("t", tenant, capped)
            assert levels is not None
            assert levels.requests == pytest.approx(95, abs=0.2)
            assert levels.tokens == pytest.approx(950, abs=0.2)
            assert levels.key_requests == pytest.approx(0, abs=0.5)
            # another key of the tenant still passes, on either replica
            other = await replicas[0].acquire("t", tenant, 900, key=roomy)
            # the tenant's tokens refuse the next one: the key's bucket is left full
            with pytest.raises(RateLimited) as tenant_refused:
                await replicas[1].acquire("t", tenant, 100, key=roomy)
            assert not isinstance(tenant_refused.value, KeyRateLimited)
            assert tenant_refused.value.code is None
            levels = await replicas[1].peek("t", tenant, roomy)
            # 300 left after the 900 and refilling: not 100 less (the refused request)
            assert levels is not None and levels.key_tokens is not None
            assert 300 - 0.5 <= levels.key_tokens < 380
            assert levels.requests == pytest.approx(94, abs=0.2)
            # a release refunds the unused tokens to the tenant's bucket and to the key's
            before = await replicas[0].peek("t", tenant, capped)
            await replicas[1].release(leases[0], num_tokens_used=4)
            after = await replicas[0].peek("t", tenant, capped)
            assert before is not None and after is not None
            assert before.tokens is not None and after.tokens is not None
            assert before.key_tokens is not None and after.key_tokens is not None
            assert after.tokens - before.tokens == pytest.approx(6, abs=0.2)
            assert after.key_tokens - before.key_tokens == pytest.approx(6, abs=0.5)
            await replicas[0].release(other, num_tokens_used=900)
            for lease in leases[1:]:
                await replicas[0].release(lease, num_tokens_used=10)
        finally:
            await _close(replicas)

    asyncio.run(main())


def test_a_cancelled_admission_gives_everything_back_or_never_runs(
    redis_url: str, key_prefix: str
) -> None:
    """admit.lua's cancel, for an admission whose reply timed out: if it ran, its lease,
    request and tokens come back; if it has not run yet, it does nothing when it does."""
    limits = TenantLimits(
        requests_per_minute=1, burst_requests=60, tokens_per_minute=1, burst_tokens=6000,
        max_concurrent_requests=2,
    )

    async def main() -> None:
        (limiter,) = _replicas(redis_url, key_prefix, 1, **_PATIENT)
        try:
            ran = limiter._args("admit", limits, 1000, "ran")
            assert int((await limiter._run("t", ran))[0]) == 1
            assert int((await limiter._run("t", ["cancel", *ran[1:]]))[0]) == 1
            late = limiter._args("admit", limits, 1000, "late")
            assert int((await limiter._run("t", ["cancel", *late[1:]]))[0]) == 0
            assert int((await limiter._run("t", late))[0]) == 0  # arrives after: nothing
            levels = await limiter.peek("t", limits)
            assert levels is not None
            assert (levels.requests, levels.tokens, levels.num_concurrent) == (
                pytest.approx(60, abs=0.1), pytest.approx(6000, abs=1), 0
            )
        finally:
            await limiter.aclose()

    asyncio.run(main())


def test_keys_are_hash_tagged_expire_and_use_redis_time(redis_url: str, key_prefix: str) -> None:
    # a request refills in 60 s, the 300 tokens in 30 s: no stall outlives a key
    limits = TenantLimits(
        requests_per_minute=1,
        burst_requests=60,
        tokens_per_minute=600,
        max_concurrent_requests=4,
    )
    assert limits.requests_bucket is not None and limits.tokens_bucket is not None
    expected_pttl_ms = {
        # until full again, as admit.lua computes it (same doubles, same rounding)
        "requests": math.ceil(1 / limits.requests_bucket.rate_per_s * 1000),
        "tokens": math.ceil(300 / limits.tokens_bucket.rate_per_s * 1000),
        "leases": 20_000,  # the lease's ttl
    }

    async def main() -> None:
        (limiter,) = _replicas(redis_url, key_prefix, 1, lease_ttl_s=20.0, **_PATIENT)
        try:
            await limiter.acquire("42", limits, 300)
        finally:
            await limiter.aclose()

    client = redis.Redis.from_url(redis_url)
    try:
        # everything below happened between before_us and after_us on Redis's clock
        before_us = _us(client.time())
        asyncio.run(main())
        keys = sorted(k.decode() for k in client.scan_iter(match=f"{key_prefix}:*"))
        assert keys == [f"{key_prefix}:{{42}}:{name}" for name in sorted(expected_pttl_ms)]
        pttl_ms = {name: client.pttl(f"{key_prefix}:{{42}}:{name}") for name in expected_pttl_ms}
        stored_us = int(client.hget(f"{key_prefix}:{{42}}:tokens", "ts_us") or 0)
        after_us = _us(client.time())
        # each key expires when its bucket would be full again (the lease set with its lease):
        # set at most window_ms before it was read
        window_ms = after_us // 1000 - before_us // 1000
        for name, expected_ms in expected_pttl_ms.items():
            assert expected_ms - window_ms - 1 <= pttl_ms[name] <= expected_ms, name
        assert before_us <= stored_us <= after_us
    finally:
        client.close()


def test_a_dead_replicas_slots_expire_and_a_live_ones_are_renewed(
    redis_url: str, key_prefix: str
) -> None:
    limits = TenantLimits(max_concurrent_requests=1)
    # renewed every ttl/3: only a stall of over 2/3 ttl could let the live lease lapse
    ttl_s = 5.0

    async def main() -> None:
        alive, dead, other = _replicas(redis_url, key_prefix, 3, lease_ttl_s=ttl_s, **_PATIENT)
        client = AsyncRedis.from_url(redis_url, socket_timeout=_PATIENT["timeout_s"])
        live_leases = f"{key_prefix}:{{live}}:leases"
        try:
            held = await alive.acquire("live", limits, 1)
            first_expiry_ms = await client.zscore(live_leases, held.lease_id)
            await dead.acquire("dead", limits, 1)
            await dead.aclose()  # stops renewing without releasing: the replica died

            async def dead_slot_freed() -> bool:
                try:
                    await other.acquire("dead", limits, 1)
                except RateLimited:
                    return False
                return True

            await _until(dead_slot_freed, within_s=30.0)
            # the dead lease was taken after the live one with the same ttl, so the live
            # one's first expiry has passed too: only renewal kept it
            assert _us(await client.time()) // 1000 >= first_expiry_ms
            renewed_expiry_ms = await client.zscore(live_leases, held.lease_id)
            assert renewed_expiry_ms is not None and renewed_expiry_ms > first_expiry_ms
            with pytest.raises(RateLimited):
                await other.acquire("live", limits, 1)
            await alive.release(held, 1)
            await other.acquire("live", limits, 1)
        finally:
            await client.aclose()
            await _close([alive, other])

    asyncio.run(main())


def test_fail_open_falls_back_to_a_local_share_and_heals(
    throwaway_redis: ThrowawayRedis,
) -> None:
    limits = TenantLimits(requests_per_minute=1, burst_requests=10)
    clock = ManualClock()

    async def main() -> None:
        first, client = _probed_by_hand(throwaway_redis.url, clock, num_replicas=2, **_OUTAGE)
        (second,) = _replicas(throwaway_redis.url, "tiergate", 1, num_replicas=2, **_PATIENT)
        try:
            before = await first.acquire("t", limits, 1)
            assert before.backend is LimiterBackend.REDIS
            loads_before = first.num_script_loads
            assert loads_before == 1  # the first call met NOSCRIPT and loaded the script

            throwaway_redis.kill()
            num_calls = client.num_script_calls
            outcomes = [await _outcome(lambda: first.acquire("t", limits, 1)) for _ in range(8)]
            # the first call found Redis gone; the others, before the next probe, did not try it
            assert client.num_script_calls == num_calls + 1
            # all were answered by the fallback holding half the burst
            admitted = [r for r in outcomes if isinstance(r, RateLimitLease)]
            refused = [r for r in outcomes if isinstance(r, RateLimited)]
            assert (len(admitted), len(refused)) == (5, 3)
            assert {lease.backend for lease in admitted} == {LimiterBackend.FALLBACK}
            assert not first.is_available
            # releasing a Redis lease as the probe: Redis is still away, and it does not raise
            clock.advance(_OUTAGE["probe_interval_s"])
            assert await first.release(before, 1) == EMPTY_SNAPSHOT
            assert client.num_script_calls == num_calls + 2 and not first.is_available
            await first.release(admitted[0], 1)

            throwaway_redis.start()  # empty: no keys, no scripts
            # back, but not tried before the next probe: the fallback's share is spent
            with pytest.raises(RateLimited):
                await first.acquire("t", limits, 1)
            assert client.num_script_calls == num_calls + 2
            clock.advance(_OUTAGE["probe_interval_s"])
            probe = await first.acquire("t", limits, 1)
            assert probe.backend is LimiterBackend.REDIS and first.is_available
            # NOSCRIPT after the restart (the releases retried in the background may meet
            # it too, and load the script as well)
            assert first.num_script_loads >= loads_before + 1
            # shared again: the replicas together get the burst of 10, the probe took one
            taken = 1
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


def test_fail_closed_refuses_without_trying_redis_and_heals(
    throwaway_redis: ThrowawayRedis,
) -> None:
    limits = TenantLimits(requests_per_minute=600)
    clock = ManualClock()

    async def main() -> None:
        limiter, client = _probed_by_hand(
            throwaway_redis.url, clock, on_failure=FailurePolicy.FAIL_CLOSED, **_OUTAGE
        )
        try:
            await limiter.acquire("t", limits, 1)
            throwaway_redis.kill()
            num_calls = client.num_script_calls
            for _ in range(5):
                with pytest.raises(LimiterUnavailable) as refused:
                    await limiter.acquire("t", limits, 1)
                assert refused.value.retry_after_s == _OUTAGE["probe_interval_s"]
            # the first found Redis gone; the others were refused without trying it
            assert client.num_script_calls == num_calls + 1
            throwaway_redis.start()
            with pytest.raises(LimiterUnavailable):  # back, but not before the next probe
                await limiter.acquire("t", limits, 1)
            assert client.num_script_calls == num_calls + 1
            clock.advance(_OUTAGE["probe_interval_s"])
            lease = await limiter.acquire("t", limits, 1)  # the probe, admitted by Redis
            assert lease.backend is LimiterBackend.REDIS and limiter.is_available
            assert limiter.num_script_loads == 2
        finally:
            await limiter.aclose()

    asyncio.run(main())


def test_a_frozen_redis_costs_one_timeout_per_probe(throwaway_redis: ThrowawayRedis) -> None:
    """A server that accepts but never answers: the call that finds it waits timeout_s once,
    then falls back; until the next probe Redis is not tried."""
    limits = TenantLimits(requests_per_minute=600)
    clock = ManualClock()
    timeout_s = _OUTAGE["timeout_s"]

    async def main() -> None:
        limiter, client = _probed_by_hand(throwaway_redis.url, clock, **_OUTAGE)
        try:
            await limiter.acquire("t", limits, 1)
            throwaway_redis.pause()
            num_calls = client.num_script_calls
            start_s = time.monotonic()
            lease = await limiter.acquire("t", limits, 1)
            waited_s = time.monotonic() - start_s
            assert lease.backend is LimiterBackend.FALLBACK and not limiter.is_available
            assert client.num_script_calls == num_calls + 1
            # it waited for the timeout, and only once: a retry would take 2 * timeout_s
            assert 0.9 * timeout_s < waited_s < 2 * timeout_s
            lease = await limiter.acquire("t", limits, 1)
            assert lease.backend is LimiterBackend.FALLBACK
            assert client.num_script_calls == num_calls + 1  # not tried: no wait
            throwaway_redis.resume()
            clock.advance(_OUTAGE["probe_interval_s"])
            lease = await limiter.acquire("t", limits, 1)  # the probe
            assert lease.backend is LimiterBackend.REDIS and limiter.is_available
        finally:
            throwaway_redis.resume()
            await limiter.aclose()

    asyncio.run(main())
