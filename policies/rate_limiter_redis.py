"""Rate limiter shared by all replicas through Redis: one Lua script call per admission.

Each tenant's state lives under `<prefix>:{<tenant_id>}:...` (one hash tag, so one node):
a requests bucket, a tokens bucket and a sorted set of concurrency leases scored by expiry,
and under `<prefix>:{<tenant_id>}:key:<api_key_id>:...` its keys' own buckets and budget
counts (policies/key_limits.py). The script (admit.lua) checks and charges them all at once,
with Redis's clock. Leases held by this process are renewed in the background every third
of their ttl; a replica that dies stops renewing and its slots free themselves when the ttl
runs out.

An admission whose reply does not come within `timeout_s` may still run in Redis (a slow
network, a stalled server): its lease id is then cancelled in the background (admit.lua's
"cancel": the lease removed and its charge given back if it ran, a tombstone if it has not
yet). A release that cannot reach Redis (it times out, or Redis is marked away) is also
retried in the background, every SETTLE_RETRY_S for as long as the lease could live (off
the request path: the probe interval still bounds what requests wait on). So
a slow or flapping Redis leaves no ghost slots holding the tenant's concurrency.

When Redis cannot be reached within `timeout_s`, the limiter either falls back to local
buckets holding each replica's share of the limits (fail_open) or refuses with
LimiterUnavailable (fail_closed). It then leaves Redis alone except for one probe (an
admission sent to Redis) at a time, the first `first_probe_s` after the failure and each
next one twice as late, up to `probe_interval_s`: a stall of a fraction of a second keeps a
replica off Redis about as long, an outage costs a probe a second. The first probe that
succeeds brings every request back to Redis.

Leases taken on the fallback are released there. Once Redis answers again, those still
running are adopted into it (admit.lua's "adopt": slots taken, nothing charged), so the
other replicas count them instead of filling the whole limit beside them; each is dropped
from Redis when it ends. For `fallback_view_s` after its last answer from Redis about a
tenant, a replica on its share also leaves the slots the other replicas held then, so a
stall of a fraction of a second does not let every replica add its share to a limit already
full. What fail_open may still over-admit is the shares of the replicas off Redis, for as
long as they are. A Redis that restarts empty has forgotten the buckets and leases: limits
start afresh, and requests already running no longer hold slots.

Monthly token budgets are held here too (policies/budget_hold.py): an admission that holds
budget tokens is refused unless they fit within the budget less the month's tokens used and
the tokens every replica's running requests hold, all kept in Redis. The count of tokens
used grows by each release and never falls below what the admitting replica's ledger knows;
a Redis that restarts empty starts it again from there. While Redis is away, each replica
holds budgets on its own (the admission controller's holds): a tenant may then overshoot by
what the other replicas admit meanwhile.
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

from policies.budget_hold import BudgetHold
from policies.budgets import MonthlyUsage, check_key_reservation, check_token_reservation
from policies.errors import (
    AdmissionConfigError,
    AdmissionRefused,
    LimiterUnavailable,
)
from policies.key_limits import KeyLimits
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
    # keys: <prefix>:{<tenant_id>}:requests|tokens|leases|cancelled|budget|holds, and
    # <prefix>:{<tenant_id>}:key:<api_key_id>:requests|tokens|budget|holds
    key_prefix: str = "tiergate"
    on_failure: FailurePolicy = FailurePolicy.FAIL_OPEN
    num_replicas: int = 1  # fail_open: each replica enforces limits / num_replicas
    timeout_s: float = 0.1  # longest one admission waits on Redis (socket and overall)
    first_probe_s: float = 0.1  # while unreachable, the first probe this long after the failure
    probe_interval_s: float = 1.0  # and each next one twice as late, up to this
    lease_ttl_s: float = 30.0  # a concurrency slot not renewed for this long frees itself
    # fail_open: how long the slots other replicas held at the last answer still count
    fallback_view_s: float = 5.0
    concurrency_retry_after_s: float = DEFAULT_CONCURRENCY_RETRY_AFTER_S

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise AdmissionConfigError(f"num_replicas must be >= 1, got {self.num_replicas}")
        for name in ("timeout_s", "first_probe_s", "probe_interval_s", "lease_ttl_s"):
            if getattr(self, name) <= 0:
                raise AdmissionConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.fallback_view_s < 0:
            raise AdmissionConfigError(
                f"fallback_view_s must not be negative, got {self.fallback_view_s}"
            )


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
        # tenant -> fallback lease ids adopted into Redis (or on their way), until they end
        self._adopted: dict[str, set[str]] = {}
        # tenant -> (when, slots the other replicas held) at the last Redis answer
        self._others_seen: dict[str, tuple[float, int]] = {}
        self._renewal: asyncio.Task[None] | None = None
        # Cancellations of timed-out admissions and releases Redis did not take, until each
        # reaches it.
        self._settlements: set[asyncio.Task[None]] = set()
        self.num_cancelled_leases = 0  # of those, admissions that had run (a slot given back)
        self._is_down = False
        self._next_probe_s = 0.0  # while down: when Redis may be tried again
        self._probe_delay_s = self._config.first_probe_s  # while down: from a probe to the next
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
        self,
        tenant_id: str,
        limits: TenantLimits,
        num_tokens: int,
        budget: BudgetHold | None = None,
        key: KeyLimits | None = None,
        key_budget: BudgetHold | None = None,
    ) -> RateLimitLease:
        if limits.monthly_token_budget is None:
            budget = None
        if key is None or key.monthly_token_budget is None:
            key_budget = None
        if self._may_try_redis():
            lease_id = uuid.uuid4().hex
            args = self._args(
                "admit", limits, num_tokens, lease_id,
                budget, 0 if budget is None else budget.num_tokens_used,
                key, key_budget, 0 if key_budget is None else key_budget.num_tokens_used,
            )
            try:
                reply = await self._run(tenant_id, args, key)
            except _UNAVAILABLE as exc:
                self._mark_down(exc)
                if isinstance(exc, _NO_REPLY):  # sent, and it may have run
                    self._settle_soon(tenant_id, ["cancel", *args[1:]], key)
            else:
                self._mark_up()
                return self._admitted(
                    tenant_id, limits, num_tokens, lease_id, budget, reply, key, key_budget
                )
        if self._config.on_failure is FailurePolicy.FAIL_CLOSED:
            raise LimiterUnavailable(
                "The rate limiter is unavailable; please retry shortly.",
                retry_after_s=self._config.probe_interval_s,
            )
        # The replica's share, its Redis leases still running counted in it: a replica
        # that goes back and forth between Redis and its share does not hold both.
        share = limits.divided(self._config.num_replicas)
        return self._fallback.acquire_now(
            tenant_id, share, num_tokens,
            num_held_elsewhere=self._held_count(tenant_id)
            + self._others_over_share(tenant_id, limits, share),
            key=None if key is None else key.divided(self._config.num_replicas),
        )

    async def release(self, lease: RateLimitLease, num_tokens_used: int) -> RateLimitSnapshot:
        """Free the slot and refund; when Redis is away the lease simply expires there."""
        if lease.backend is not LimiterBackend.REDIS:
            adopted = self._adopted.get(lease.tenant_id)
            if adopted is not None and lease.lease_id in adopted:
                _discard(self._adopted, lease.tenant_id, lease.lease_id)
                ttl_ms = round(self._config.lease_ttl_s * 1000)
                self._settle_soon(lease.tenant_id, ["drop", ttl_ms, lease.lease_id])
            return self._fallback.release_now(lease, num_tokens_used)
        _discard(self._held, lease.tenant_id, lease.lease_id)
        refund = max(0, lease.num_tokens_reserved - num_tokens_used)
        args = self._args(
            "release", lease.limits, refund, lease.lease_id, lease.budget, num_tokens_used,
            lease.key, lease.key_budget, num_tokens_used,
        )
        if not self._may_try_redis():
            self._settle_soon(lease.tenant_id, args, lease.key)
            return EMPTY_SNAPSHOT
        try:
            reply = await self._run(lease.tenant_id, args, lease.key)
        except _UNAVAILABLE as exc:
            self._mark_down(exc)
            # a second release does nothing more
            self._settle_soon(lease.tenant_id, args, lease.key)
            return EMPTY_SNAPSHOT
        self._mark_up()
        self._saw(lease.tenant_id, int(reply[1]))
        return _levels(reply).snapshot(lease.limits, lease.key)

    async def peek(
        self, tenant_id: str, limits: TenantLimits, key: KeyLimits | None = None
    ) -> LimitLevels | None:
        """The levels in Redis; while it is away, the local share (fail_open) or None. Never
        a probe: a refused request does not bring the limiter back to Redis."""
        return await self._without_lease("peek", tenant_id, limits, 0, key)

    async def charge(
        self, tenant_id: str, limits: TenantLimits, num_tokens: int, key: KeyLimits | None = None
    ) -> LimitLevels | None:
        """Charged in Redis; while it is away, to the local share (fail_open) or not at all
        (fail_closed: the local buckets admit nothing there). Never a probe."""
        return await self._without_lease("charge", tenant_id, limits, num_tokens, key)

    async def _without_lease(
        self, op: str, tenant_id: str, limits: TenantLimits, num_tokens: int,
        key: KeyLimits | None,
    ) -> LimitLevels | None:
        if self._is_down:
            if self._config.on_failure is FailurePolicy.FAIL_CLOSED:
                return None
            share = limits.divided(self._config.num_replicas)
            key_share = None if key is None else key.divided(self._config.num_replicas)
            if op == "charge":
                return self._fallback.charge_now(tenant_id, share, num_tokens, key_share)
            return self._fallback.peek_now(tenant_id, share, key_share)
        try:
            reply = await self._run(
                tenant_id, self._args(op, limits, num_tokens, "", key=key), key)
        except _UNAVAILABLE as exc:
            self._mark_down(exc)
            return None
        return _levels(reply)

    async def renew_leases(self) -> int:
        """Extend every Redis lease this process holds (its adopted ones too); returns how
        many were still held."""
        held = {tenant: set(ids) for tenant, ids in self._held.items()}
        for tenant, ids in self._adopted.items():
            held.setdefault(tenant, set()).update(ids)
        if self._is_down or not held:
            return 0
        ttl_ms = round(self._config.lease_ttl_s * 1000)
        tenants = list(held.items())
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

    def _saw(self, tenant_id: str, num_in_redis: int) -> None:
        """Redis answered that num_in_redis of the tenant's slots are held."""
        own = self._held_count(tenant_id) + len(self._adopted.get(tenant_id, ()))
        self._others_seen[tenant_id] = (self._clock(), max(0, num_in_redis - own))

    def _others_over_share(
        self, tenant_id: str, limits: TenantLimits, share: TenantLimits
    ) -> int:
        """Slots to count against the replica's share beyond its own: what the other
        replicas held at the last Redis answer, past what the limit leaves beside the share
        (the share then holds at most limit - theirs), while that answer is recent."""
        seen = self._others_seen.get(tenant_id)
        limit, own_share = limits.max_concurrent_requests, share.max_concurrent_requests
        if seen is None or limit is None or own_share is None:
            return 0
        seen_at_s, num_others = seen
        if self._clock() - seen_at_s > self._config.fallback_view_s:
            del self._others_seen[tenant_id]
            return 0
        return max(0, num_others - (limit - own_share))

    def _settle_soon(
        self, tenant_id: str, args: list[str | int | float], key: KeyLimits | None = None
    ) -> None:
        """Run a cancel or release that has not reached Redis, in the background: tried
        every SETTLE_RETRY_S until Redis answers, for as long as its lease could live."""
        task = asyncio.get_running_loop().create_task(self._settle(tenant_id, args, key))
        self._settlements.add(task)
        task.add_done_callback(self._settlements.discard)

    async def _settle(
        self, tenant_id: str, args: list[str | int | float], key: KeyLimits | None
    ) -> None:
        deadline_s = self._clock() + self._config.lease_ttl_s
        while True:
            try:
                reply = await self._run(tenant_id, args, key)
            except _UNAVAILABLE:
                if self._clock() >= deadline_s:
                    return  # the lease has expired by itself meanwhile
                await asyncio.sleep(SETTLE_RETRY_S)
                continue
            if args[0] == "cancel":
                self.num_cancelled_leases += int(reply[0])
            return

    def _adopt_soon(self) -> None:
        """Register the fallback's running leases in Redis, in the background (Redis has
        just answered again)."""
        leases = self._fallback.lease_ids()
        for tenant_id, ids in leases.items():
            self._adopted.setdefault(tenant_id, set()).update(ids)
            ttl_ms = round(self._config.lease_ttl_s * 1000)
            self._settle_soon(tenant_id, ["adopt", ttl_ms, *sorted(ids)])

    async def aclose(self) -> None:
        # The background settlements end before the client closes: one cancelled mid-command
        # and left to finish later could take a connection the closed pool never sees again.
        settlements = list(self._settlements)
        for task in settlements:
            task.cancel()
        await asyncio.gather(*settlements, return_exceptions=True)
        if self._renewal is not None:
            self._renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewal
            self._renewal = None
        if self._owns_client:
            await self._client.aclose()

    # -- Redis calls ------------------------------------------------------------------------

    async def _run(
        self, tenant_id: str, args: Sequence[str | int | float], key: KeyLimits | None = None
    ) -> Any:
        """The script on the tenant's keys (and its API key's; a request without one names
        keys the script never touches), loading it first if Redis does not know it."""
        prefix = f"{self._config.key_prefix}:{{{tenant_id}}}"
        key_prefix = f"{prefix}:key:{'-' if key is None else key.api_key_id}"
        keys = (
            *(f"{prefix}:{name}" for name in _KEY_NAMES),
            *(f"{key_prefix}:{name}" for name in _API_KEY_NAMES),
        )
        async with asyncio.timeout(self._config.timeout_s):
            try:
                return await self._client.evalsha(_SCRIPT_SHA, len(keys), *keys, *args)
            except redis_errors.NoScriptError:
                self.num_script_loads += 1
                await self._client.script_load(_SCRIPT)
                return await self._client.evalsha(_SCRIPT_SHA, len(keys), *keys, *args)

    def _args(
        self,
        op: str,
        limits: TenantLimits,
        num_tokens: int,
        lease_id: str,
        budget: BudgetHold | None = None,
        budget_tokens: int = 0,
        key: KeyLimits | None = None,
        key_budget: BudgetHold | None = None,
        key_budget_tokens: int = 0,
    ) -> list[str | int | float]:
        """admit.lua's arguments; budget_tokens: the month's tokens used as this replica
        knows them (admit) or the tokens the request used (release); key_budget_tokens: the
        same for the API key's own budget."""
        requests, tokens = limits.requests_bucket, limits.tokens_bucket
        max_concurrent = limits.max_concurrent_requests
        budget_limit = limits.monthly_token_budget
        key_requests = None if key is None else key.requests_bucket
        key_tokens = None if key is None else key.tokens_bucket
        key_budget_limit = None if key is None else key.monthly_token_budget
        period = budget.period if budget is not None else (
            "" if key_budget is None else key_budget.period)
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
            -1 if budget is None or budget_limit is None else budget_limit,
            period,
            budget_tokens,
            -1 if key_requests is None else key_requests.capacity,
            0.0 if key_requests is None else key_requests.rate_per_s,
            -1 if key_tokens is None else key_tokens.capacity,
            0.0 if key_tokens is None else key_tokens.rate_per_s,
            -1 if key_budget is None or key_budget_limit is None else key_budget_limit,
            key_budget_tokens,
        ]

    def _admitted(
        self,
        tenant_id: str,
        limits: TenantLimits,
        num_tokens: int,
        lease_id: str,
        budget: BudgetHold | None,
        reply: Any,
        key: KeyLimits | None = None,
        key_budget: BudgetHold | None = None,
    ) -> RateLimitLease:
        levels = _levels(reply)
        self._saw(tenant_id, int(reply[1]))  # taken before any lease of this admission
        if not int(reply[0]):
            # The key's limits are named before the tenant's, as admission checks them.
            refusal: AdmissionRefused | None = None
            if key is not None and key_budget is not None and float(reply[8]) >= 0:
                used = int(float(reply[8]))
                refusal = check_key_reservation(
                    key, MonthlyUsage(used, 0), int(float(reply[9])), num_tokens
                )
            if refusal is None and budget is not None and float(reply[4]) >= 0:
                used = int(float(reply[4]))  # the budget was read
                refusal = check_token_reservation(
                    tenant_id, limits, MonthlyUsage(used, 0), int(float(reply[5])), num_tokens
                )
            refusal = refusal or check_limits(
                limits, levels, num_tokens, self._config.concurrency_retry_after_s, key
            )
            assert refusal is not None, "admit.lua and the Python rules disagree"
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
            snapshot=levels.charged(num_tokens).snapshot(limits, key),
            budget=budget,
            key=key,
            key_budget=key_budget,
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
        self._next_probe_s = now_s + self._probe_delay_s
        return True

    def _mark_down(self, exc: BaseException) -> None:
        if not self._is_down:
            logger.warning(
                "Redis rate limiter unreachable (%s: %s); %s until it answers",
                type(exc).__name__,
                exc,
                self._config.on_failure.value,
            )
            self._probe_delay_s = self._config.first_probe_s
        else:  # a probe failed
            self._probe_delay_s *= 2
        self._probe_delay_s = min(self._probe_delay_s, self._config.probe_interval_s)
        self._is_down = True
        self._next_probe_s = self._clock() + self._probe_delay_s

    def _mark_up(self) -> None:
        if self._is_down:
            logger.warning("Redis rate limiter reachable again")
            self._is_down = False
            self._adopt_soon()


_KEY_NAMES = ("requests", "tokens", "leases", "cancelled", "budget", "holds")
_API_KEY_NAMES = ("requests", "tokens", "budget", "holds")  # under <tenant's>:key:<id>


def _discard(ids_by_tenant: dict[str, set[str]], tenant_id: str, lease_id: str) -> None:
    ids = ids_by_tenant.get(tenant_id)
    if ids is not None:
        ids.discard(lease_id)
        if not ids:
            del ids_by_tenant[tenant_id]


def _levels(reply: Any) -> LimitLevels:
    """LimitLevels from the script's reply {flag, leases held, requests level, tokens level,
    budget used, budget held, key requests level, key tokens level, key budget used, key
    budget held}."""

    def level(raw: bytes | str) -> float | None:
        value = float(raw)
        return None if value < 0 else value

    return LimitLevels(
        requests=level(reply[2]), tokens=level(reply[3]), num_concurrent=int(reply[1]),
        key_requests=level(reply[6]), key_tokens=level(reply[7]),
    )
