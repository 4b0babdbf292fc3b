"""The admission controller: order of checks, nothing charged on refusal, refunds, headers."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from engine import SchedulerStats, TierStats
from policies import (
    AdmissionController,
    AdmissionRefused,
    AdmissionRequest,
    AdmissionTicket,
    BudgetExhausted,
    BudgetHeld,
    KeyBudgetExhausted,
    KeyBudgetHeld,
    KeyLimits,
    MemoryRateLimiter,
    MonthlyUsage,
    QueueFull,
    RateLimited,
    RedisLimiterConfig,
    RedisRateLimiter,
    RefusalReason,
    Shed,
    TenantLimits,
    TierTable,
    UnknownTierError,
    check_budgets,
    rate_limit_headers,
)
from tests.manual_clock import ManualClock

LIMITS = TenantLimits(
    requests_per_minute=60,
    tokens_per_minute=6000,
    max_concurrent_requests=2,
    monthly_token_budget=1_000_000,
    monthly_spend_budget_usd_micros=50_000_000,
)


class LedgerTotals:
    """MonthlyUsageSource over a dict the test edits, like the ledger's running totals."""

    def __init__(self) -> None:
        self.totals: dict[str, MonthlyUsage] = {}
        self.key_totals: dict[str, MonthlyUsage] = {}  # by API key id

    async def monthly_usage(self, tenant_id: str) -> MonthlyUsage:
        return self.totals.get(tenant_id, MonthlyUsage(0, 0))

    async def key_monthly_usage(self, api_key_id: str) -> MonthlyUsage:
        return self.key_totals.get(api_key_id, MonthlyUsage(0, 0))


class EngineStats:
    """The engine's stats callable, counting how often admission asked."""

    def __init__(self) -> None:
        self.stats = SchedulerStats(prefill_tokens_per_s=1000.0)
        self.num_calls = 0

    def __call__(self, model: str = "") -> SchedulerStats:
        self.num_calls += 1
        return self.stats

    def backlog(self, priority: int, num_tokens: int) -> None:
        name = TierTable().names[priority]
        self.stats.tiers[priority] = TierStats(
            priority, name, num_pending_prefill_tokens=num_tokens
        )


def _controller(
    ledger: LedgerTotals | None = None, stats: EngineStats | None = None
) -> tuple[AdmissionController, MemoryRateLimiter]:
    limiter = MemoryRateLimiter(ManualClock())
    controller = AdmissionController(limiter, TierTable(), ledger, stats or EngineStats())
    return controller, limiter


def _request(
    tier: str = "standard",
    prompt: int = 100,
    max_tokens: int = 900,
    limits: TenantLimits = LIMITS,
) -> AdmissionRequest:
    return AdmissionRequest("t1", tier, limits, num_prompt_tokens=prompt, num_max_tokens=max_tokens)


def test_admit_reserves_prompt_plus_max_tokens_and_release_refunds() -> None:
    async def main() -> None:
        controller, _ = _controller(LedgerTotals())
        ticket = await controller.admit(_request())
        assert ticket.lease.num_tokens_reserved == 1000
        assert rate_limit_headers(ticket.snapshot) == {
            "x-ratelimit-limit-requests": "60",
            "x-ratelimit-remaining-requests": "59",
            "x-ratelimit-reset-requests": "1s",
            "x-ratelimit-limit-tokens": "6000",
            "x-ratelimit-remaining-tokens": "5000",
            "x-ratelimit-reset-tokens": "10s",
        }
        after = await controller.release(ticket, num_tokens_used=100 + 150)
        assert after.tokens is not None and after.tokens.remaining == 5750
        assert after.num_concurrent == 0
        again = await controller.release(ticket, num_tokens_used=0)
        assert again.tokens == after.tokens

    asyncio.run(main())


