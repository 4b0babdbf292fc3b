"""In-process rate limiter: exact for one process, the default for a single replica.

An API key's own buckets (policies/key_limits.py) are checked and charged in the same call
as its tenant's. Every operation runs without awaiting, so on one event loop each acquire
and release is atomic (no lock needed); it is not meant to be shared between threads.
Leases need no expiry here: they die with the process that holds them.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from policies.budget_hold import BudgetHold
from policies.key_limits import KeyLimits
from policies.rate_limits import (
    BucketSpec,
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


@dataclass
class _KeyState:
    """An API key's own buckets (its leases are its tenant's)."""

    requests: TokenBucket | None = None  # created on first use under the key's request limit
    tokens: TokenBucket | None = None


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
        self._keys: dict[str, _KeyState] = {}  # by API key id

    async def acquire(
        self,
        tenant_id: str,
        limits: TenantLimits,
        num_tokens: int,
        budget: BudgetHold | None = None,
        key: KeyLimits | None = None,
        key_budget: BudgetHold | None = None,
    ) -> RateLimitLease:
        # One process: the admission controller's budget holds already see every request.
        return self.acquire_now(tenant_id, limits, num_tokens, key=key)

    async def release(self, lease: RateLimitLease, num_tokens_used: int) -> RateLimitSnapshot:
        return self.release_now(lease, num_tokens_used)

    async def peek(
        self, tenant_id: str, limits: TenantLimits, key: KeyLimits | None = None
    ) -> LimitLevels:
        return self.peek_now(tenant_id, limits, key)

    async def charge(
        self, tenant_id: str, limits: TenantLimits, num_tokens: int, key: KeyLimits | None = None
    ) -> LimitLevels:
        return self.charge_now(tenant_id, limits, num_tokens, key)

    async def aclose(self) -> None:
        self._tenants.clear()
        self._keys.clear()

    def acquire_now(
        self,
        tenant_id: str,
        limits: TenantLimits,
        num_tokens: int,
        num_held_elsewhere: int = 0,
        key: KeyLimits | None = None,
    ) -> RateLimitLease:
        """acquire() without the coroutine (raises RateLimited). num_held_elsewhere: slots
        the tenant holds outside these buckets that count against the concurrency limit (as
        the Redis limiter's fallback counts its replica's Redis leases)."""
        state = self._tenants.setdefault(tenant_id, _TenantState())
        key_state = self._key_state(key)
        levels = self._levels(state, limits, key, key_state)
        if num_held_elsewhere:
            levels = dataclasses.replace(
                levels, num_concurrent=levels.num_concurrent + num_held_elsewhere
            )
        refusal = check_limits(limits, levels, num_tokens, self._concurrency_retry_after_s, key)
        if refusal is not None:
            raise refusal
        for bucket, _level, amount in self._buckets(state, key_state, levels, num_tokens):
            bucket.take(amount)
        lease_id = secrets.token_hex(16)
        state.lease_ids.add(lease_id)
        return RateLimitLease(
            tenant_id=tenant_id,
            lease_id=lease_id,
            num_tokens_reserved=num_tokens,
            limits=limits,
            backend=self._backend,
            snapshot=levels.charged(num_tokens).snapshot(limits, key),
            key=key,
        )

    def release_now(self, lease: RateLimitLease, num_tokens_used: int) -> RateLimitSnapshot:
        """release() without the coroutine: the unused tokens go back to the tenant's tokens
        bucket and to its key's."""
        state = self._tenants.get(lease.tenant_id)
        if state is None:
            return LimitLevels(None, None, 0).snapshot(lease.limits, lease.key)
        key_state = self._key_state(lease.key)
        levels = self._levels(state, lease.limits, lease.key, key_state)
        if lease.lease_id in state.lease_ids:
            state.lease_ids.remove(lease.lease_id)
            refund = max(0, lease.num_tokens_reserved - num_tokens_used)
            if state.tokens is not None and levels.tokens is not None and refund:
                state.tokens.give_back(refund)
            if key_state is not None and key_state.tokens is not None and (
                    levels.key_tokens is not None and refund):
                key_state.tokens.give_back(refund)
        levels = self._levels(state, lease.limits, lease.key, key_state)
        return levels.snapshot(lease.limits, lease.key)

    def lease_ids(self) -> dict[str, set[str]]:
        """The leases held now, per tenant (copies)."""
        return {tenant: set(s.lease_ids) for tenant, s in self._tenants.items() if s.lease_ids}

    def peek_now(
        self, tenant_id: str, limits: TenantLimits, key: KeyLimits | None = None
    ) -> LimitLevels:
        """peek() without the coroutine; a tenant or key not seen yet has full buckets."""
        state = self._tenants.get(tenant_id) or _TenantState()
        key_state = None if key is None else self._keys.get(key.api_key_id) or _KeyState()
        return self._levels(state, limits, key, key_state)

    def charge_now(
        self, tenant_id: str, limits: TenantLimits, num_tokens: int, key: KeyLimits | None = None
    ) -> LimitLevels:
        """charge() without the coroutine."""
        state = self._tenants.setdefault(tenant_id, _TenantState())
        key_state = self._key_state(key)
        levels = self._levels(state, limits, key, key_state)
        for bucket, level, amount in self._buckets(state, key_state, levels, num_tokens):
            bucket.take(min(float(amount), level))
        return self._levels(state, limits, key, key_state)

    def _key_state(self, key: KeyLimits | None) -> _KeyState | None:
        return None if key is None else self._keys.setdefault(key.api_key_id, _KeyState())

    @staticmethod
    def _buckets(
        state: _TenantState, key_state: _KeyState | None, levels: LimitLevels, num_tokens: int
    ) -> list[tuple[TokenBucket, float, int]]:
        """(bucket, its level, what one request takes from it) for each bucket in use."""
        pairs = [(state.requests, levels.requests, 1), (state.tokens, levels.tokens, num_tokens)]
        if key_state is not None:
            pairs += [(key_state.requests, levels.key_requests, 1),
                      (key_state.tokens, levels.key_tokens, num_tokens)]
        return [(bucket, level, amount) for bucket, level, amount in pairs
                if bucket is not None and level is not None]

    def _levels(
        self,
        state: _TenantState,
        limits: TenantLimits,
        key: KeyLimits | None = None,
        key_state: _KeyState | None = None,
    ) -> LimitLevels:
        """Refill the tenant's buckets (and its key's) to now under limits and read them."""
        now_s = self._clock()
        state.requests, requests = _refilled(state.requests, limits.requests_bucket, now_s)
        state.tokens, tokens = _refilled(state.tokens, limits.tokens_bucket, now_s)
        key_requests = key_tokens = None
        if key is not None and key_state is not None:
            key_state.requests, key_requests = _refilled(
                key_state.requests, key.requests_bucket, now_s)
            key_state.tokens, key_tokens = _refilled(key_state.tokens, key.tokens_bucket, now_s)
        return LimitLevels(
            requests=requests,
            tokens=tokens,
            num_concurrent=len(state.lease_ids),
            key_requests=key_requests,
            key_tokens=key_tokens,
        )


def _refilled(
    bucket: TokenBucket | None, spec: BucketSpec | None, now_s: float
) -> tuple[TokenBucket | None, float | None]:
    """The bucket (created full on first use under a limit) and its level now under spec;
    no level without a limit (the bucket is kept for when the limit comes back)."""
    if spec is None:
        return bucket, None
    if bucket is None:
        bucket = TokenBucket(spec, now_s)
    return bucket, bucket.refill(spec, now_s)
