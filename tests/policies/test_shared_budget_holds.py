"""Monthly token budgets held across replicas through Redis (admit.lua's budget and holds
keys), against the shared redis-server: requests arriving together on three replicas cannot
spend past the budget, what each release used is counted once for every replica, the count
never falls below what a replica's ledger knows, and a new month starts again."""

from __future__ import annotations

import asyncio

import redis

from engine import SchedulerStats
from policies import (
    AdmissionController,
    AdmissionRequest,
    AdmissionTicket,
    BudgetExhausted,
    BudgetHeld,
    BudgetHold,
    KeyBudgetExhausted,
    KeyBudgetHeld,
    KeyLimits,
    MonthlyUsage,
    RateLimitLease,
    RedisLimiterConfig,
    RedisRateLimiter,
    TenantLimits,
    TierTable,
)

BUDGET = 2_000
REQUEST_TOKENS = 120  # prompt 20 + max_tokens 100
LIMITS = TenantLimits(monthly_token_budget=BUDGET)


class Totals:
    """One replica's running monthly totals (the ledger's), which the test sets."""

    def __init__(self, num_tokens: int = 0) -> None:
        self.num_tokens = num_tokens

    async def monthly_usage(self, tenant_id: str) -> MonthlyUsage:
        return MonthlyUsage(self.num_tokens, 0)

    async def key_monthly_usage(self, api_key_id: str) -> MonthlyUsage:
        return MonthlyUsage(0, 0)  # what the replica's ledger knows of a key: nothing yet


class LocalHoldsOnly(RedisRateLimiter):
    """The limiter as it was before budgets were held in Redis: the budget is not passed
    on, so each replica's admission controller holds it on its own."""

    async def acquire(
        self,
        tenant_id: str,
        limits: TenantLimits,
        num_tokens: int,
        budget: BudgetHold | None = None,
        key: KeyLimits | None = None,
        key_budget: BudgetHold | None = None,
    ) -> RateLimitLease:
        return await super().acquire(tenant_id, limits, num_tokens, key=key)


def _replicas(
    url: str, prefix: str, totals: list[Totals], shared: bool = True
) -> list[AdmissionController]:
    """One admission controller per replica, each with its own Redis pool and totals."""
    config = RedisLimiterConfig(key_prefix=prefix, timeout_s=5.0)
    kind = RedisRateLimiter if shared else LocalHoldsOnly
    return [
        AdmissionController(kind.from_url(url, config), TierTable(), replica_totals,
                            lambda _model: SchedulerStats())
        for replica_totals in totals
    ]


def _request(num_tokens: int = REQUEST_TOKENS) -> AdmissionRequest:
    return AdmissionRequest("b", "standard", LIMITS, num_prompt_tokens=20,
                            num_max_tokens=num_tokens - 20)


async def _admit_all(
    controllers: list[AdmissionController], num_requests: int
) -> tuple[list[AdmissionTicket], list[BaseException]]:
    results = await asyncio.gather(
        *(controllers[i % len(controllers)].admit(_request()) for i in range(num_requests)),
        return_exceptions=True,
    )
    admitted = [r for r in results if isinstance(r, AdmissionTicket)]
    refused = [r for r in results if isinstance(r, BaseException)]
    return admitted, refused


async def _close(controllers: list[AdmissionController]) -> None:
    for controller in controllers:
        await controller.aclose()