def test_budget_is_checked_first_and_says_not_to_retry() -> None:
    ledger = LedgerTotals()
    stats = EngineStats()
    stats.backlog(1, 10**6)  # would be shed too

    async def main() -> None:
        controller, limiter = _controller(ledger, stats)
        ledger.totals["t1"] = MonthlyUsage(num_tokens=1_000_000, spend_usd_micros=0)
        with pytest.raises(BudgetExhausted) as exhausted:
            await controller.admit(_request())
        assert exhausted.value.reason is RefusalReason.BUDGET
        assert not exhausted.value.should_retry and exhausted.value.retry_after_s is None
        assert exhausted.value.snapshot is None
        assert "used 1000000 of 1000000 tokens" in exhausted.value.message
        assert stats.num_calls == 0
        # the limiter was never charged: a full minute's requests are still there
        lease = limiter.acquire_now("t1", LIMITS, 1)
        assert lease.snapshot.requests is not None and lease.snapshot.requests.remaining == 59

    asyncio.run(main())


def test_a_keys_own_budgets_bind_before_its_tenants_and_spare_its_other_keys() -> None:
    ledger = LedgerTotals()
    spent = KeyLimits("5", monthly_spend_budget_usd_micros=2_000_000)
    tokens = KeyLimits("6", monthly_token_budget=2_500)
    limits = replace(LIMITS, max_concurrent_requests=None)

    async def main() -> None:
        controller, limiter = _controller(ledger)
        # the tenant's budgets are spent too: the key's refusal is the one named
        ledger.totals["t1"] = MonthlyUsage(num_tokens=1_000_000, spend_usd_micros=0)
        ledger.key_totals["5"] = MonthlyUsage(num_tokens=10, spend_usd_micros=2_000_000)
        with pytest.raises(KeyBudgetExhausted) as exhausted:
            await controller.admit(replace(_request(limits=limits), key=spent))
        assert exhausted.value.code == "key_budget_exceeded"
        assert exhausted.value.reason is RefusalReason.KEY_BUDGET
        assert not exhausted.value.should_retry
        assert "Monthly spend budget exhausted for API key 5" in exhausted.value.message
        # the tenant's refusal for a key with room of its own is the tenant's
        with pytest.raises(BudgetExhausted) as tenant_exhausted:
            await controller.admit(replace(_request(limits=limits), key=tokens))
        assert not isinstance(tenant_exhausted.value, KeyBudgetExhausted)
        assert tenant_exhausted.value.code is None
        ledger.totals["t1"] = MonthlyUsage(num_tokens=0, spend_usd_micros=0)
        # the key's token budget holds what its requests in flight may use, as the tenant's
        ledger.key_totals["6"] = MonthlyUsage(num_tokens=500, spend_usd_micros=0)
        first = await controller.admit(replace(_request(limits=limits), key=tokens))
        second = await controller.admit(replace(_request(limits=limits), key=tokens))
        with pytest.raises(KeyBudgetHeld) as held:
            small = _request(limits=limits, prompt=10, max_tokens=10)
            await controller.admit(replace(small, key=tokens))
        assert held.value.code == "key_budget_exceeded" and held.value.should_retry
        assert "API key 6" in held.value.message
        # the tenant's other keys pass meanwhile
        other = await controller.admit(replace(_request(limits=limits), key=KeyLimits("7")))
        for ticket in (first, second, other):
            await controller.release(ticket, num_tokens_used=1000)
        ledger.key_totals["6"] = MonthlyUsage(num_tokens=1500, spend_usd_micros=0)
        # released: the hold is gone, and 1,000 tokens are left for the key
        await controller.admit(replace(_request(limits=limits), key=tokens))
        # a refusal by the key's budget took nothing from the rate limits
        levels = limiter.peek_now("t1", limits)
        assert levels.requests == 56  # four admitted of 60

    asyncio.run(main())


