"""What a refused request costs (charge) and the screen before costly work, on the memory
limiter and on a real redis-server: a charge takes one request and the tokens found, never
below empty, with no slot and no refusal; the screen refuses, charging nothing, exactly when
a bucket holds no request or no token."""

from __future__ import annotations

import asyncio
import math

import pytest

from policies import (
    AdmissionController,
    FailurePolicy,
    LimitName,
    MemoryRateLimiter,
    RateLimited,
    RateLimiter,
    RedisLimiterConfig,
    RedisRateLimiter,
    TenantLimits,
    TierTable,
)
from tests.manual_clock import ManualClock
from tests.policies.conftest import ThrowawayRedis

# 6 requests and 600 tokens a minute: a charge's refill during a test is far below one unit
# of the figures compared (0.1 request, 10 tokens a second).
_LIMITS = TenantLimits(requests_per_minute=6, tokens_per_minute=600, max_concurrent_requests=1)


def _controller(limiter: RateLimiter) -> AdmissionController:
    return AdmissionController(limiter, TierTable(), None, lambda _model: None)  # type: ignore[arg-type,return-value]


async def _charges_take_what_is_there(limiter: RateLimiter) -> None:
    first = await limiter.charge("t", _LIMITS, 250)
    assert first is not None and first.requests is not None and first.tokens is not None
    assert math.floor(first.requests) == 5 and 349 <= first.tokens < 352
    assert first.num_concurrent == 0  # no slot taken
    second = await limiter.charge("t", _LIMITS, 10_000)  # more than is left: empties it
    assert second is not None and second.tokens is not None and second.tokens < 1
    for _ in range(6):  # requests run out and stay at empty
        last = await limiter.charge("t", _LIMITS, 0)
    assert last is not None and last.requests is not None and last.requests < 0.5
    peeked = await limiter.peek("t", _LIMITS)
    assert peeked is not None and peeked.requests is not None and peeked.requests >= 0


async def _screen_refuses_only_an_empty_bucket(limiter: RateLimiter) -> None:
    controller = _controller(limiter)
    lease = await limiter.acquire("s", _LIMITS, 100)  # holds the only slot
    await controller.screen("s", _LIMITS)  # a full slot is admission's business, not the screen's
    before = await limiter.peek("s", _LIMITS)
    await limiter.charge("s", _LIMITS, 10_000)  # tokens emptied
    with pytest.raises(RateLimited) as refused:
        await controller.screen("s", _LIMITS)
    assert refused.value.limit_name is LimitName.TOKENS
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
    after = await limiter.peek("s", _LIMITS)
    assert before is not None and after is not None and before.requests is not None
    assert after.requests is not None and after.requests == pytest.approx(
        before.requests - 1, abs=0.05
    )  # the charge's one request; the refused screen took nothing
    await limiter.release(lease, 100)


def test_memory_limiter_charges_and_screens() -> None:
    clock = ManualClock()

    async def main() -> None:
        await _charges_take_what_is_there(MemoryRateLimiter(clock))
        await _screen_refuses_only_an_empty_bucket(MemoryRateLimiter(clock))
        limiter = MemoryRateLimiter(clock)
        for _ in range(6):
            await limiter.charge("r", _LIMITS, 0)
        with pytest.raises(RateLimited) as refused:
            await _controller(limiter).screen("r", _LIMITS)
        assert refused.value.limit_name is LimitName.REQUESTS
        assert refused.value.retry_after_s == pytest.approx(10.0)  # one request at 0.1/s
        clock.advance(10.0)
        await _controller(limiter).screen("r", _LIMITS)  # refilled: let on

    asyncio.run(main())


def test_redis_limiter_charges_and_screens(redis_url: str, key_prefix: str) -> None:
    async def main() -> None:
        config = RedisLimiterConfig(key_prefix=key_prefix, timeout_s=5.0)
        limiter = RedisRateLimiter.from_url(redis_url, config)
        try:
            await _charges_take_what_is_there(limiter)
            await _screen_refuses_only_an_empty_bucket(limiter)
        finally:
            await limiter.aclose()

    asyncio.run(main())


def test_redis_charge_while_away_follows_the_failure_policy(
    throwaway_redis: ThrowawayRedis,
) -> None:
    async def main() -> None:
        for policy in (FailurePolicy.FAIL_OPEN, FailurePolicy.FAIL_CLOSED):
            config = RedisLimiterConfig(on_failure=policy, num_replicas=2, timeout_s=0.2)
            limiter = RedisRateLimiter.from_url(throwaway_redis.url, config)
            try:
                throwaway_redis.kill()
                assert await limiter.charge("t", _LIMITS, 50) is None  # the failed call
                charged = await limiter.charge("t", _LIMITS, 50)  # marked down: local share
                if policy is FailurePolicy.FAIL_OPEN:
                    assert charged is not None and charged.num_concurrent == 0
                    assert (charged.requests, charged.tokens) == pytest.approx((2, 250), abs=0.1)
                else:
                    assert charged is None
                # fail_closed: a screen with nothing to read lets the request on to admission,
                # which refuses it there (503)
                await _controller(limiter).screen("t", _LIMITS)
            finally:
                await limiter.aclose()
                throwaway_redis.start()

    asyncio.run(main())