def test_requests_together_on_three_replicas_hold_one_budget(
    redis_url: str, key_prefix: str
) -> None:
    async def main(shared: bool) -> tuple[int, list[BaseException]]:
        prefix = f"{key_prefix}-{shared}"
        controllers = _replicas(redis_url, prefix, [Totals(), Totals(), Totals()], shared)
        try:
            admitted, refused = await _admit_all(controllers, 60)
            for ticket in admitted:  # each used its whole reservation
                await controllers[0].release(ticket, REQUEST_TOKENS)
            return len(admitted), refused
        finally:
            await _close(controllers)

    num_alone, _ = asyncio.run(main(shared=False))
    num_shared, refused = asyncio.run(main(shared=True))
    print(f"\n60 requests of {REQUEST_TOKENS} tokens on 3 replicas, budget {BUDGET}: "
          f"{num_alone} admitted with each replica's own holds, {num_shared} shared")
    assert num_alone == 3 * (BUDGET // REQUEST_TOKENS)  # each replica fills the budget
    assert num_shared == BUDGET // REQUEST_TOKENS
    assert all(isinstance(r, BudgetHeld) for r in refused)


def test_usage_released_on_one_replica_counts_on_the_others_once(
    redis_url: str, key_prefix: str
) -> None:
    async def main() -> None:
        first, second = _replicas(redis_url, key_prefix, [Totals(), Totals()])
        try:
            tickets = [await first.admit(_request()) for _ in range(10)]
            for ticket in tickets:
                await first.release(ticket, 100)
                await first.release(ticket, 100)  # a second release counts nothing
            # 1,000 used: the second replica, whose own totals say 0, fits 8 more, not 16
            admitted, refused = await _admit_all([second], 16)
            assert len(admitted) == 8
            assert all(isinstance(r, BudgetHeld) for r in refused)
            for ticket in admitted:
                await second.release(ticket, REQUEST_TOKENS)
            # 1,960 used: larger than what is left at all
            try:
                await second.admit(_request())
            except BudgetExhausted as exc:
                assert exc.used == 1_960 and exc.budget == BUDGET
            else:
                raise AssertionError("admitted past the budget")
        finally:
            await _close([first, second])

    asyncio.run(main())


def test_the_count_follows_the_ledger_and_the_month(redis_url: str, key_prefix: str) -> None:
    async def main() -> None:
        config = RedisLimiterConfig(key_prefix=key_prefix, timeout_s=5.0)
        limiter = RedisRateLimiter.from_url(redis_url, config)
        try:
            # a replica whose ledger knows 1,900 tokens raises the shared count to it
            lease = await limiter.acquire("b", LIMITS, 100, BudgetHold("2026-11", 1_900))
            try:
                await limiter.acquire("b", LIMITS, 100, BudgetHold("2026-11", 0))
            except BudgetHeld as exc:
                assert exc.num_tokens_held == 100
            else:
                raise AssertionError("admitted past the budget")
            await limiter.release(lease, 50)
            client = redis.Redis.from_url(redis_url)
            try:
                budget_key = f"{key_prefix}:{{b}}:budget"
                assert client.hgetall(budget_key) == {b"period": b"2026-11", b"used": b"1950"}
                assert client.pttl(budget_key) > 30 * 24 * 3600 * 1000
                # a new month starts from what the admitting replica knows of it
                await limiter.acquire("b", LIMITS, 1_000, BudgetHold("2026-12", 10))
                assert client.hgetall(budget_key) == {b"period": b"2026-12", b"used": b"10"}
            finally:
                client.close()
        finally:
            await limiter.aclose()

    asyncio.run(main())


def test_a_keys_own_budget_is_held_across_replicas_and_binds_before_its_tenants(
    redis_url: str, key_prefix: str
) -> None:
    """A key with a budget of 1,000 tokens under a tenant with none: requests together on
    three replicas hold at most the key's budget, what they used counts on every replica,
    and the tenant's other key is not concerned."""
    capped = KeyLimits("31", monthly_token_budget=1_000)

    def request(key: KeyLimits | None) -> AdmissionRequest:
        return AdmissionRequest("k", "standard", TenantLimits(), num_prompt_tokens=20,
                                num_max_tokens=REQUEST_TOKENS - 20, key=key)

    async def main() -> None:
        controllers = _replicas(redis_url, key_prefix, [Totals(), Totals(), Totals()])
        try:
            results = await asyncio.gather(
                *(controllers[i % 3].admit(request(capped)) for i in range(24)),
                return_exceptions=True,
            )
            admitted = [r for r in results if isinstance(r, AdmissionTicket)]
            refused = [r for r in results if not isinstance(r, AdmissionTicket)]
            assert len(admitted) == 1_000 // REQUEST_TOKENS
            assert all(isinstance(r, KeyBudgetHeld) for r in refused), refused
            assert {r.code for r in refused if isinstance(r, KeyBudgetHeld)} == {
                "key_budget_exceeded"}
            # the tenant's other key passes meanwhile
            other = await controllers[1].admit(request(KeyLimits("32")))
            for ticket in admitted:
                await controllers[0].release(ticket, REQUEST_TOKENS)
            await controllers[1].release(other, REQUEST_TOKENS)
            # 960 used, counted in Redis: a replica whose ledger knows nothing refuses for good
            try:
                await controllers[2].admit(request(capped))
            except KeyBudgetExhausted as exc:
                assert exc.code == "key_budget_exceeded" and "API key 31" in exc.message
            else:
                raise AssertionError("admitted past the key's budget")
        finally:
            await _close(controllers)

    asyncio.run(main())