def test_the_tokens_a_request_may_use_are_held_against_the_token_budget() -> None:
    ledger = LedgerTotals()
    limits = replace(LIMITS, monthly_token_budget=2500, tokens_per_minute=None,
                     max_concurrent_requests=None)

    async def main() -> None:
        controller, _ = _controller(ledger)
        ledger.totals["t1"] = MonthlyUsage(num_tokens=500, spend_usd_micros=0)
        first = await controller.admit(_request(limits=limits))  # holds 1,000 of 2,000 left
        second = await controller.admit(_request(limits=limits))  # the other 1,000
        with pytest.raises(BudgetHeld) as held:
            await controller.admit(_request(limits=limits, prompt=10, max_tokens=10))
        assert held.value.reason is RefusalReason.BUDGET and held.value.should_retry
        assert "2000 of the 2000 tokens left" in held.value.message
        # Larger than what is left at all: refused for good, whatever is in flight.
        with pytest.raises(BudgetExhausted) as too_large:
            await controller.admit(_request(limits=limits, prompt=100, max_tokens=2000))
        assert not too_large.value.should_retry and "lower max_tokens" in too_large.value.message
        # The first ends having used 300 tokens (recorded, then released): 700 come free.
        ledger.totals["t1"] = MonthlyUsage(num_tokens=800, spend_usd_micros=0)
        await controller.release(first, num_tokens_used=300)
        await controller.release(first, num_tokens_used=300)  # twice frees nothing more
        third = await controller.admit(_request(limits=limits, prompt=100, max_tokens=600))
        with pytest.raises(BudgetHeld):
            await controller.admit(_request(limits=limits, prompt=1, max_tokens=1))
        for ticket in (second, third):
            await controller.release(ticket, num_tokens_used=0)
        assert controller._budget_held == {}

    asyncio.run(main())


def test_admissions_awaiting_the_limiter_together_see_each_others_holds() -> None:
    """A shared limiter's acquire awaits (Redis): two admissions of one tenant at once must
    not both pass a budget or queue check that only one fits."""

    class YieldingLimiter(MemoryRateLimiter):
        async def acquire(self, *args: Any) -> Any:
            await asyncio.sleep(0.01)
            return await super().acquire(*args)

    ledger = LedgerTotals()
    limits = replace(LIMITS, monthly_token_budget=1500, tokens_per_minute=None,
                     max_concurrent_requests=None, max_queued_requests=2)

    async def main() -> None:
        controller = AdmissionController(
            YieldingLimiter(ManualClock()), TierTable(), ledger, EngineStats()
        )
        results = await asyncio.gather(
            *(controller.admit(_request(limits=limits)) for _ in range(3)),
            return_exceptions=True,
        )
        admitted = [r for r in results if isinstance(r, AdmissionTicket)]
        assert len(admitted) == 1  # 1,000 tokens each: one fits in 1,500
        assert all(isinstance(r, BudgetHeld) for r in results if r not in admitted)
        assert controller.num_queued("t1") == 1
        await controller.release(admitted[0], num_tokens_used=0)
        assert controller.num_queued("t1") == 0 and controller._budget_held == {}

    asyncio.run(main())


def test_spend_budget_and_reset_date() -> None:
    limits = TenantLimits(monthly_spend_budget_usd_micros=5_000_000)
    refusal = check_budgets(
        "7", limits, MonthlyUsage(10, 5_250_000), now=datetime(2026, 12, 31, 23, 0, tzinfo=UTC)
    )
    assert refusal is not None and refusal.budget_name == "spend_usd_micros"
    assert refusal.message == (
        "Monthly spend budget exhausted for tenant 7: spent $5.25 of $5.00, $0.00 remaining. "
        "It resets on 2027-01-01 (UTC)."
    )
    assert check_budgets("7", limits, MonthlyUsage(10**9, 4_999_999)) is None


def test_shedding_comes_before_any_charge() -> None:
    stats = EngineStats()
    stats.backlog(1, 5000)  # standard wait 5 s over its 1.6 s threshold

    async def main() -> None:
        controller, _ = _controller(LedgerTotals(), stats)
        for i in range(3):
            with pytest.raises(Shed) as shed:
                await controller.admit(_request(prompt=100))
            # each is promised its own moment, one 100-token prompt (0.1 s) after the last,
            # the first when its 5.1 s wait is down to 0.1 s under the 1.6 s threshold
            assert shed.value.retry_after_s == pytest.approx(5.1 - 1.5 + 0.1 * i, abs=0.05)
            assert shed.value.snapshot is None
        # batch is never shed and the stats are not even read for it
        num_calls = stats.num_calls
        ticket = await controller.admit(_request(tier="batch"))
        assert stats.num_calls == num_calls
        # the shed requests charged nothing: only the batch request is on the buckets
        snapshot = ticket.snapshot
        assert snapshot.requests is not None and snapshot.requests.remaining == 59
        assert snapshot.num_concurrent == 1
        await controller.release(ticket, 1000)
        # premium has its reservation to spare: admitted over the same backlog
        assert isinstance(await controller.admit(_request(tier="premium")), AdmissionTicket)

    asyncio.run(main())


