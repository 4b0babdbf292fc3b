"""ParseTimeBudget: how much of a replica's event loop each tenant's large request bodies may
take, as a bucket of seconds per tenant.

Reading a body is the gateway's work before any limit can count what the body asks for:
a body of 400,000 stop token ids held the event loop while it was parsed and refused (JSON
holds the GIL; no thread helps), and two connections sending such bodies back to back left
other tenants' requests waiting for the loop, their time to first token a multiple of what
it was alone (ops/bench/journal.md, "Costly but valid requests").
A tenant's rate limits bound how many requests it sends; this bounds what its large bodies
cost the loop, whatever its limits: each large body's parse is timed and taken from its
tenant's bucket (which may go below zero: the body was already read), and a large body
from a tenant whose bucket is empty is refused before it is read, with the time until it
refills as its retry delay. Per replica and in memory: it shares out this process's loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from policies.errors import ParseTimeSpent

__all__ = ["ParseTimeBudget", "ParseTimeConfig"]


@dataclass(frozen=True)
class ParseTimeConfig:
    """Each tenant's bucket of event-loop seconds for its large bodies."""

    capacity_s: float = 0.25  # the burst: a few of the largest bodies in a row
    refill_per_s: float = 0.1  # the share: a tenth of the loop, sustained

    def __post_init__(self) -> None:
        if self.capacity_s <= 0 or self.refill_per_s <= 0:
            raise ValueError("the parse-time bucket's capacity and refill must be positive")


@dataclass
class _Bucket:
    level_s: float
    updated_at_s: float


class ParseTimeBudget:
    """Per tenant (in memory, this replica): check before a large body is read, spend after."""

    # Tenants remembered at most; a tenant whose bucket has refilled is forgotten first.
    MAX_TENANTS = 10_000

    def __init__(
        self, config: ParseTimeConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or ParseTimeConfig()
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def check(self, tenant_id: str) -> None:
        """Raise ParseTimeSpent when the tenant's bucket is empty (or in debt)."""
        bucket = self._buckets.get(tenant_id)
        if bucket is None:
            return
        level = self._refilled(bucket)
        if level <= 0:
            retry_after_s = (-level + 1e-3) / self.config.refill_per_s
            raise ParseTimeSpent(
                "this key's large request bodies have taken their share of this server's "
                f"time for now; retry after {retry_after_s:.1f} s",
                retry_after_s=retry_after_s,
            )

    def spend(self, tenant_id: str, seconds: float) -> None:
        """A large body of the tenant's took this long to read and parse."""
        bucket = self._buckets.get(tenant_id)
        if bucket is None:
            if len(self._buckets) >= self.MAX_TENANTS:
                self._forget_full()
            bucket = self._buckets[tenant_id] = _Bucket(self.config.capacity_s, self._clock())
        bucket.level_s = self._refilled(bucket) - seconds

    def level_s(self, tenant_id: str) -> float:
        bucket = self._buckets.get(tenant_id)
        return self.config.capacity_s if bucket is None else self._refilled(bucket)

    def _refilled(self, bucket: _Bucket) -> float:
        now = self._clock()
        bucket.level_s = min(
            self.config.capacity_s,
            bucket.level_s + max(0.0, now - bucket.updated_at_s) * self.config.refill_per_s,
        )
        bucket.updated_at_s = now
        return bucket.level_s

    def _forget_full(self) -> None:
        full = [tenant for tenant, bucket in self._buckets.items()
                if self._refilled(bucket) >= self.config.capacity_s]
        for tenant in full or list(self._buckets)[: len(self._buckets) // 2]:
            del self._buckets[tenant]
