"""The in-process limiter: exact request, token and concurrency limits, bursts and refunds."""

from __future__ import annotations

import asyncio
import random

import pytest

from policies import (
    KeyLimits,
    KeyRateLimited,
    LimiterBackend,
    LimitName,
    MemoryRateLimiter,
    RateLimited,
    RefusalReason,
    TenantLimits,
)
from tests.manual_clock import ManualClock


def _admitted(limiter: MemoryRateLimiter, tenant: str, limits: TenantLimits, n: int) -> bool:
    try:
        limiter.acquire_now(tenant, limits, n)
    except RateLimited:
        return False
    return True


def test_n_requests_per_window_exactly() -> None:
    clock = ManualClock()
    limiter = MemoryRateLimiter(clock)
    limits = TenantLimits(requests_per_minute=60)
    assert sum(_admitted(limiter, "a", limits, 1) for _ in range(100)) == 60
    with pytest.raises(RateLimited) as refused:
        limiter.acquire_now("a", limits, 1)
    assert refused.value.limit_name is LimitName.REQUESTS
    assert refused.value.retry_after_s == pytest.approx(1.0)
    assert refused.value.reset_s == pytest.approx(60.0)
    clock.advance(0.999)
    assert not _admitted(limiter, "a", limits, 1)
    clock.advance(0.001)
    assert _admitted(limiter, "a", limits, 1)
    assert not _admitted(limiter, "a", limits, 1)
    # a full minute idle refills to the capacity, never beyond
    clock.advance(600)
    assert sum(_admitted(limiter, "a", limits, 1) for _ in range(100)) == 60
    # tenants do not share buckets
    assert _admitted(limiter, "b", limits, 1)


def test_burst_is_the_capacity_and_the_rate_refills() -> None:
    clock = ManualClock()
    limiter = MemoryRateLimiter(clock)
    limits = TenantLimits(requests_per_minute=60, burst_requests=5)
    assert sum(_admitted(limiter, "a", limits, 1) for _ in range(20)) == 5
    admitted_per_second = []
    for _ in range(10):
        clock.advance(1.0)
        admitted_per_second.append(sum(_admitted(limiter, "a", limits, 1) for _ in range(20)))
    assert admitted_per_second == [1] * 10
    lease = limiter.acquire_now("b", limits, 1)
    assert lease.snapshot.requests is not None
    assert (lease.snapshot.requests.limit, lease.snapshot.requests.remaining) == (5, 4)
    assert lease.snapshot.requests.reset_s == pytest.approx(1.0)


def test_tokens_are_reserved_then_the_unused_part_refunded_once() -> None:
    clock = ManualClock()
    limiter = MemoryRateLimiter(clock)
    limits = TenantLimits(tokens_per_minute=1000)
    first = limiter.acquire_now("a", limits, 600)
    assert first.snapshot.tokens is not None and first.snapshot.tokens.remaining == 400
    with pytest.raises(RateLimited) as refused:
        limiter.acquire_now("a", limits, 600)
    assert refused.value.limit_name is LimitName.TOKENS
    assert refused.value.remaining == 400
    assert refused.value.retry_after_s == pytest.approx(200 / (1000 / 60))
    snapshot = limiter.release_now(first, num_tokens_used=100)  # 500 unused come back
    assert snapshot.tokens is not None and snapshot.tokens.remaining == 900
    assert limiter.release_now(first, num_tokens_used=100).tokens == snapshot.tokens
    second = limiter.acquire_now("a", limits, 600)
    assert second.snapshot.tokens is not None and second.snapshot.tokens.remaining == 300
    # using more than reserved refunds nothing and takes nothing more
    assert limiter.release_now(second, num_tokens_used=900).tokens == second.snapshot.tokens


def test_concurrency_slots_are_exact_and_a_refusal_charges_nothing() -> None:
    limiter = MemoryRateLimiter(ManualClock(), concurrency_retry_after_s=0.25)
    limits = TenantLimits(
        requests_per_minute=100, tokens_per_minute=1000, max_concurrent_requests=3
    )
    leases = [limiter.acquire_now("a", limits, 10) for _ in range(3)]
    assert leases[-1].snapshot.num_concurrent == 3
    for _ in range(5):
        with pytest.raises(RateLimited) as refused:
            limiter.acquire_now("a", limits, 10)
        assert refused.value.limit_name is LimitName.CONCURRENT_REQUESTS
        assert refused.value.retry_after_s == 0.25
        snapshot = refused.value.snapshot
        assert snapshot is not None and snapshot.requests is not None and snapshot.tokens
        assert (snapshot.requests.remaining, snapshot.tokens.remaining) == (97, 970)
    released = limiter.release_now(leases[0], num_tokens_used=10)
    assert released.num_concurrent == 2
    limiter.release_now(leases[0], num_tokens_used=10)  # twice frees one slot only
    again = limiter.acquire_now("a", limits, 10)
    assert again.snapshot.num_concurrent == 3 and again.backend is LimiterBackend.MEMORY
    assert not _admitted(limiter, "a", limits, 10)


