"""Admission control at the gateway: the policies' AdmissionController behind the routes,
its refusals translated to OpenAI-shaped 429/503 errors with truthful retry headers.

Limits come from the caller's quota row (TenantPrincipal.quota) and its API key's own
(TenantPrincipal.key_quota, binding first; a refusal by them has code
key_rate_limit_exceeded or key_budget_exceeded); a Redis URL shares the
buckets across replicas, otherwise they live in this process. Every response, streaming or
not, carries the tenant's x-ratelimit-* headers as of its admission; a refusal carries them
as of its refusal (read without charging when it came before the limiter: budget, shedding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine import SchedulerStats
from gateway.access.auth import TenantPrincipal
from gateway.http.errors import (
    GatewayError,
    InsufficientQuotaError,
    RateLimitError,
    ServiceUnavailableError,
)
from policies import (
    AdmissionController,
    AdmissionRefused,
    AdmissionRequest,
    AdmissionTicket,
    BudgetExhausted,
    FailurePolicy,
    KeyLimits,
    LimiterUnavailable,
    MemoryRateLimiter,
    MonthlyUsageSource,
    ParseTimeBudget,
    RateLimiter,
    RedisLimiterConfig,
    RedisRateLimiter,
    ShedConfig,
    TenantLimits,
    TierTable,
    rate_limit_headers,
)


@dataclass(frozen=True)
class AdmissionGrant:
    """A request let in: what release() needs, and the headers every response carries."""

    ticket: AdmissionTicket
    # x-ratelimit-* headers as of the admission.
    headers: Mapping[str, str] = field(default_factory=dict)


class AdmissionRefusal(GatewayError):
    """Raised when admission says no; reason is the tiergate_rejections_total label."""

    reason: str = ""
    retry_after_s: float | None = None  # the retry-after headers' delay, unrounded


class RateLimitRefusal(AdmissionRefusal, RateLimitError):
    pass


class QuotaRefusal(AdmissionRefusal, InsufficientQuotaError):
    pass


class LimiterDownRefusal(AdmissionRefusal, ServiceUnavailableError):
    default_code: ClassVar[str | None] = "rate_limiter_unavailable"


@dataclass(frozen=True)
class AdmissionSettings:
    """The `admission:` section of the config file."""

    # fail_open: local buckets at limit / num_replicas while Redis is away; fail_closed: 503.
    on_redis_failure: FailurePolicy = FailurePolicy.FAIL_OPEN
    # Replicas sharing the limits (fail_open divides by it).
    num_replicas: int = 1
    # Shed a tier when its estimated queue wait passes this share of its TTFT SLO.
    shed_slo_fraction: float = 0.8
    # Off: no SLO shedding (rate limits and budgets still apply).
    enable_shedding: bool = True
    # Redis keys are <prefix>:{<tenant_id>}:...; deployments (or test runs) sharing one Redis
    # with separate tenant tables need separate prefixes, as tenant ids restart at 1.
    redis_key_prefix: str = "tiergate"
    # Longest one admission waits on Redis before the on_redis_failure policy applies.
    redis_timeout_s: float = 0.1

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.shed_slo_fraction <= 0:
            raise ValueError(f"shed_slo_fraction must be positive, got {self.shed_slo_fraction}")
        if self.redis_timeout_s <= 0:
            raise ValueError(f"redis_timeout_s must be positive, got {self.redis_timeout_s}")
        if not self.redis_key_prefix:
            raise ValueError("redis_key_prefix must not be empty")

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> AdmissionSettings:
        section = dict(section or {})
        policy = section.pop("on_redis_failure", "fail_open")
        try:
            return cls(on_redis_failure=FailurePolicy(policy), **section)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"admission section: {exc}") from None


class GatewayAdmission:
    """The controller as the routes use it: refusals become GatewayErrors with headers."""

    def __init__(
        self,
        controller: AdmissionController,
        redis: RedisRateLimiter | None = None,
        parse_time: ParseTimeBudget | None = None,
    ) -> None:
        self.controller = controller
        self._redis = redis  # the controller's limiter when it is Redis's
        self.parse_time = parse_time or ParseTimeBudget()

    @property
    def redis_up(self) -> bool | None:
        """Whether the shared limiter reaches Redis now; None without Redis."""
        return None if self._redis is None else self._redis.is_available

    async def admit(
        self, principal: TenantPrincipal, *, model: str, num_prompt_tokens: int,
        num_max_tokens: int,
    ) -> AdmissionGrant:
        """model: the served model whose engine runs the request."""
        request = AdmissionRequest(
            tenant_id=str(principal.tenant_id),
            tier=principal.tier,
            limits=_limits(principal),
            num_prompt_tokens=num_prompt_tokens,
            num_max_tokens=num_max_tokens,
            weight=principal.weight,
            model=model,
            key=_key_limits(principal),
        )
        try:
            ticket = await self.controller.admit(request)
        except AdmissionRefused as refused:
            if refused.snapshot is None:
                # refused before the limiter was asked: its headers still show the limits
                refused.snapshot = await self.controller.peek(request)
            raise _translate(refused) from None
        return AdmissionGrant(ticket=ticket, headers=rate_limit_headers(ticket.snapshot))

    async def screen(self, principal: TenantPrincipal) -> None:
        """429 now, before the gateway reads or tokenizes a large body, when the tenant's
        rate limits have no request or no token left (charges nothing)."""
        try:
            await self.controller.screen(
                str(principal.tenant_id), _limits(principal), _key_limits(principal))
        except AdmissionRefused as refused:
            raise _translate(refused) from None

    def check_parse_time(self, principal: TenantPrincipal) -> None:
        """429 now, before a large body is read, when the tenant's large bodies have taken
        their share of this replica's event loop (policies.parse_time)."""
        try:
            self.parse_time.check(str(principal.tenant_id))
        except AdmissionRefused as refused:
            raise _translate(refused) from None

    def spend_parse_time(self, principal: TenantPrincipal, seconds: float) -> None:
        """A large body of the tenant's took this long to parse, on the event loop."""
        self.parse_time.spend(str(principal.tenant_id), seconds)

    async def charge_refused(self, principal: TenantPrincipal, num_tokens: int) -> None:
        """A request refused with a 4xx after authentication still costs its tenant one
        request and the tokens it was found to hold, so bad requests are rate-limited too."""
        await self.controller.charge_refused(
            str(principal.tenant_id), _limits(principal), num_tokens, _key_limits(principal)
        )

    def started(self, grant: AdmissionGrant) -> None:
        """The engine produced the request's first output: it is no longer queued."""
        self.controller.started(grant.ticket)

    async def release(self, grant: AdmissionGrant, num_tokens_used: int) -> None:
        await self.controller.release(grant.ticket, num_tokens_used)

    async def aclose(self) -> None:
        await self.controller.aclose()


