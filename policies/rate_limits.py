"""Token-bucket rate limits: the tenant's limits, bucket math, refusals, snapshots, headers.

Each tenant has up to three limits: a requests bucket (RPM), a tokens bucket (TPM) charged
prompt + max_tokens at admission and refunded the unused part at the end, and a count of
concurrent requests. A bucket holds up to its burst (default: one minute's worth of the rate)
and refills continuously at rate / 60 per second. Both limiter backends (memory and Redis)
apply the rules below; the Redis Lua script (admit.lua) admits by the same rule as
`check_limits`, which then explains a refusal from the levels the script reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import StrEnum
from functools import cached_property, partial
from typing import TYPE_CHECKING, Protocol

from policies.budget_hold import BudgetHold
from policies.errors import AdmissionConfigError, KeyRateLimited, LimitName, RateLimited

if TYPE_CHECKING:
    from policies.key_limits import KeyLimits


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's quota in plain form (the gateway builds it from tenants.models.Quota)."""

    requests_per_minute: int | None = None  # None: no request limit
    tokens_per_minute: int | None = None  # prompt + max_tokens reserved; None: no limit
    burst_requests: int | None = None  # requests bucket capacity; None: requests_per_minute
    burst_tokens: int | None = None  # tokens bucket capacity; None: tokens_per_minute
    max_concurrent_requests: int | None = None  # None: no concurrency limit
    monthly_token_budget: int | None = None  # None: no budget
    monthly_spend_budget_usd_micros: int | None = None  # None: no budget
    # Requests admitted on this replica that its engine has not started yet; None: no limit.
    max_queued_requests: int | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None and value < 0:
                raise AdmissionConfigError(f"{field.name} must not be negative, got {value}")

    @cached_property
    def requests_bucket(self) -> BucketSpec | None:
        return BucketSpec.of(self.requests_per_minute, self.burst_requests)

    @cached_property
    def tokens_bucket(self) -> BucketSpec | None:
        return BucketSpec.of(self.tokens_per_minute, self.burst_tokens)

    def divided(self, num_replicas: int) -> TenantLimits:
        """Each replica's share of the rate limits (fail-open fallback); budgets unchanged.

        Shares round down but never to zero, so a tenant allowed anything keeps something.
        """

        def share(value: int | None) -> int | None:
            if value is None or value == 0:
                return value
            return max(1, value // num_replicas)

        return TenantLimits(
            requests_per_minute=share(self.requests_per_minute),
            tokens_per_minute=share(self.tokens_per_minute),
            burst_requests=share(self.burst_requests),
            burst_tokens=share(self.burst_tokens),
            max_concurrent_requests=share(self.max_concurrent_requests),
            monthly_token_budget=self.monthly_token_budget,
            monthly_spend_budget_usd_micros=self.monthly_spend_budget_usd_micros,
            max_queued_requests=self.max_queued_requests,  # already per replica
        )


@dataclass(frozen=True)
class BucketSpec:
    """The shape of one token bucket."""

    capacity: int  # most units it holds (the burst); a charge larger than this never fits
    rate_per_s: float  # refill speed, units per second

    @classmethod
    def of(cls, per_minute: int | None, burst: int | None) -> BucketSpec | None:
        if per_minute is None:
            return None
        if per_minute == 0:  # nothing allowed, whatever the burst
            return cls(0, 0.0)
        return cls(per_minute if burst is None else burst, per_minute / 60.0)

    def refilled(self, level: float, elapsed_s: float) -> float:
        return min(float(self.capacity), level + max(0.0, elapsed_s) * self.rate_per_s)

    def seconds_until(self, level: float, amount: float) -> float:
        """Seconds until the bucket holds amount (inf: never, the amount is over capacity)."""
        if amount > self.capacity:
            return math.inf
        return (amount - level) / self.rate_per_s if level < amount else 0.0

    def snapshot(self, level: float) -> BucketSnapshot:
        return BucketSnapshot(
            limit=self.capacity,
            remaining=max(0, math.floor(level)),
            reset_s=self.seconds_until(level, self.capacity),
        )


class TokenBucket:
    """One bucket's state in this process (memory backend, fail-open fallback)."""

    def __init__(self, spec: BucketSpec, now_s: float) -> None:
        self.spec = spec
        self.level = float(spec.capacity)  # a new bucket is full
        self.updated_at_s = now_s

    def refill(self, spec: BucketSpec, now_s: float) -> float:
        """Bring the level to now under spec (the tenant's limits may have changed)."""
        self.level = spec.refilled(min(self.level, spec.capacity), now_s - self.updated_at_s)
        self.spec, self.updated_at_s = spec, now_s
        return self.level

    def take(self, amount: float) -> None:
        assert amount <= self.level, "take() after a failed check"
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self.level = min(float(self.spec.capacity), self.level + amount)


@dataclass(frozen=True)
class BucketSnapshot:
    limit: int  # bucket capacity: most that may be spent at once (x-ratelimit-limit-*)
    remaining: int  # whole units left now
    reset_s: float  # seconds until the bucket is full again


@dataclass(frozen=True)
class RateLimitSnapshot:
    """A tenant's rate limits as seen by one admission or release, for the headers."""

    requests: BucketSnapshot | None  # None: no request limit
    tokens: BucketSnapshot | None  # None: no token limit
    num_concurrent: int  # requests of the tenant holding a slot
    max_concurrent: int | None  # None: no concurrency limit


EMPTY_SNAPSHOT = RateLimitSnapshot(None, None, 0, None)


@dataclass(frozen=True)
class LimitLevels:
    """What a tenant's limits hold at one moment (both backends report it; snapshots and
    refusals are derived from it)."""

    requests: float | None  # requests bucket level; None: no request limit
    tokens: float | None  # tokens bucket level; None: no token limit
    num_concurrent: int  # slots held (live leases)
    key_requests: float | None = None  # the API key's own requests bucket; None: none
    key_tokens: float | None = None  # the API key's own tokens bucket; None: none

    def snapshot(self, limits: TenantLimits, key: KeyLimits | None = None) -> RateLimitSnapshot:
        """Per bucket kind, the binding one of the tenant's and the key's: the one with less
        left (the key's on a tie), so the headers show what the next request meets first."""
        requests = _level_snapshot(limits.requests_bucket, self.requests)
        tokens = _level_snapshot(limits.tokens_bucket, self.tokens)
        if key is not None:
            requests = _binding(_level_snapshot(key.requests_bucket, self.key_requests), requests)
            tokens = _binding(_level_snapshot(key.tokens_bucket, self.key_tokens), tokens)
        return RateLimitSnapshot(
            requests=requests,
            tokens=tokens,
            num_concurrent=self.num_concurrent,
            max_concurrent=limits.max_concurrent_requests,
        )

    def charged(self, num_tokens: int) -> LimitLevels:
        """The levels after admitting one request that reserves num_tokens."""
        return LimitLevels(
            requests=None if self.requests is None else self.requests - 1,
            tokens=None if self.tokens is None else self.tokens - num_tokens,
            num_concurrent=self.num_concurrent + 1,
            key_requests=None if self.key_requests is None else self.key_requests - 1,
            key_tokens=None if self.key_tokens is None else self.key_tokens - num_tokens,
        )


def _level_snapshot(spec: BucketSpec | None, level: float | None) -> BucketSnapshot | None:
    return None if spec is None or level is None else spec.snapshot(level)


def _binding(key: BucketSnapshot | None, tenant: BucketSnapshot | None) -> BucketSnapshot | None:
    if key is None or tenant is None:
        return tenant if key is None else key
    return min(key, tenant, key=lambda bucket: (bucket.remaining, bucket.limit))


def check_limits(
    limits: TenantLimits,
    levels: LimitLevels,
    num_tokens: int,
    concurrency_retry_after_s: float,
    key: KeyLimits | None = None,
) -> RateLimited | None:
    """The refusal for a request reserving num_tokens, or None when every limit has room.

    All-or-nothing: a request is admitted only when the requests bucket holds 1, the tokens
    bucket holds num_tokens and a concurrency slot is free, in the tenant's buckets and in
    its key's (key: the key's own limits, if any). The key's bind first: when they refuse,
    they are named (KeyRateLimited). Otherwise, when several limits refuse, the one that
    keeps the request out longest is named and its wait is the retry delay.
    """
    if key is not None:
        key_refusals = _bucket_refusals(
            key.requests_bucket, levels.key_requests, key.tokens_bucket, levels.key_tokens,
            num_tokens, key.api_key_id,
        )
        if key_refusals:
            wait_s, refusal = max(key_refusals, key=lambda item: item[0])
            return refusal(wait_s, levels.snapshot(limits, key))
    # (wait, refusal builder) per limit without room; inf: the request can never fit
    refusals = _bucket_refusals(
        limits.requests_bucket, levels.requests, limits.tokens_bucket, levels.tokens,
        num_tokens, None,
    )
    max_concurrent = limits.max_concurrent_requests
    if max_concurrent is not None and levels.num_concurrent >= max_concurrent:
        wait_s = math.inf if max_concurrent == 0 else concurrency_retry_after_s
        refusals.append(
            (wait_s, partial(_concurrency_refusal, max_concurrent, levels.num_concurrent))
        )
    if not refusals:
        return None
    wait_s, refusal = max(refusals, key=lambda item: item[0])
    return refusal(wait_s, levels.snapshot(limits, key))


def _bucket_refusals(
    requests: BucketSpec | None,
    requests_level: float | None,
    tokens: BucketSpec | None,
    tokens_level: float | None,
    num_tokens: int,
    api_key_id: str | None,
) -> list[tuple[float, partial[RateLimited]]]:
    """(wait, refusal builder) for each of one owner's buckets without room (api_key_id:
    the key's buckets; None: the tenant's)."""
    refusals: list[tuple[float, partial[RateLimited]]] = []
    if requests is not None and requests_level is not None and requests_level < 1:
        wait_s = requests.seconds_until(requests_level, 1)
        refusals.append((wait_s, partial(
            _bucket_refusal, LimitName.REQUESTS, requests, requests_level, 1, api_key_id)))
    if tokens is not None and tokens_level is not None and tokens_level < num_tokens:
        wait_s = tokens.seconds_until(tokens_level, num_tokens)
        refusals.append((wait_s, partial(
            _bucket_refusal, LimitName.TOKENS, tokens, tokens_level, num_tokens, api_key_id)))
    return refusals


def _concurrency_refusal(
    max_concurrent: int, num_concurrent: int, wait_s: float, snapshot: RateLimitSnapshot
) -> RateLimited:
    never = math.isinf(wait_s)
    message = (
        f"Concurrency limit reached: limit {max_concurrent} concurrent requests, "
        f"{num_concurrent} running, remaining 0; a slot frees when one of them ends."
    )
    if not never:
        message += f" Please retry after {format_duration(wait_s)}."
    return RateLimited(
        message,
        LimitName.CONCURRENT_REQUESTS,
        max_concurrent,
        0,
        None,
        None if never else wait_s,
        snapshot,
        should_retry=not never,
    )


_BUCKET_NAMES = {
    LimitName.REQUESTS: "requests per minute (RPM)",
    LimitName.TOKENS: "tokens per minute (TPM)",
}


def _bucket_refusal(
    name: LimitName,
    spec: BucketSpec,
    level: float,
    amount: int,
    api_key_id: str | None,
    wait_s: float,
    snapshot: RateLimitSnapshot,
) -> RateLimited:
    """api_key_id: the bucket is that key's own (KeyRateLimited, named in the message)."""
    remaining = max(0, math.floor(level))
    reset_s = spec.seconds_until(level, spec.capacity)
    requested = " (prompt + max_tokens)" if name is LimitName.TOKENS else ""
    bucket = _BUCKET_NAMES[name]
    if api_key_id is not None:
        bucket = f"API key {api_key_id}'s own {bucket}"
    refused = RateLimited if api_key_id is None else KeyRateLimited
    if math.isinf(wait_s):
        message = (
            f"Request too large for {bucket}: limit {spec.capacity}, "
            f"requested {amount}{requested}. Reduce the request; retrying cannot succeed."
        )
        return refused(
            message, name, spec.capacity, remaining, reset_s, None, snapshot, should_retry=False
        )
    message = (
        f"Rate limit reached for {bucket}: limit {spec.capacity}, "
        f"remaining {remaining}, requested {amount}{requested}; "
        f"resets in {format_duration(reset_s)}. Please retry after {format_duration(wait_s)}."
    )
    return refused(message, name, spec.capacity, remaining, reset_s, wait_s, snapshot)


class LimiterBackend(StrEnum):
    """Where a lease's charge lives, so its release goes to the same place."""

    MEMORY = "memory"
    REDIS = "redis"
    FALLBACK = "fallback"  # the Redis limiter's local buckets while Redis is unreachable


@dataclass(frozen=True)
class RateLimitLease:
    """One admitted request's hold on its tenant's limits; release() gives it back."""

    tenant_id: str
    lease_id: str  # unique; releases are by lease id and idempotent
    num_tokens_reserved: int  # prompt + max_tokens charged to the tokens bucket
    limits: TenantLimits  # as charged (the fallback charges each replica's share)
    backend: LimiterBackend
    snapshot: RateLimitSnapshot  # right after the charge
    budget: BudgetHold | None = None  # the budget tokens it holds in Redis until its release
    key: KeyLimits | None = None  # its API key's own limits as charged (None: none)
    key_budget: BudgetHold | None = None  # the key's budget tokens it holds in Redis


class RateLimiter(Protocol):
    """The limiter interface both backends implement."""

    async def acquire(
        self,
        tenant_id: str,
        limits: TenantLimits,
        num_tokens: int,
        budget: BudgetHold | None = None,
        key: KeyLimits | None = None,
        key_budget: BudgetHold | None = None,
    ) -> RateLimitLease:
        """Charge one request and num_tokens and take a concurrency slot, all or nothing.

        budget: the request holds num_tokens of limits.monthly_token_budget as well, where
        the backend shares budgets between replicas (Redis); a backend local to the process
        leaves budgets to the admission controller's own holds. key: the request's API key's
        own limits, charged in the same step (neither is charged when either refuses);
        key_budget: as budget, for key.monthly_token_budget.
        Raises RateLimited, BudgetExhausted or BudgetHeld (nothing charged), or
        LimiterUnavailable (fail_closed).
        """
        ...

    async def release(self, lease: RateLimitLease, num_tokens_used: int) -> RateLimitSnapshot:
        """Free the lease's slot and refund its unused tokens; a second call does nothing."""
        ...

    async def peek(
        self, tenant_id: str, limits: TenantLimits, key: KeyLimits | None = None
    ) -> LimitLevels | None:
        """The tenant's levels now, charging nothing (the headers of a request refused before
        the limiter was asked, a screen before costly work); None when they cannot be read
        (Redis away, fail_closed)."""
        ...

    async def charge(
        self, tenant_id: str, limits: TenantLimits, num_tokens: int, key: KeyLimits | None = None
    ) -> LimitLevels | None:
        """Take one request and num_tokens from the buckets (the key's too), as far as they
        hold them (never below empty, never refused, no slot): what a request refused after it
        made the gateway work costs its tenant. None when Redis is away and fail_closed
        (nothing charged)."""
        ...

    async def aclose(self) -> None:
        """Stop background work and close connections."""
        ...


def format_duration(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: "20ms", "1s", "6m0s", "1m30.5s".

    Rounded up to the millisecond, so waiting the printed time is always enough.
    """
    total_ms = math.ceil(round(seconds * 1000, 6)) if seconds > 0 else 0
    if total_ms < 1000:
        return f"{total_ms}ms" if total_ms else "0s"
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    whole_s, ms = divmod(rest_ms, 1000)
    secs = f"{whole_s}.{ms:03d}".rstrip("0") if ms else str(whole_s)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rate_limit_headers(
    snapshot: RateLimitSnapshot | None, retry_after_s: float | None = None
) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the limits that exist, plus retry-after(-ms).

    retry-after is whole seconds, retry-after-ms milliseconds, both rounded up (at least 1).
    """
    headers: dict[str, str] = {}
    if snapshot is not None:
        for name, bucket in (("requests", snapshot.requests), ("tokens", snapshot.tokens)):
            if bucket is not None:
                headers[f"x-ratelimit-limit-{name}"] = str(bucket.limit)
                headers[f"x-ratelimit-remaining-{name}"] = str(bucket.remaining)
                headers[f"x-ratelimit-reset-{name}"] = format_duration(bucket.reset_s)
    if retry_after_s is not None and math.isfinite(retry_after_s):
        headers["retry-after"] = str(max(1, math.ceil(round(retry_after_s, 6))))
        headers["retry-after-ms"] = str(max(1, math.ceil(round(retry_after_s * 1000, 6))))
    return headers
