"""Admission: who gets in, checked in order budget (what is used, and the tokens this request
may use within what is left, less what the tenant's requests in flight here hold), SLO
shedding, the tenant's queue on this replica (max_queued_requests: admitted, not yet started
by the engine), rate limits (with Redis, the budget again, less what the tenant's requests on
every replica hold: policies/budget_hold.py).

Shedding is decided before the rate limiter charges anything, not after with a rollback.
Both keep a shed request off the tenant's quota, but a charge-then-refund holds the quota
for a round trip, during which the tenant's concurrent requests on any replica may be
refused for capacity that is not really spent, and it costs a second Redis round trip for a
request that is refused anyway. Shedding charges nothing (it reads engine statistics and
its own count of the prompts admitted since them), so checking it first is exact. When a
request is both over its rate limit and shed, it is reported as shed (the server's state,
with the server's retry delay); its retry then meets the rate limit with the tenant's own
reset time. A shed refusal reads the tenant's limits (peek) only for its headers.

A request made with an API key that has limits of its own (policies/key_limits.py) passes
the key's budgets before the tenant's, and the key's buckets with the tenant's in the
limiter's one atomic step; the key's budget holds are kept per key as the tenant's are per
tenant.

How long decisions take: `tiergate bench admission` (bench.admission; seeded, prints a table).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from engine import SchedulerStats
from policies.budget_hold import BudgetHold, budget_period
from policies.budgets import (
    MonthlyUsage,
    MonthlyUsageSource,
    check_budgets,
    check_key_budgets,
    check_key_reservation,
    check_token_reservation,
)
from policies.errors import QueueFull
from policies.key_limits import KeyLimits
from policies.queue_wait import TenantShare, estimate_queue_wait_s
from policies.rate_limits import (
    RateLimiter,
    RateLimitLease,
    RateLimitSnapshot,
    TenantLimits,
    check_limits,
)
from policies.shedding import ShedConfig, SloShedder
from policies.tiers import TierTable


@dataclass(frozen=True)
class AdmissionRequest:
    tenant_id: str
    tier: str  # tier name in the tier table
    limits: TenantLimits  # the tenant's quota
    num_prompt_tokens: int
    num_max_tokens: int  # max_tokens asked for, or the default maximum
    weight: float = 1.0  # the tenant's fair-share weight inside its tier
    # The served model whose engine runs it (shedding reads that engine's statistics).
    model: str = ""
    key: KeyLimits | None = None  # its API key's own limits; None: the key has none

    @property
    def num_tokens_reserved(self) -> int:
        """Charged to the tokens bucket at admission; the unused part is refunded."""
        return self.num_prompt_tokens + self.num_max_tokens


@dataclass(frozen=True, eq=False)
class AdmissionTicket:
    """An admitted request; hand it back to started() when the engine starts it (its first
    output) and to release() when it ends."""

    request: AdmissionRequest
    lease: RateLimitLease  # the rate-limit charge and concurrency slot

    @property
    def snapshot(self) -> RateLimitSnapshot:
        """The tenant's limits right after admission, for the x-ratelimit-* headers."""
        return self.lease.snapshot