def test_zero_limits_refuse_for_good() -> None:
    limiter = MemoryRateLimiter(ManualClock())
    with pytest.raises(RateLimited) as refused:
        limiter.acquire_now("a", TenantLimits(requests_per_minute=0, burst_requests=10), 1)
    assert not refused.value.should_retry
    with pytest.raises(RateLimited) as refused:
        limiter.acquire_now("a", TenantLimits(max_concurrent_requests=0), 1)
    assert not refused.value.should_retry and refused.value.retry_after_s is None


def test_concurrent_tasks_cannot_overshoot() -> None:
    """Many tasks on one loop: exactly the capacity, and tokens never over the bucket."""
    rng = random.Random(7)
    sizes = [rng.randrange(50, 150) for _ in range(300)]

    async def main() -> tuple[int, int]:
        limiter = MemoryRateLimiter()
        limits = TenantLimits(requests_per_minute=1, burst_requests=100)
        token_limits = TenantLimits(tokens_per_minute=1, burst_tokens=10_000)

        async def attempt(tenant: str, lim: TenantLimits, n: int) -> int:
            await asyncio.sleep(0)
            try:
                await limiter.acquire(tenant, lim, n)
            except RateLimited:
                return 0
            return n

        requests = await asyncio.gather(*(attempt("r", limits, 1) for _ in range(300)))
        tokens = await asyncio.gather(*(attempt("t", token_limits, n) for n in sizes))
        return sum(requests), sum(tokens)

    num_requests, num_tokens = asyncio.run(main())
    assert num_requests == 100
    assert 10_000 - max(sizes) < num_tokens <= 10_000


def test_a_keys_own_limits_bind_before_its_tenants_and_refusals_charge_neither() -> None:
    clock = ManualClock()
    limiter = MemoryRateLimiter(clock)
    tenant = TenantLimits(requests_per_minute=100, tokens_per_minute=1000)
    capped = KeyLimits("7", requests_per_minute=5, tokens_per_minute=300)
    other = KeyLimits("8", tokens_per_minute=10_000)
    leases = [limiter.acquire_now("a", tenant, 10, key=capped) for _ in range(5)]
    # the headers show the binding bucket: the key's 5 RPM, not the tenant's 100
    assert leases[-1].snapshot.requests is not None
    assert (leases[-1].snapshot.requests.limit, leases[-1].snapshot.requests.remaining) == (5, 0)
    with pytest.raises(KeyRateLimited) as refused:
        limiter.acquire_now("a", tenant, 10, key=capped)
    assert refused.value.limit_name is LimitName.REQUESTS
    assert refused.value.code == "key_rate_limit_exceeded"
    assert refused.value.reason is RefusalReason.KEY_RATE_LIMIT
    assert "API key 7" in refused.value.message
    assert refused.value.retry_after_s == pytest.approx(12.0)  # one of 5 a minute
    # the key's refusal took nothing from the tenant: 95 requests and 950 tokens left
    levels = limiter.peek_now("a", tenant, capped)
    assert (levels.requests, levels.tokens) == (95, 950)
    assert (levels.key_requests, levels.key_tokens) == (0, 250)
    # another key of the tenant still passes
    lease = limiter.acquire_now("a", tenant, 900, key=other)
    assert limiter.peek_now("a", tenant, other).key_tokens == 9100
    # a release refunds the unused tokens to the tenant's bucket and to its key's
    limiter.release_now(leases[0], num_tokens_used=4)
    levels = limiter.peek_now("a", tenant, capped)
    assert (levels.tokens, levels.key_tokens) == (56, 256)
    limiter.release_now(lease, num_tokens_used=100)
    levels = limiter.peek_now("a", tenant, other)
    assert (levels.tokens, levels.key_tokens) == (856, 9900)
    # when the tenant's bucket refuses, the key's is not charged either
    roomy = KeyLimits("9", tokens_per_minute=5000)
    with pytest.raises(RateLimited) as tenant_refused:
        limiter.acquire_now("a", tenant, 900, key=roomy)
    assert not isinstance(tenant_refused.value, KeyRateLimited)
    assert tenant_refused.value.limit_name is LimitName.TOKENS
    assert tenant_refused.value.code is None  # the gateway's rate_limit_exceeded
    levels = limiter.peek_now("a", tenant, roomy)
    assert (levels.requests, levels.tokens, levels.key_tokens) == (94, 856, 5000)
