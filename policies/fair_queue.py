"""Tier-aware fair-share waiting queue: tiers in priority order, tenants by virtual token
counters inside a tier (VTC, Sheng et al., "Fairness in Serving Large Language Models").

A tenant's counter grows by the service its requests receive: input tokens x1, output tokens
x2, divided by the tenant's weight. The next admission in a tier goes to the backlogged tenant
with the smallest counter. A tenant that becomes backlogged is lifted to the smallest counter
among the tier's backlogged tenants (or the tier's virtual time when none is), so idling
earns no credit. Preempted requests come back first in their tier, oldest arrival first.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Iterator

from engine import Request

INPUT_TOKEN_WEIGHT = 1.0
OUTPUT_TOKEN_WEIGHT = 2.0


class _TierQueue:
    """One tier: preempted requests first, then tenants by counter."""

    def __init__(self) -> None:
        self.resumed: list[Request] = []  # preempted, sorted by arrival time
        self.by_tenant: dict[str, deque[Request]] = {}  # backlogged tenants only
        self.virtual_time = 0.0  # counter of the tenant chosen most recently

    def __len__(self) -> int:
        return len(self.resumed) + sum(len(q) for q in self.by_tenant.values())


class TieredFairQueue:
    """WaitingQueue implementation: strict tier priority, VTC fair share within a tier."""

    def __init__(self) -> None:
        self._tiers: dict[int, _TierQueue] = defaultdict(_TierQueue)
        self.counters: dict[str, float] = defaultdict(float)  # tenant -> weighted service
        self._size = 0

    # -- WaitingQueue -------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        tier = self._tiers[request.priority]
        tenant = request.tenant_id
        if tenant not in tier.by_tenant:
            floor = min((self.counters[t] for t in tier.by_tenant), default=tier.virtual_time)
            self.counters[tenant] = max(self.counters[tenant], floor)
            tier.by_tenant[tenant] = deque()
        tier.by_tenant[tenant].append(request)
        self._size += 1

    def prepend(self, request: Request) -> None:
        tier = self._tiers[request.priority]
        arrivals = [r.arrival_time for r in tier.resumed]
        tier.resumed.insert(bisect.bisect_right(arrivals, request.arrival_time), request)
        self._size += 1

    def remove(self, request: Request) -> None:
        tier = self._tiers[request.priority]
        if request in tier.resumed:
            tier.resumed.remove(request)
        else:
            queue = tier.by_tenant[request.tenant_id]
            queue.remove(request)
            if not queue:
                del tier.by_tenant[request.tenant_id]
        self._size -= 1

    def peek(self, skip_tenants: set[str]) -> Request | None:
        for priority in sorted(self._tiers):
            tier = self._tiers[priority]
            for request in tier.resumed:
                if request.tenant_id not in skip_tenants:
                    return request
            best: tuple[float, float, str] | None = None
            for tenant, queue in tier.by_tenant.items():
                if tenant in skip_tenants:
                    continue
                key = (self.counters[tenant], queue[0].arrival_time, tenant)
                if best is None or key < best:
                    best = key
            if best is not None:
                tier.virtual_time = max(tier.virtual_time, best[0])
                return tier.by_tenant[best[2]][0]
        return None

    def on_service(self, request: Request, num_input_tokens: int, num_output_tokens: int) -> None:
        service = INPUT_TOKEN_WEIGHT * num_input_tokens + OUTPUT_TOKEN_WEIGHT * num_output_tokens
        self.counters[request.tenant_id] += service / request.weight

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        for priority in sorted(self._tiers):
            tier = self._tiers[priority]
            yield from tier.resumed
            for queue in tier.by_tenant.values():
                yield from queue