class AdmissionController:
    """Budgets, SLO shedding, queue bounds and rate limits in front of the engine."""

    def __init__(
        self,
        limiter: RateLimiter,
        tiers: TierTable,
        usage: MonthlyUsageSource | None,
        stats: Callable[[str], SchedulerStats],
        shed: ShedConfig | None = None,
    ) -> None:
        self._limiter = limiter
        self._tiers = tiers
        self._usage = usage  # None: budgets are not enforced
        self._stats = stats  # a model's engine's latest scheduler statistics
        self._shed = shed
        # One shedder per model: each engine's queue is its own.
        self._shedders: dict[str, SloShedder] = {}
        # Admitted here, not yet started by the engine: per tenant (max_queued_requests).
        self._num_queued: dict[str, int] = {}
        self._queued_tickets: set[AdmissionTicket] = set()
        # Monthly token budget held by requests admitted here and not yet released.
        self._budget_held: dict[str, int] = {}
        self._budget_tickets: set[AdmissionTicket] = set()
        # The same per API key, for keys with a monthly token budget of their own.
        self._key_budget_held: dict[str, int] = {}
        self._key_budget_tickets: set[AdmissionTicket] = set()

    async def admit(self, request: AdmissionRequest) -> AdmissionTicket:
        """Admit or raise an AdmissionRefused subclass (nothing is charged on refusal).

        BudgetExhausted, Shed, QueueFull, RateLimited, or LimiterUnavailable (Redis down,
        fail_closed);
        UnknownTierError for a tier not in the table.
        """
        limits, key = request.limits, request.key
        has_budget = (
            limits.monthly_token_budget is not None
            or limits.monthly_spend_budget_usd_micros is not None
        )
        # Both totals are read before any check: from the checks to the holds nothing awaits,
        # so admissions of the same key or tenant meanwhile see this one's holds.
        key_usage = None
        if self._usage is not None and key is not None and key.has_budget:
            key_usage = await self._usage.key_monthly_usage(key.api_key_id)
        usage = None
        if self._usage is not None and has_budget:
            usage = await self._usage.monthly_usage(request.tenant_id)
        key_budget = None if key_usage is None else self._check_key_budgets(request, key_usage)
        budget: BudgetHold | None = None
        if usage is not None:
            exhausted = check_budgets(request.tenant_id, limits, usage)
            if exhausted is not None:
                raise exhausted
            short = check_token_reservation(
                request.tenant_id, limits, usage,
                self._budget_held.get(request.tenant_id, 0), request.num_tokens_reserved,
            )
            if short is not None:
                raise short
            if limits.monthly_token_budget is not None:
                budget = BudgetHold(budget_period(), usage.num_tokens)
        shedder = self._shedder(request.model)
        if not shedder.is_exempt(request.tier):
            shed = shedder.check(
                self._stats(request.model), request.tier, request.num_prompt_tokens,
                TenantShare(request.tenant_id, request.weight),
            )
            if shed is not None:
                raise shed
        num_queued = self.num_queued(request.tenant_id)
        if limits.max_queued_requests is not None and num_queued >= limits.max_queued_requests:
            tier = self._tiers[request.tier]
            wait_s = estimate_queue_wait_s(self._stats(request.model), tier.priority, 0)
            raise QueueFull(
                f"{num_queued} of your requests are already waiting for the engine on this "
                f"replica (your limit is {limits.max_queued_requests}); retry once they start",
                retry_after_s=max(0.1, wait_s),
                num_queued=num_queued,
            )
        # This replica's holds are taken before the limiter's await (admissions of the same
        # tenant run meanwhile and must see them), and given back if it refuses.
        budget_tokens = 0 if budget is None else request.num_tokens_reserved
        key_budget_tokens = 0 if key_budget is None else request.num_tokens_reserved
        key_id = "" if key is None else key.api_key_id
        is_queue_counted = limits.max_queued_requests is not None
        _add(self._budget_held, request.tenant_id, budget_tokens)
        _add(self._key_budget_held, key_id, key_budget_tokens)
        _add(self._num_queued, request.tenant_id, int(is_queue_counted))
        try:
            lease = await self._limiter.acquire(
                request.tenant_id, limits, request.num_tokens_reserved, budget, key, key_budget
            )
        except BaseException:
            _add(self._budget_held, request.tenant_id, -budget_tokens)
            _add(self._key_budget_held, key_id, -key_budget_tokens)
            _add(self._num_queued, request.tenant_id, -int(is_queue_counted))
            raise
        shedder.admitted(request.tier, request.num_prompt_tokens, request.tenant_id)
        ticket = AdmissionTicket(request, lease)
        if is_queue_counted:
            self._queued_tickets.add(ticket)
        if budget_tokens:  # until release(), which comes once its usage is in the totals
            self._budget_tickets.add(ticket)
        if key_budget_tokens:
            self._key_budget_tickets.add(ticket)
        return ticket

    def _check_key_budgets(
        self, request: AdmissionRequest, usage: MonthlyUsage
    ) -> BudgetHold | None:
        """Raise when the request's key has spent its own budgets (usage: the key's this
        month) or cannot hold the request's tokens in what is left of them (less what its
        requests in flight here hold); the key's hold for the limiter when it has a token
        budget."""
        key = request.key
        assert key is not None
        refusal = check_key_budgets(key, usage) or check_key_reservation(
            key, usage, self._key_budget_held.get(key.api_key_id, 0),
            request.num_tokens_reserved,
        )
        if refusal is not None:
            raise refusal
        if key.monthly_token_budget is None:
            return None
        return BudgetHold(budget_period(), usage.num_tokens)

    def _shedder(self, model: str) -> SloShedder:
        shedder = self._shedders.get(model)
        if shedder is None:
            shedder = self._shedders[model] = SloShedder(self._tiers, self._shed)
        return shedder

    def started(self, ticket: AdmissionTicket) -> None:
        """The engine has started the request: it no longer counts as queued."""
        if ticket in self._queued_tickets:
            self._queued_tickets.discard(ticket)
            _add(self._num_queued, ticket.request.tenant_id, -1)

    def num_queued(self, tenant_id: str) -> int:
        """The tenant's requests admitted here that the engine has not started (counted for
        tenants with max_queued_requests)."""
        return self._num_queued.get(tenant_id, 0)

    async def release(self, ticket: AdmissionTicket, num_tokens_used: int) -> RateLimitSnapshot:
        """The request ended having used num_tokens_used (prompt + generated): free its slot
        and refund the unused reservation. Calling it twice for a ticket does nothing more."""
        self.started(ticket)  # if it never started, it is not waiting any more either
        if ticket in self._budget_tickets:
            self._budget_tickets.discard(ticket)
            _add(self._budget_held, ticket.request.tenant_id, -ticket.request.num_tokens_reserved)
        if ticket in self._key_budget_tickets and ticket.request.key is not None:
            self._key_budget_tickets.discard(ticket)
            _add(self._key_budget_held, ticket.request.key.api_key_id,
                 -ticket.request.num_tokens_reserved)
        return await self._limiter.release(ticket.lease, num_tokens_used)

    async def peek(self, request: AdmissionRequest) -> RateLimitSnapshot | None:
        """The tenant's rate limits now, charging nothing: for the headers of a refusal that
        came before the limiter was asked (budget, shedding)."""
        levels = await self._limiter.peek(request.tenant_id, request.limits, request.key)
        return None if levels is None else levels.snapshot(request.limits, request.key)

    async def screen(
        self, tenant_id: str, limits: TenantLimits, key: KeyLimits | None = None
    ) -> None:
        """Raise RateLimited when the tenant's buckets (or its key's) hold no request or no
        token, charging nothing: asked before costly work (reading and tokenizing a large
        body), so a tenant out of quota is turned away before it makes the gateway work.
        Concurrency is left to admission (a slot may free meanwhile); an unreadable limiter
        lets the request on."""
        if key is not None and not key.has_rate_limits:
            key = None
        if limits.requests_per_minute is None and limits.tokens_per_minute is None and (
                key is None):
            return  # no bucket to read (with Redis, no round trip)
        levels = await self._limiter.peek(tenant_id, limits, key)
        if levels is None:
            return
        unlimited_slots = dataclasses.replace(limits, max_concurrent_requests=None)
        refusal = check_limits(unlimited_slots, levels, 1, concurrency_retry_after_s=0.0, key=key)
        if refusal is not None:
            refusal.snapshot = levels.snapshot(limits, key)
            raise refusal

    async def charge_refused(
        self, tenant_id: str, limits: TenantLimits, num_tokens: int,
        key: KeyLimits | None = None,
    ) -> None:
        """Charge a request refused after it made the gateway work (a 4xx once its tenant was
        known): one request and the tokens it was found to hold, as far as the buckets go
        (its key's too)."""
        await self._limiter.charge(tenant_id, limits, num_tokens, key)

    async def aclose(self) -> None:
        await self._limiter.aclose()


def _add(counts: dict[str, int], tenant_id: str, delta: int) -> None:
    """counts[tenant_id] += delta, the key dropped at 0."""
    if not delta:
        return
    total = counts.get(tenant_id, 0) + delta
    if total:
        counts[tenant_id] = total
    else:
        counts.pop(tenant_id, None)
