"""Scheduler statistics the admission layer reads (its queue-wait estimate is
`policies.queue_wait`), and the engine's counters for metrics."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.core.kv_cache.kv_manager import KVCacheManager
from engine.core.rates import Arrivals, StepRates
from engine.core.request import Request


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
    walking a long queue every step slowed the steps (ops/bench/journal.md, "Where the two
    unmet numbers come from").

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
