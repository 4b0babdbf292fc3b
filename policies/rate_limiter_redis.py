"""Rate limiter shared by all replicas through Redis: one Lua script call per admission.

Each tenant's state lives under `<prefix>:{<tenant_id>}:...` (one hash tag, so one node):
a requests bucket, a tokens bucket and a sorted set of concurrency leases scored by expiry.
The script (admit.lua) checks and charges all three at once, with Redis's clock. Leases held
by this process are renewed in the background every third of their ttl; a replica that dies
stops renewing and its slots free themselves when the ttl runs out.

An admission whose reply does not come within `timeout_s` may still run in Redis (a slow
network, a stalled server): its lease id is then cancelled in the background (admit.lua's
"cancel": the lease removed and its charge given back if it ran, a tombstone if it has not
yet). A release that cannot reach Redis (it times out, or Redis is marked away) is also
retried in the background, every SETTLE_RETRY_S for as long as the lease could live (off
the request path: the probe interval still bounds what requests wait on). So
a slow or flapping Redis leaves no ghost slots holding the tenant's concurrency.

When Redis cannot be reached within `timeout_s`, the limiter either falls back to local
buckets holding each replica's share of the limits (fail_open) or refuses with
LimiterUnavailable (fail_closed). It then leaves Redis alone except for one probe per
`probe_interval_s`; the first probe that succeeds brings every request back to Redis. Leases
taken on the fallback are released there. A Redis that restarts empty has forgotten the
buckets and leases: limits start afresh, and requests already running no longer hold slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from policies.errors import AdmissionConfigError, LimiterUnavailable
from policies.rate_limiter_memory import DEFAULT_CONCURRENCY_RETRY_AFTER_S, MemoryRateLimiter
from policies.rate_limits import (
    EMPTY_SNAPSHOT,
    LimiterBackend,
    LimitLevels,
    RateLimitLease,
    RateLimitSnapshot,
    TenantLimits,
    check_limits,
)

logger = logging.getLogger(__name__)

_SCRIPT = resources.files("policies").joinpath("admit.lua").read_text()
_SCRIPT_SHA = hashlib.sha1(_SCRIPT.encode()).hexdigest()

# What "Redis is unreachable" looks like; anything else (a script error) is a bug and raises.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis_errors.ConnectionError,  # refused, reset, still loading its data
    redis_errors.TimeoutError,
    redis_errors.ReadOnlyError,  # a replica promoted away from under us
    TimeoutError,  # our own overall deadline
    OSError,
)


# A call that timed out waiting for its reply: unlike a refused connection, its command may
# have reached Redis and run.
_NO_REPLY: tuple[type[BaseException], ...] = (redis_errors.TimeoutError, TimeoutError)
# How often a cancel or release that did not reach Redis is tried again, in the background.
SETTLE_RETRY_S = 0.2


class FailurePolicy(StrEnum):
    FAIL_OPEN = "fail_open"  # local buckets at each replica's share of the limits
    FAIL_CLOSED = "fail_closed"  # refuse with LimiterUnavailable (503)


@dataclass(frozen=True)
class RedisLimiterConfig:
    key_prefix: str = "tiergate"  # keys: <prefix>:{<tenant_id>}:requests|tokens|leases|cancelled
    on_failure: FailurePolicy = FailurePolicy.FAIL_OPEN
    num_replicas: int = 1  # fail_open: each replica enforces limits / num_replicas
    timeout_s: float = 0.1  # longest one admission waits on Redis (socket and overall)
    probe_interval_s: float = 1.0  # while unreachable, try Redis at most this often
    lease_ttl_s: float = 30.0  # a concurrency slot not renewed for this long frees itself
    concurrency_retry_after_s: float = DEFAULT_CONCURRENCY_RETRY_AFTER_S

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise AdmissionConfigError(f"num_replicas must be >= 1, got {self.num_replicas}")
        for name in ("timeout_s", "probe_interval_s", "lease_ttl_s"):
            if getattr(self, name) <= 0:
                raise AdmissionConfigError(f"{name} must be positive, got {getattr(self, name)}")


class RedisRateLimiter:
    """RateLimiter over Redis, with a local fallback or a refusal while Redis is away."""

    def __init__(
        self,
        client: Redis,
        config: RedisLimiterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        owns_client: bool = False,
    ) -> None:
        self._client = client
        self._config = config or RedisLimiterConfig()
        self._clock = clock  # seconds, monotonic; only for probe timing (buckets use Redis TIME)
        self._owns_client = owns_client  # aclose() closes the client and its pool
        self._fallback = MemoryRateLimiter(
            clock, self._config.concurrency_retry_after_s, LimiterBackend.FALLBACK
        )
        self._held: dict[str, set[str]] = {}  # tenant -> Redis lease ids this process holds
        self._renewal: asyncio.Task[None] | None = None
        # Cancellations of timed-out admissions and releases Redis did not take, until each
        # reaches it.
        self._settlements: set[asyncio.Task[None]] = set()
        self.num_cancelled_leases = 0  # of those, admissions that had run (a slot given back)
        self._is_down = False
        self._next_probe_s = 0.0  # while down: when Redis may be tried again
        self.num_script_loads = 0  # NOSCRIPT answers (first use, Redis restarted)

    @classmethod
    def from_url(cls, url: str, config: RedisLimiterConfig | None = None) -> RedisRateLimiter:
        """A limiter with its own connection pool, timeouts bounded by config.timeout_s."""
        config = config or RedisLimiterConfig()
        client = Redis.from_url(url, **cls.client_options(config))
        return cls(client, config, owns_client=True)

    @staticmethod
    def client_options(config: RedisLimiterConfig) -> dict[str, Any]:
        """Keyword options of the Redis client from_url builds."""
        return {
            "socket_timeout": config.timeout_s,
            "socket_connect_timeout": config.timeout_s,
            # one immediate retry replaces a pooled connection that a restart left dead
            "retry": Retry(NoBackoff(), 1),
        }

    @property
    def is_available(self) -> bool:
        """False from a failed Redis call until a probe succeeds."""
        return not self._is_down

    async def acquire(
        self, tenant_id: str, limits: TenantLimits, num_tokens: int
    ) -> RateLimitLease:
        if self._may_try_redis():
            lease_id = uuid.uuid4().hex
            args = self._args("admit", limits, num_tokens, lease_id)
            try:
                reply = await self._run(tenant_id, args)
            except _UNAVAILABLE as exc:
                self._mark_down(exc)
                if isinstance(exc, _NO_REPLY):  # sent, and it may have run
                    self._settle_soon(tenant_id, ["cancel", *args[1:]])
            else:
                self._mark_up()
                return self._admitted(tenant_id, limits, num_tokens, lease_id, reply)
        if self._config.on_failure is FailurePolicy.FAIL_CLOSED:
            raise LimiterUnavailable(
                "The rate limiter is unavailable; please retry shortly.",
                retry_after_s=self._config.probe_interval_s,
            )
        # The replica's share, its Redis leases still running counted in it: a replica
        # that goes back and forth between Redis and its share does not hold both.
        return self._fallback.acquire_now(
            tenant_id, limits.divided(self._config.num_replicas), num_tokens,
            num_held_elsewhere=self._held_count(tenant_id),
        )

    async def release(self, lease: RateLimitLease, num_tokens_used: int) -> RateLimitSnapshot:
        """Free the slot and refund; when Redis is away the lease simply expires there."""
        if lease.backend is not LimiterBackend.REDIS:
            return self._fallback.release_now(lease, num_tokens_used)
        held = self._held.get(lease.tenant_id)
        if held is not None:
            held.discard(lease.lease_id)
            if not held:
                del self._held[lease.tenant_id]
        refund = max(0, lease.num_tokens_reserved - num_tokens_used)
        args = self._args("release", lease.limits, refund, lease.lease_id)
        if not self._may_try_redis():
            self._settle_soon(lease.tenant_id, args)
            return EMPTY_SNAPSHOT
        try:
            reply = await self._run(lease.tenant_id, args)
        except _UNAVAILABLE as exc:
            self._mark_down(exc)
            self._settle_soon(lease.tenant_id, args)  # a second release does nothing more
            return EMPTY_SNAPSHOT
        self._mark_up()
        return _levels(reply).snapshot(lease.limits)

    async def peek(self, tenant_id: str, limits: TenantLimits) -> LimitLevels | None:
        """The levels in Redis; while it is away, the local share (fail_open) or None. Never
        a probe: a refused request does not bring the limiter back to Redis."""
        return await self._without_lease("peek", tenant_id, limits, 0)

    async def charge(
        self, tenant_id: str, limits: TenantLimits, num_tokens: int
    ) -> LimitLevels | None:
        """Charged in Redis; while it is away, to the local share (fail_open) or not at all
        (fail_closed: the local buckets admit nothing there). Never a probe."""
        return await self._without_lease("charge", tenant_id, limits, num_tokens)

    async def _without_lease(
        self, op: str, tenant_id: str, limits: TenantLimits, num_tokens: int
    ) -> LimitLevels | None:
        if self._is_down:
            if self._config.on_failure is FailurePolicy.FAIL_CLOSED:
                return None
            share = limits.divided(self._config.num_replicas)
            if op == "charge":
                return self._fallback.charge_now(tenant_id, share, num_tokens)
            return self._fallback.peek_now(tenant_id, share)
        try:
            reply = await self._run(tenant_id, self._args(op, limits, num_tokens, ""))
        except _UNAVAILABLE as exc:
            self._mark_down(exc)
            return None
        return _levels(reply)

    async def renew_leases(self) -> int:
        """Extend every Redis lease this process holds; returns how many were still held."""
        if self._is_down or not self._held:
            return 0
        ttl_ms = round(self._config.lease_ttl_s * 1000)
        tenants = list(self._held.items())
        replies = await asyncio.gather(
            *(self._run(tenant, ["renew", ttl_ms, *ids]) for tenant, ids in tenants),
            return_exceptions=True,
        )
        num_renewed = 0
        for reply in replies:
            if isinstance(reply, _UNAVAILABLE):
                self._mark_down(reply)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                num_renewed += int(reply)
        return num_renewed

    def _held_count(self, tenant_id: str) -> int:
        """The tenant's Redis leases this replica holds (requests still running)."""
        return len(self._held.get(tenant_id, ()))

    def _settle_soon(self, tenant_id: str, args: list[str | int | float]) -> None:
        """Run a cancel or release that has not reached Redis, in the background: tried
        every SETTLE_RETRY_S until Redis answers, for as long as its lease could live."""
        task = asyncio.get_running_loop().create_task(self._settle(tenant_id, args))
        self._settlements.add(task)
        task.add_done_callback(self._settlements.discard)

    async def _settle(self, tenant_id: str, args: list[str | int | float]) -> None:
        deadline_s = self._clock() + self._config.lease_ttl_s
        while True:
            try:
                reply = await self._run(tenant_id, args)
            except _UNAVAILABLE:
                if self._clock() >= deadline_s:
                    return  # the lease has expired by itself meanwhile
                await asyncio.sleep(SETTLE_RETRY_S)
                continue
            if args[0] == "cancel":
                self.num_cancelled_leases += int(reply[0])
            return

    async def aclose(self) -> None:
        for task in list(self._settlements):
            task.cancel()
        if self._renewal is not None:
            self._renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewal
            self._renewal = None
        if self._owns_client:
            await self._client.aclose()

    # -- Redis calls ------------------------------------------------------------------------

    async def _run(self, tenant_id: str, args: Sequence[str | int | float]) -> Any:
        """The script on the tenant's keys, loading it first if Redis does not know it."""
        prefix = f"{self._config.key_prefix}:{{{tenant_id}}}"
        keys = (
            f"{prefix}:requests", f"{prefix}:tokens", f"{prefix}:leases", f"{prefix}:cancelled"
        )
        async with asyncio.timeout(self._config.timeout_s):
            try:
                return await self._client.evalsha(_SCRIPT_SHA, len(keys), *keys, *args)
            except redis_errors.NoScriptError:
                self.num_script_loads += 1
                await self._client.script_load(_SCRIPT)
                return await self._client.evalsha(_SCRIPT_SHA, len(keys), *keys, *args)

    def _args(
        self, op: str, limits: TenantLimits, num_tokens: int, lease_id: str
    ) -> list[str | int | float]:
        requests, tokens = limits.requests_bucket, limits.tokens_bucket
        max_concurrent = limits.max_concurrent_requests
        return [
            op,
            -1 if requests is None else requests.capacity,
            0.0 if requests is None else requests.rate_per_s,
            -1 if tokens is None else tokens.capacity,
            0.0 if tokens is None else tokens.rate_per_s,
            num_tokens,
            -1 if max_concurrent is None else max_concurrent,
            lease_id,
            round(self._config.lease_ttl_s * 1000),
        ]

    def _admitted(
        self, tenant_id: str, limits: TenantLimits, num_tokens: int, lease_id: str, reply: Any
    ) -> RateLimitLease:
        levels = _levels(reply)
        if not int(reply[0]):
            refusal = check_limits(
                limits, levels, num_tokens, self._config.concurrency_retry_after_s
            )
            assert refusal is not None, "admit.lua and check_limits disagree"
            raise refusal
        self._held.setdefault(tenant_id, set()).add(lease_id)
        if self._renewal is None:
            self._renewal = asyncio.create_task(self._renew_forever())
        return RateLimitLease(
            tenant_id=tenant_id,
            lease_id=lease_id,
            num_tokens_reserved=num_tokens,
            limits=limits,
            backend=LimiterBackend.REDIS,
            snapshot=levels.charged(num_tokens).snapshot(limits),
        )

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.lease_ttl_s / 3)
            try:
                await self.renew_leases()
            except redis_errors.RedisError:
                logger.exception("renewing rate-limit leases failed")

    # -- availability -----------------------------------------------------------------------

    def _may_try_redis(self) -> bool:
        """True when up; when down, True once per probe interval (that caller is the probe)."""
        if not self._is_down:
            return True
        now_s = self._clock()
        if now_s < self._next_probe_s:
            return False
        self._next_probe_s = now_s + self._config.probe_interval_s
        return True

    def _mark_down(self, exc: BaseException) -> None:
        if not self._is_down:
            logger.warning(
                "Redis rate limiter unreachable (%s: %s); %s until it answers",
                type(exc).__name__,
                exc,
                self._config.on_failure.value,
            )
        self._is_down = True
        self._next_probe_s = self._clock() + self._config.probe_interval_s

    def _mark_up(self) -> None:
        if self._is_down:
            logger.warning("Redis rate limiter reachable again")
        self._is_down = False


def _levels(reply: Any) -> LimitLevels:
    """LimitLevels from the script's reply {flag, leases held, requests level, tokens level}."""

    def level(raw: bytes | str) -> float | None:
        value = float(raw)
        return None if value < 0 else value

    return LimitLevels(
        requests=level(reply[2]), tokens=level(reply[3]), num_concurrent=int(reply[1])
    )
