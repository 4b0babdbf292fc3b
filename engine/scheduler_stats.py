"""Scheduler statistics the admission layer reads, the queue-wait estimate built on them, and
the engine's counters for metrics."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from engine.kv_manager import KVCacheManager
from engine.request import Request

# Steps kept for the measured rates.
_RATE_WINDOW_STEPS = 64


class StepRates:
    """Measured prefill and decode throughput over the last steps.

    The prefill rate is taken over steps that had prefill work waiting, including steps that
    ran none (KV full, budget spent on decodes): it is the rate at which the backlog drains.
    """

    def __init__(self, window_steps: int = _RATE_WINDOW_STEPS) -> None:
        # (prefill tokens, decode tokens, step seconds, had a prefill backlog)
        self._steps: deque[tuple[int, int, float, bool]] = deque(maxlen=window_steps)

    def record(
        self,
        num_prefill_tokens: int,
        num_decode_tokens: int,
        step_time_s: float,
        had_backlog: bool = True,
    ) -> None:
        self._steps.append((num_prefill_tokens, num_decode_tokens, step_time_s, had_backlog))

    @property
    def prefill_tokens_per_s(self) -> float | None:
        steps = [s for s in self._steps if s[3]]
        seconds = sum(s[2] for s in steps)
        return sum(s[0] for s in steps) / seconds if seconds > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        steps = [s for s in self._steps if s[1] > 0]
        seconds = sum(s[2] for s in steps)
        return sum(s[1] for s in steps) / seconds if seconds > 0 else None

    @property
    def mean_step_time_s(self) -> float | None:
        return sum(s[2] for s in self._steps) / len(self._steps) if self._steps else None


@dataclass
class _TierWaiting:
    tier: str
    num_waiting: int = 0
    num_pending_tokens: int = 0
    tokens_by_tenant: dict[str, int] = field(default_factory=dict)  # never 0: prompts are not empty
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
        totals.weight_by_tenant[tenant_id] = request.weight

    def remove(self, request: Request) -> None:
        totals = self._tiers[request.priority]
        tenant_id = request.tenant_id
        totals.num_waiting -= 1
        totals.num_pending_tokens -= request.num_tokens
        totals.tokens_by_tenant[tenant_id] -= request.num_tokens
        if not totals.tokens_by_tenant[tenant_id]:  # its last waiting request left
            del totals.tokens_by_tenant[tenant_id]
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


@dataclass
class EngineCounters:
    """Engine totals since start (monotonic, for metrics counters) and the latest step."""

    num_steps: int = 0  # steps that ran the model over some request, failed ones included
    num_failed_steps: int = 0
    busy_time_s: float = 0.0  # measured step time, all of it attributed to requests
    recompute_time_s: float = 0.0  # the part of busy_time_s charged as recompute
    last_step_time_s: float | None = None  # None before the first step
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits, recompute excluded)
    num_recomputed_tokens: int = 0  # tokens computed again after preemptions
    num_generated_tokens: int = 0  # tokens sampled


@dataclass
class SchedulerStats:
    tiers: dict[int, TierStats] = field(default_factory=dict)  # by priority
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0  # held by some request
    num_kv_blocks_cached: int = 0  # holding a prefix-cache entry (free or in use)
    prefix_cache_hit_ratio: float = 0.0  # block hits / block lookups since start
    prefill_tokens_per_s: float | None = None  # backlog drain rate (None: not measured yet)
    decode_tokens_per_s: float | None = None
    mean_step_time_s: float | None = None
    priority_preemption: bool = True  # whether tiers are ordered (False: FCFS)
    counters: EngineCounters = field(default_factory=EngineCounters)  # filled by the engine

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0

    def estimate_queue_wait_s(
        self,
        priority: int,
        num_prompt_tokens: int,
        tenant: TenantShare | None = None,
        unseen_tokens: Mapping[tuple[int, str], int] | None = None,
    ) -> float:
        """Seconds until a new request of this priority would have its prompt computed.

        The prefill work ahead of it plus its own prompt, divided by the measured backlog
        drain rate; 0 until a rate has been measured. Ahead of it: every tier under FCFS;
        with tiers, the more important tiers' whole backlog and, inside its own tier, either
        all of it (tenant None) or what fair sharing serves first (`tenant_share_ahead`).
        unseen_tokens: prompt tokens by (priority, tenant id) admitted since these
        statistics were taken, counted as pending.
        """
        rate = self.prefill_tokens_per_s
        if not rate:
            return 0.0
        unseen = unseen_tokens or {}
        # The caller's own tier is split by tenant only when its queue shares by tenant.
        shared = tenant is not None and self.priority_preemption

        def whole_tier_ahead(p: int) -> bool:
            in_view = not self.priority_preemption or p <= priority
            return in_view and not (shared and p == priority)

        num_ahead = float(
            sum(t.num_pending_prefill_tokens for p, t in self.tiers.items() if whole_tier_ahead(p))
            + sum(n for (p, _), n in unseen.items() if whole_tier_ahead(p))
        )
        if tenant is not None and shared:
            own = self.tiers.get(priority) or TierStats(priority, "")
            by_tenant = dict(own.pending_prefill_tokens_by_tenant)
            for (p, tenant_id), n in unseen.items():
                if p == priority:
                    by_tenant[tenant_id] = by_tenant.get(tenant_id, 0) + n
            # Backlog the statistics do not split by tenant is all counted as ahead.
            attributed = sum(own.pending_prefill_tokens_by_tenant.values())
            num_ahead += max(0, own.num_pending_prefill_tokens - attributed)
            num_ahead += tenant_share_ahead(
                by_tenant, own.weight_by_tenant, tenant, num_prompt_tokens
            )
        return (num_ahead + num_prompt_tokens) / rate


@dataclass(frozen=True)
class TenantShare:
    """Who a new request belongs to, for the fair-share part of the queue-wait estimate."""

    tenant_id: str
    weight: float = 1.0


def tenant_share_ahead(
    pending_by_tenant: Mapping[str, int],
    weights: Mapping[str, float],
    tenant: TenantShare,
    num_prompt_tokens: int,
) -> float:
    """Prefill tokens of its own tier computed before a new request of `tenant` completes.

    Inside a tier the queue shares service between tenants by weight (VTC): while the tenant
    gets its own backlog and this prompt served, another tenant u gets at most the same
    amount scaled by w_u / w_tenant, and never more than u has waiting. So a light tenant's
    request waits for little of a heavy tenant's backlog, and the heavy tenant's for all of
    its own. (Virtual counters carry some history, so this is an estimate, as the drain
    rate is.)
    """
    own = pending_by_tenant.get(tenant.tenant_id, 0)
    served_own = own + num_prompt_tokens
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
        prefix_cache_hit_ratio=(
            pool.num_prefix_hits / pool.num_prefix_queries if pool.num_prefix_queries else 0.0
        ),
        prefill_tokens_per_s=rates.prefill_tokens_per_s,
        decode_tokens_per_s=rates.decode_tokens_per_s,
        mean_step_time_s=rates.mean_step_time_s,
        priority_preemption=priority_preemption,
    )
