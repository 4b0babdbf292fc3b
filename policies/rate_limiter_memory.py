"""In-process rate limiter: exact for one process, the default for a single replica.

Every operation runs without awaiting, so on one event loop each acquire and release is atomic
(no lock needed); it is not meant to be shared between threads. Leases need no expiry here:
they die with the process that holds them.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from policies.budget_hold import BudgetHold
from policies.rate_limits import (
    LimiterBackend,
    LimitLevels,
    RateLimitLease,
    RateLimitSnapshot,
    TenantLimits,
    TokenBucket,
    check_limits,
)

# Retry delay offered when all of a tenant's concurrency slots are taken.
DEFAULT_CONCURRENCY_RETRY_AFTER_S = 1.0


@dataclass
class _TenantState:
    requests: TokenBucket | None = None  # created on first use under a request limit
    tokens: TokenBucket | None = None
    lease_ids: set[str] = field(default_factory=set)  # concurrency slots held


class MemoryRateLimiter:
    """RateLimiter over token buckets in this process."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        concurrency_retry_after_s: float = DEFAULT_CONCURRENCY_RETRY_AFTER_S,
        backend: LimiterBackend = LimiterBackend.MEMORY,
    ) -> None:
        self._clock = clock  # seconds, monotonic
        self._concurrency_retry_after_s = concurrency_retry_after_s
        self._backend = backend  # recorded on leases (the Redis limiter's fallback: FALLBACK)
        self._tenants: dict[str, _TenantState] = {}

    async def acquire(
        self,
        tenant_id: str,
        limits: TenantLimits,
        num_tokens: int,
        budget: BudgetHold | None = None,
    ) -> RateLimitLease:
        # One process: the admission controller's budget holds already see every request.
        return self.acquire_now(tenant_id, limits, num_tokens)

    async def release(self, lease: RateLimitLease, num_tokens_used: int) -> RateLimitSnapshot:
        return self.release_now(lease, num_tokens_used)

    async def peek(self, tenant_id: str, limits: TenantLimits) -> LimitLevels:
        return self.peek_now(tenant_id, limits)

    async def charge(self, tenant_id: str, limits: TenantLimits, num_tokens: int) -> LimitLevels:
        return self.charge_now(tenant_id, limits, num_tokens)

    async def aclose(self) -> None:
        self._tenants.clear()

    def acquire_now(
        self, tenant_id: str, limits: TenantLimits, num_tokens: int, num_held_elsewhere: int = 0
    ) -> RateLimitLease:
        """acquire() without the coroutine (raises RateLimited). num_held_elsewhere: slots
        the tenant holds outside these buckets that count against the concurrency limit (as
        the Redis limiter's fallback counts its replica's Redis leases)."""
        state = self._tenants.setdefault(tenant_id, _TenantState())
        levels = self._levels(state, limits)
        if num_held_elsewhere:
            levels = dataclasses.replace(
                levels, num_concurrent=levels.num_concurrent + num_held_elsewhere
            )
        refusal = check_limits(limits, levels, num_tokens, self._concurrency_retry_after_s)
        if refusal is not None:
            raise refusal
        if state.requests is not None and levels.requests is not None:
            state.requests.take(1)
        if state.tokens is not None and levels.tokens is not None:
            state.tokens.take(num_tokens)
        lease_id = secrets.token_hex(16)
        state.lease_ids.add(lease_id)
        return RateLimitLease(
            tenant_id=tenant_id,
            lease_id=lease_id,
            num_tokens_reserved=num_tokens,
            limits=limits,
            backend=self._backend,
            snapshot=levels.charged(num_tokens).snapshot(limits),
        )

    def release_now(self, lease: RateLimitLease, num_tokens_used: int) -> RateLimitSnapshot:
        """release() without the coroutine."""
        state = self._tenants.get(lease.tenant_id)
        if state is None:
            return LimitLevels(None, None, 0).snapshot(lease.limits)
        levels = self._levels(state, lease.limits)
        if lease.lease_id in state.lease_ids:
            state.lease_ids.remove(lease.lease_id)
            refund = max(0, lease.num_tokens_reserved - num_tokens_used)
            if state.tokens is not None and levels.tokens is not None and refund:
                state.tokens.give_back(refund)
        return self._levels(state, lease.limits).snapshot(lease.limits)

    def lease_ids(self) -> dict[str, set[str]]:
        """The leases held now, per tenant (copies)."""
        return {tenant: set(s.lease_ids) for tenant, s in self._tenants.items() if s.lease_ids}

    def peek_now(self, tenant_id: str, limits: TenantLimits) -> LimitLevels:
        """peek() without the coroutine; a tenant not seen yet has full buckets."""
        state = self._tenants.get(tenant_id) or _TenantState()
        return self._levels(state, limits)

    def charge_now(self, tenant_id: str, limits: TenantLimits, num_tokens: int) -> LimitLevels:
        """charge() without the coroutine."""
        state = self._tenants.setdefault(tenant_id, _TenantState())
        levels = self._levels(state, limits)
        if state.requests is not None and levels.requests is not None:
            state.requests.take(min(1.0, levels.requests))
        if state.tokens is not None and levels.tokens is not None:
            state.tokens.take(min(float(num_tokens), levels.tokens))
        return self._levels(state, limits)

    def _levels(self, state: _TenantState, limits: TenantLimits) -> LimitLevels:
        """Refill the tenant's buckets to now under limits and read them."""
        now_s = self._clock()
        requests_spec, tokens_spec = limits.requests_bucket, limits.tokens_bucket
        if requests_spec is not None and state.requests is None:
            state.requests = TokenBucket(requests_spec, now_s)
        if tokens_spec is not None and state.tokens is None:
            state.tokens = TokenBucket(tokens_spec, now_s)
        return LimitLevels(
            requests=None
            if requests_spec is None or state.requests is None
            else state.requests.refill(requests_spec, now_s),
            tokens=None
            if tokens_spec is None or state.tokens is None
            else state.tokens.refill(tokens_spec, now_s),
            num_concurrent=len(state.lease_ids),
        )
