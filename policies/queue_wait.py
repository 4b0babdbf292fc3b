"""How long a new request would wait for its prompt to be computed, from the engine's
statistics (`engine.SchedulerStats`): what SLO shedding and the operators' read-outs use.

Under the tiered policy a request waits for the more important tiers' backlog and, inside
its own tier, for what fair sharing serves before it; under FCFS for everything queued.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from engine import Arrivals, SchedulerStats, TierStats, tier_allowance

# Least share of a measured rate a tier is assumed to keep while the tiers above it arrive at
# least as fast: its wait is then long (20x what the backlog alone takes), not infinite.
_MIN_SERVICE_SHARE = 0.05


@dataclass(frozen=True)
class Unseen:
    """Admissions the statistics may not include yet, by (priority, tenant id)."""

    tokens: Mapping[tuple[int, str], int] = field(default_factory=dict)  # prompt tokens
    requests: Mapping[tuple[int, str], int] = field(default_factory=dict)


@dataclass(frozen=True)
class TenantShare:
    """Who a new request belongs to, for the fair-share part of the queue-wait estimate."""

    tenant_id: str
    weight: float = 1.0


def tenant_share_ahead(
    pending_by_tenant: Mapping[str, int],
    weights: Mapping[str, float],
    tenant: TenantShare,
    own_amount: int,
) -> float:
    """How much of its own tier's backlog (prefill tokens, or waiting requests) is served
    before a new request of `tenant`, bringing own_amount of it, is.

    Inside a tier the queue shares service between tenants by weight (VTC): while the tenant
    gets its own backlog and this request served, another tenant u gets at most the same
    amount scaled by w_u / w_tenant, and never more than u has waiting. So a light tenant's
    request waits for little of a heavy tenant's backlog, and the heavy tenant's for all of
    its own. (Virtual counters carry some history, so this is an estimate, as the rates
    are.)
    """
    own = pending_by_tenant.get(tenant.tenant_id, 0)
    served_own = own + own_amount
    ahead = float(own)
    for tenant_id, num_pending in pending_by_tenant.items():
        if tenant_id == tenant.tenant_id:
            continue
        share = served_own * weights.get(tenant_id, 1.0) / tenant.weight
        ahead += min(float(num_pending), share)
    return ahead


def estimate_queue_wait_s(
    stats: SchedulerStats,
    priority: int,
    num_prompt_tokens: int,
    tenant: TenantShare | None = None,
    unseen: Unseen | None = None,
) -> float:
    """Seconds until a new request of this priority would have its prompt computed.

    The longer of two waits (0 for one whose rate is not measured yet):
    - for its prompt: the prefill work ahead of it plus its own prompt, over the prefill
      tokens per second it is served at;
    - for a place in the batch: the requests waiting ahead of it, itself included, beyond
      the places free to it, over the places per second it is given.
    The rates are what the engine measures (backlog drain, requests leaving the batch)
    less what more important tiers bring in while it waits. Ahead of it: every tier
    under FCFS; with tiers, the more important tiers' whole backlog and, inside its own
    tier, either all of it (tenant None) or what fair sharing serves first
    (`tenant_share_ahead`). unseen: admissions since these statistics were taken.
    """
    unseen = unseen or Unseen()
    prefill_s = 0.0
    prefill_rate = prefill_service_rate(stats, priority)
    if prefill_rate:
        tokens_ahead = _ahead(stats,
            priority,
            tenant,
            num_prompt_tokens,
            lambda t: (t.num_pending_prefill_tokens, t.pending_prefill_tokens_by_tenant),
            unseen.tokens,
        )
        prefill_s = (tokens_ahead + num_prompt_tokens) / prefill_rate
    batch_s = 0.0
    place_rate = place_service_rate(stats, priority)
    if place_rate:
        requests_ahead = _ahead(stats,
            priority,
            tenant,
            1,
            lambda t: (t.num_waiting, t.num_waiting_by_tenant),
            unseen.requests,
        )
        batch_s = max(0.0, requests_ahead + 1 - free_places(stats, priority)) / place_rate
    return max(prefill_s, batch_s)


def prefill_service_rate(stats: SchedulerStats, priority: int) -> float | None:
    """Prefill tokens per second a queued request of this priority is drained at: the
    measured drain rate less the prompt tokens more important tiers bring in meanwhile
    (under FCFS what arrives later is behind it); never under 5 % of the drain rate."""
    return _less_arrivals_above(stats,
        stats.prefill_tokens_per_s, priority, lambda a: a.prompt_tokens_per_s
    )


def place_service_rate(stats: SchedulerStats, priority: int) -> float | None:
    """Places in the batch per second given to queued requests of this priority: the
    measured rate requests leave it less the requests more important tiers bring in (one
    of theirs that preempts one of this tier takes that one's place, and the preempted
    request comes back ahead: the same count); None without a measured rate or a known
    batch size."""
    if not stats.max_num_seqs:
        return None
    return _less_arrivals_above(stats,
        stats.finished_requests_per_s, priority, lambda a: a.requests_per_s
    )


def free_places(stats: SchedulerStats, priority: int) -> int:
    """Places in the batch a request of this priority can take now: those not held by
    its own or more important tiers (it preempts less important ones; under FCFS every
    running request holds its place), and no more than the KV blocks it may take hold
    (`kv_places`). 0 while a waiting request of its own or a more important tier could
    not get in (no place, or no KV blocks to be had)."""
    if stats.blocked_priority is not None and (
        not stats.priority_preemption or stats.blocked_priority <= priority
    ):
        return 0
    running_above = sum(
        t.num_running
        for p, t in stats.tiers.items()
        if not stats.priority_preemption or p <= priority
    )
    places = max(0, stats.max_num_seqs - running_above)
    num_kv_places = kv_places(stats, priority)
    return places if num_kv_places is None else min(places, num_kv_places)


def kv_places(stats: SchedulerStats, priority: int) -> int | None:
    """How many requests of this priority the KV blocks it may still take (under the
    reservations, less important tiers' counted as free where it preempts them) would
    hold, at the blocks a running request holds on average; None with nothing running.

    Without it a KV-bound batch looked full only at the steps whose head found no blocks:
    in between, an estimate from a step that had just admitted the last request that
    fitted saw dozens of free places, and the shedder admitted requests that then waited
    seconds for memory (the test of shedding, with 9 of its prompts filling the pool)."""
    num_running = sum(t.num_running for t in stats.tiers.values())
    if not num_running or not stats.num_kv_blocks_total:
        return None
    allowance = tier_allowance(
        stats.num_kv_blocks_total,
        {p: t.num_kv_blocks for p, t in stats.tiers.items()},
        stats.kv_reserved_blocks,
        priority,
        count_lower_tiers_as_free=stats.priority_preemption,
    )
    blocks_per_request = max(1.0, stats.num_kv_blocks_used / num_running)
    return max(0, int(allowance / blocks_per_request))


def _less_arrivals_above(
    stats: SchedulerStats, rate: float | None, priority: int, of: Callable[[Arrivals], float]
) -> float | None:
    if not rate:
        return None
    if not stats.priority_preemption:
        return rate
    arriving_above = sum(of(a) for p, a in stats.arrivals.items() if p < priority)
    return max(rate - arriving_above, rate * _MIN_SERVICE_SHARE)


def _ahead(
    stats: SchedulerStats,
    priority: int,
    tenant: TenantShare | None,
    own_amount: int,
    amounts: Callable[[TierStats], tuple[int, Mapping[str, int]]],
    unseen: Mapping[tuple[int, str], int],
) -> float:
    """How much of a backlog (tokens or requests: amounts gives a tier's total and its
    split by tenant) is served before a new request bringing own_amount of it."""
    # The caller's own tier is split by tenant only when its queue shares by tenant.
    shared = tenant is not None and stats.priority_preemption

    def whole_tier_ahead(p: int) -> bool:
        in_view = not stats.priority_preemption or p <= priority
        return in_view and not (shared and p == priority)

    num_ahead = float(
        sum(amounts(t)[0] for p, t in stats.tiers.items() if whole_tier_ahead(p))
        + sum(n for (p, _), n in unseen.items() if whole_tier_ahead(p))
    )
    if tenant is not None and shared:
        own = stats.tiers.get(priority) or TierStats(priority, "")
        total, split = amounts(own)
        by_tenant = dict(split)
        for (p, tenant_id), n in unseen.items():
            if p == priority:
                by_tenant[tenant_id] = by_tenant.get(tenant_id, 0) + n
        # Backlog the statistics do not split by tenant is all counted as ahead.
        num_ahead += max(0, total - sum(split.values()))
        num_ahead += tenant_share_ahead(by_tenant, own.weight_by_tenant, tenant, own_amount)
    return num_ahead
