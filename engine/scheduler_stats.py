"""Scheduler statistics the admission layer reads, the queue-wait estimate built on them, and
the engine's counters for metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from engine.kv_manager import KVCacheManager, tier_allowance
from engine.rates import Arrivals, StepRates
from engine.request import Request

# Least share of a measured rate a tier is assumed to keep while the tiers above it arrive at
# least as fast: its wait is then long (20x what the backlog alone takes), not infinite.
_MIN_SERVICE_SHARE = 0.05


@dataclass
class _TierWaiting:
    tier: str
    num_waiting: int = 0
    num_pending_tokens: int = 0
    tokens_by_tenant: dict[str, int] = field(default_factory=dict)  # never 0: prompts are not empty
    requests_by_tenant: dict[str, int] = field(default_factory=dict)  # never 0
    weight_by_tenant: dict[str, float] = field(default_factory=dict)


class WaitingTotals:
    """Per-tier (and per-tenant) totals of the waiting queue, kept as requests enter and leave
    it, so a statistics snapshot after every step costs O(tiers x tenants), not O(waiting):
    with a thousand requests queued, walking them took 0.6 ms a step.

    A waiting or preempted request's pending prefill is all of its tokens (it holds no KV),
    and they do not change while it waits, so what enters is what leaves.
    """

    def __init__(self) -> None:
        self._tiers: dict[int, _TierWaiting] = {}

    def add(self, request: Request) -> None:
        totals = self._tiers.get(request.priority)
        if totals is None:
            totals = self._tiers[request.priority] = _TierWaiting(request.tier)
        tenant_id = request.tenant_id
        totals.num_waiting += 1
        totals.num_pending_tokens += request.num_tokens
        totals.tokens_by_tenant[tenant_id] = (
            totals.tokens_by_tenant.get(tenant_id, 0) + request.num_tokens
        )
        totals.requests_by_tenant[tenant_id] = totals.requests_by_tenant.get(tenant_id, 0) + 1
        totals.weight_by_tenant[tenant_id] = request.weight

    def remove(self, request: Request) -> None:
        totals = self._tiers[request.priority]
        tenant_id = request.tenant_id
        totals.num_waiting -= 1
        totals.num_pending_tokens -= request.num_tokens
        totals.tokens_by_tenant[tenant_id] -= request.num_tokens
        totals.requests_by_tenant[tenant_id] -= 1
        if not totals.requests_by_tenant[tenant_id]:  # its last waiting request left
            del totals.tokens_by_tenant[tenant_id]
            del totals.requests_by_tenant[tenant_id]
            del totals.weight_by_tenant[tenant_id]
        if not totals.num_waiting:
            del self._tiers[request.priority]

    def items(self) -> Iterable[tuple[int, _TierWaiting]]:
        return self._tiers.items()


@dataclass
class TierStats:
    priority: int  # lower is more important
    tier: str  # label seen on the tier's requests
    num_running: int = 0
    num_waiting: int = 0  # waiting and preempted
    num_pending_prefill_tokens: int = 0  # prompt (or recompute) tokens not yet computed
    num_kv_blocks: int = 0  # distinct KV blocks held by the tier's requests
    num_kv_blocks_reserved: int = 0
    # The pending prefill tokens split by tenant, with each tenant's fair-share weight.
    pending_prefill_tokens_by_tenant: dict[str, int] = field(default_factory=dict)
    weight_by_tenant: dict[str, float] = field(default_factory=dict)
    num_waiting_by_tenant: dict[str, int] = field(default_factory=dict)  # requests


@dataclass
class EngineCounters:
    """Engine totals since start (monotonic, for metrics counters) and the latest step."""

    num_steps: int = 0  # steps that ran the model over some request, failed ones included
    num_failed_steps: int = 0
    busy_time_s: float = 0.0  # measured step time, all of it attributed to requests
    recompute_time_s: float = 0.0  # the part of busy_time_s charged as recompute
    last_step_time_s: float | None = None  # None before the first step
    num_preemptions: int = 0
    num_lane_steps: int = 0  # steps that carried only under-share prompts (the scheduler's lane)
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits, recompute excluded)
    num_recomputed_tokens: int = 0  # tokens computed again after preemptions
    num_generated_tokens: int = 0  # tokens sampled


@dataclass
class SchedulerStats:
    tiers: dict[int, TierStats] = field(default_factory=dict)  # by priority
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0  # held by some request
    num_kv_blocks_cached: int = 0  # holding a prefix-cache entry (free or in use)
    kv_reserved_blocks: dict[int, int] = field(default_factory=dict)  # by priority, every tier
    prefix_cache_hit_ratio: float = 0.0  # block hits / block lookups since start
    prefill_tokens_per_s: float | None = None  # backlog drain rate (None: not measured yet)
    decode_tokens_per_s: float | None = None
    # wall time per step while busy, the loop's work between steps included (`StepRates`)
    mean_step_time_s: float | None = None
    # running requests leaving the batch per second (None: none has yet)
    finished_requests_per_s: float | None = None
    max_num_seqs: int = 0  # places in the batch (0: unknown, no batch wait is estimated)
    # Most important tier whose waiting head found no place or no KV blocks in the latest
    # step (None: nothing was held back for either).
    blocked_priority: int | None = None
    arrivals: dict[int, Arrivals] = field(default_factory=dict)  # by priority, lately
    priority_preemption: bool = True  # whether tiers are ordered (False: FCFS)
    counters: EngineCounters = field(default_factory=EngineCounters)  # filled by the engine
    # When the engine loop last took in new requests before the step these statistics follow
    # (time.monotonic() seconds): every request submitted before it is in them. None: unknown
    # (statistics not published by the engine loop).
    taken_in_at_s: float | None = None

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0

    def estimate_queue_wait_s(
        self,
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
        prefill_rate = self.prefill_service_rate(priority)
        if prefill_rate:
            tokens_ahead = self._ahead(
                priority,
                tenant,
                num_prompt_tokens,
                lambda t: (t.num_pending_prefill_tokens, t.pending_prefill_tokens_by_tenant),
                unseen.tokens,
            )
            prefill_s = (tokens_ahead + num_prompt_tokens) / prefill_rate
        batch_s = 0.0
        place_rate = self.place_service_rate(priority)
        if place_rate:
            requests_ahead = self._ahead(
                priority,
                tenant,
                1,
                lambda t: (t.num_waiting, t.num_waiting_by_tenant),
                unseen.requests,
            )
            batch_s = max(0.0, requests_ahead + 1 - self.free_places(priority)) / place_rate
        return max(prefill_s, batch_s)

    def prefill_service_rate(self, priority: int) -> float | None:
        """Prefill tokens per second a queued request of this priority is drained at: the
        measured drain rate less the prompt tokens more important tiers bring in meanwhile
        (under FCFS what arrives later is behind it); never under 5 % of the drain rate."""
        return self._less_arrivals_above(
            self.prefill_tokens_per_s, priority, lambda a: a.prompt_tokens_per_s
        )

    def place_service_rate(self, priority: int) -> float | None:
        """Places in the batch per second given to queued requests of this priority: the
        measured rate requests leave it less the requests more important tiers bring in (one
        of theirs that preempts one of this tier takes that one's place, and the preempted
        request comes back ahead: the same count); None without a measured rate or a known
        batch size."""
        if not self.max_num_seqs:
            return None
        return self._less_arrivals_above(
            self.finished_requests_per_s, priority, lambda a: a.requests_per_s
        )

    def free_places(self, priority: int) -> int:
        """Places in the batch a request of this priority can take now: those not held by
        its own or more important tiers (it preempts less important ones; under FCFS every
        running request holds its place), and no more than the KV blocks it may take hold
        (`kv_places`). 0 while a waiting request of its own or a more important tier could
        not get in (no place, or no KV blocks to be had)."""
        if self.blocked_priority is not None and (
            not self.priority_preemption or self.blocked_priority <= priority
        ):
            return 0
        running_above = sum(
            t.num_running
            for p, t in self.tiers.items()
            if not self.priority_preemption or p <= priority
        )
        places = max(0, self.max_num_seqs - running_above)
        kv_places = self.kv_places(priority)
        return places if kv_places is None else min(places, kv_places)

    def kv_places(self, priority: int) -> int | None:
        """How many requests of this priority the KV blocks it may still take (under the
        reservations, less important tiers' counted as free where it preempts them) would
        hold, at the blocks a running request holds on average; None with nothing running.

        Without it a KV-bound batch looked full only at the steps whose head found no blocks:
        in between, an estimate from a step that had just admitted the last request that
        fitted saw dozens of free places, and the shedder admitted requests that then waited
        seconds for memory (the test of shedding, with 9 of its prompts filling the pool)."""
        num_running = sum(t.num_running for t in self.tiers.values())
        if not num_running or not self.num_kv_blocks_total:
            return None
        allowance = tier_allowance(
            self.num_kv_blocks_total,
            {p: t.num_kv_blocks for p, t in self.tiers.items()},
            self.kv_reserved_blocks,
            priority,
            count_lower_tiers_as_free=self.priority_preemption,
        )
        blocks_per_request = max(1.0, self.num_kv_blocks_used / num_running)
        return max(0, int(allowance / blocks_per_request))

    def _less_arrivals_above(
        self, rate: float | None, priority: int, of: Callable[[Arrivals], float]
    ) -> float | None:
        if not rate:
            return None
        if not self.priority_preemption:
            return rate
        arriving_above = sum(of(a) for p, a in self.arrivals.items() if p < priority)
        return max(rate - arriving_above, rate * _MIN_SERVICE_SHARE)

    def _ahead(
        self,
        priority: int,
        tenant: TenantShare | None,
        own_amount: int,
        amounts: Callable[[TierStats], tuple[int, Mapping[str, int]]],
        unseen: Mapping[tuple[int, str], int],
    ) -> float:
        """How much of a backlog (tokens or requests: amounts gives a tier's total and its
        split by tenant) is served before a new request bringing own_amount of it."""
        # The caller's own tier is split by tenant only when its queue shares by tenant.
        shared = tenant is not None and self.priority_preemption

        def whole_tier_ahead(p: int) -> bool:
            in_view = not self.priority_preemption or p <= priority
            return in_view and not (shared and p == priority)

        num_ahead = float(
            sum(amounts(t)[0] for p, t in self.tiers.items() if whole_tier_ahead(p))
            + sum(n for (p, _), n in unseen.items() if whole_tier_ahead(p))
        )
        if tenant is not None and shared:
            own = self.tiers.get(priority) or TierStats(priority, "")
            total, split = amounts(own)
            by_tenant = dict(split)
            for (p, tenant_id), n in unseen.items():
                if p == priority:
                    by_tenant[tenant_id] = by_tenant.get(tenant_id, 0) + n
            # Backlog the statistics do not split by tenant is all counted as ahead.
            num_ahead += max(0, total - sum(split.values()))
            num_ahead += tenant_share_ahead(by_tenant, own.weight_by_tenant, tenant, own_amount)
        return num_ahead


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


def build_stats(
    running: Iterable[Request],
    waiting: WaitingTotals,
    kv: KVCacheManager,
    rates: StepRates,
    arrivals: dict[int, Arrivals],
    max_num_seqs: int,
    blocked_priority: int | None,
    priority_preemption: bool,
) -> SchedulerStats:
    tiers: dict[int, TierStats] = {}

    def tier_of(request: Request) -> TierStats:
        stats = tiers.get(request.priority)
        if stats is None:
            stats = tiers[request.priority] = TierStats(request.priority, request.tier)
        return stats

    def add_pending(stats: TierStats, request: Request, num_tokens: int) -> None:
        stats.num_pending_prefill_tokens += num_tokens
        by_tenant = stats.pending_prefill_tokens_by_tenant
        by_tenant[request.tenant_id] = by_tenant.get(request.tenant_id, 0) + num_tokens
        stats.weight_by_tenant[request.tenant_id] = request.weight

    for request in running:
        stats = tier_of(request)
        stats.num_running += 1
        if not request.is_prefill_done:
            add_pending(stats, request, request.num_uncomputed_tokens)
    for priority, totals in waiting.items():
        stats = tiers.setdefault(priority, TierStats(priority, totals.tier))
        stats.num_waiting += totals.num_waiting
        stats.num_pending_prefill_tokens += totals.num_pending_tokens
        by_tenant = stats.pending_prefill_tokens_by_tenant
        for tenant_id, num_tokens in totals.tokens_by_tenant.items():
            by_tenant[tenant_id] = by_tenant.get(tenant_id, 0) + num_tokens
        stats.num_waiting_by_tenant = dict(totals.requests_by_tenant)
        stats.weight_by_tenant.update(totals.weight_by_tenant)
    for priority, num_reserved in kv.reserved_blocks.items():
        if priority in tiers:
            tiers[priority].num_kv_blocks_reserved = num_reserved
    for priority, stats in tiers.items():
        stats.num_kv_blocks = kv.num_tier_blocks(priority)
    pool = kv.pool
    return SchedulerStats(
        tiers=tiers,
        num_kv_blocks_total=kv.num_blocks,
        num_kv_blocks_used=kv.num_used_blocks,
        num_kv_blocks_cached=pool.num_cached_blocks,
        kv_reserved_blocks=dict(kv.reserved_blocks),
        prefix_cache_hit_ratio=(
            pool.num_prefix_hits / pool.num_prefix_queries if pool.num_prefix_queries else 0.0
        ),
        prefill_tokens_per_s=rates.prefill_tokens_per_s,
        decode_tokens_per_s=rates.decode_tokens_per_s,
        mean_step_time_s=rates.mean_step_time_s,
        finished_requests_per_s=rates.finished_requests_per_s,
        max_num_seqs=max_num_seqs,
        blocked_priority=blocked_priority,
        arrivals=arrivals,
        priority_preemption=priority_preemption,
    )