def test_rate_limits_refuse_with_headers_and_all_or_nothing() -> None:
    async def main() -> None:
        controller, _ = _controller(None)  # no usage source: budgets not enforced
        held = [await controller.admit(_request(max_tokens=400)) for _ in range(2)]
        with pytest.raises(RateLimited) as refused:
            await controller.admit(_request(max_tokens=400))
        assert refused.value.reason is RefusalReason.CONCURRENCY
        headers = rate_limit_headers(refused.value.snapshot, refused.value.retry_after_s)
        assert headers["x-ratelimit-remaining-requests"] == "58"
        assert headers["x-ratelimit-remaining-tokens"] == "5000"
        assert (headers["retry-after"], headers["retry-after-ms"]) == ("1", "1000")
        await controller.release(held[0], 500)
        with pytest.raises(RateLimited) as too_large:
            await controller.admit(_request(tier="batch", prompt=5000, max_tokens=2000))
        assert not too_large.value.should_retry
        with pytest.raises(UnknownTierError):
            await controller.admit(_request(tier="gold"))
        await controller.aclose()

    asyncio.run(main())


def test_a_tenants_queue_on_this_replica_is_bounded_before_any_charge() -> None:
    async def main() -> None:
        stats = EngineStats()
        stats.backlog(1, 1000)  # 1 s of standard prompts ahead at 1,000 tokens/s
        controller, limiter = _controller(stats=stats)
        limits = replace(LIMITS, max_queued_requests=2, max_concurrent_requests=None)
        first = await controller.admit(_request(limits=limits))
        second = await controller.admit(_request(limits=limits))
        assert controller.num_queued("t1") == 2
        before = await limiter.peek("t1", limits)
        with pytest.raises(QueueFull) as full:
            await controller.admit(_request(limits=limits))
        assert full.value.reason is RefusalReason.QUEUE_FULL
        assert "your limit is 2" in full.value.message
        assert full.value.retry_after_s == pytest.approx(1.0, rel=0.2)
        assert await limiter.peek("t1", limits) == before  # nothing charged
        # Another tenant's queue is its own.
        other = replace(_request(limits=limits), tenant_id="t2")
        await controller.admit(other)
        # Started by the engine, the first no longer waits: a place in the queue frees.
        controller.started(first)
        third = await controller.admit(_request(limits=limits))
        # A request that ends before it starts (its client left) frees its place too.
        await controller.release(second, num_tokens_used=0)
        fourth = await controller.admit(_request(limits=limits))
        assert controller.num_queued("t1") == 2
        for ticket in (first, third, fourth):
            controller.started(ticket)
            await controller.release(ticket, num_tokens_used=0)
        assert controller.num_queued("t1") == 0

    asyncio.run(main())


def test_redis_backed_controller_admits_and_releases(redis_url: str, key_prefix: str) -> None:
    # Redis refills in real time: at a token a minute the levels below are exact for a minute
    limits = replace(LIMITS, tokens_per_minute=1, burst_tokens=6000)

    async def main() -> None:
        limiter = RedisRateLimiter.from_url(
            redis_url, RedisLimiterConfig(key_prefix=key_prefix, timeout_s=5.0)
        )
        controller = AdmissionController(limiter, TierTable(), LedgerTotals(), EngineStats())
        try:
            tickets = [await controller.admit(_request(limits=limits)) for _ in range(2)]
            with pytest.raises(AdmissionRefused) as refused:
                await controller.admit(_request(limits=limits))
            assert refused.value.reason is RefusalReason.CONCURRENCY
            released = await controller.release(tickets[0], num_tokens_used=1000)
            assert released.num_concurrent == 1
            assert released.tokens is not None and released.tokens.remaining == 4000
        finally:
            await controller.aclose()

    asyncio.run(main())