def build_admission(
    settings: AdmissionSettings,
    tiers: TierTable,
    redis_url: str | None,
    stats: Callable[[str], SchedulerStats],
    usage: MonthlyUsageSource | None,
) -> GatewayAdmission:
    limiter: RateLimiter
    redis: RedisRateLimiter | None = None
    if redis_url:
        limiter = redis = RedisRateLimiter.from_url(
            redis_url,
            RedisLimiterConfig(
                key_prefix=settings.redis_key_prefix,
                on_failure=settings.on_redis_failure,
                num_replicas=settings.num_replicas,
                timeout_s=settings.redis_timeout_s,
            ),
        )
    else:
        limiter = MemoryRateLimiter()
    # A threshold no estimate reaches turns shedding off without a second code path.
    shed = ShedConfig(slo_fraction=settings.shed_slo_fraction if settings.enable_shedding
                      else math.inf)
    return GatewayAdmission(AdmissionController(limiter, tiers, usage, stats, shed), redis)


def _limits(principal: TenantPrincipal) -> TenantLimits:
    quota = principal.quota
    return TenantLimits(
        requests_per_minute=quota.requests_per_minute,
        tokens_per_minute=quota.tokens_per_minute,
        burst_requests=quota.burst_requests,
        burst_tokens=quota.burst_tokens,
        max_concurrent_requests=quota.max_concurrent_requests,
        monthly_token_budget=quota.monthly_token_budget,
        monthly_spend_budget_usd_micros=quota.monthly_spend_budget_usd_micros,
        max_queued_requests=quota.max_queued_requests,
    )


def _key_limits(principal: TenantPrincipal) -> KeyLimits | None:
    """The key's own limits, or None when it has none (nothing more to check or charge)."""
    quota = principal.key_quota
    key = KeyLimits(
        api_key_id=str(principal.api_key_id),
        requests_per_minute=quota.requests_per_minute,
        tokens_per_minute=quota.tokens_per_minute,
        monthly_token_budget=quota.monthly_token_budget,
        monthly_spend_budget_usd_micros=quota.monthly_spend_budget_usd_micros,
    )
    return key if key.has_rate_limits or key.has_budget else None


def _translate(refused: AdmissionRefused) -> AdmissionRefusal:
    headers: dict[str, str] = {}
    if refused.snapshot is not None:
        headers.update(rate_limit_headers(refused.snapshot, refused.retry_after_s))
    elif refused.retry_after_s is not None:
        ms = max(1, math.ceil(refused.retry_after_s * 1000))
        headers.update({"retry-after": str(math.ceil(ms / 1000)), "retry-after-ms": str(ms)})
    if not refused.should_retry:
        headers["x-should-retry"] = "false"
    error: AdmissionRefusal
    if isinstance(refused, BudgetExhausted):
        error = QuotaRefusal(refused.message, headers=headers, code=refused.code)
    elif isinstance(refused, LimiterUnavailable):
        error = LimiterDownRefusal(refused.message, headers=headers, code=refused.code)
    else:
        error = RateLimitRefusal(refused.message, headers=headers, code=refused.code)
    error.reason = str(refused.reason)
    error.retry_after_s = refused.retry_after_s
    return error
