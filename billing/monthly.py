"""Running monthly totals per tenant, served from memory to the admission budgets.

A tenant's total for the current month is read from the database once (at first use in
that month), then kept current by adding each record this process makes durable, whether it
went to the database or to the spool. Records other replicas write after the load are not
seen until this process loads the month again (the next month, or a restart), so with N
replicas a budget can be overrun by what the other replicas served since; the budget is a
soft limit across replicas.

An API key's own total (for its own budgets) is kept the same way: its requests' tokens and
their charges (recompute charged to its tenant is the tenant's, not the key's).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from billing.period import Period
from billing.records import UsageRecord


@dataclass(frozen=True)
class MonthlyUsage:
    """What a tenant has used so far this month, as admission budgets see it."""

    num_tokens: int  # prompt (cached included) plus completion tokens of its own requests
    spend_usd_micros: int  # its own charges plus the recompute charged to it


class MonthlyTotals:
    """(tenant, month) -> MonthlyUsage for the tenants loaded so far, and (API key, month) ->
    MonthlyUsage for the keys loaded so far; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage: dict[tuple[int, Period], MonthlyUsage] = {}
        self._key_usage: dict[tuple[int, Period], MonthlyUsage] = {}

    def get(self, tenant_id: int, period: Period) -> MonthlyUsage | None:
        """The running total, or None when it has not been loaded yet."""
        with self._lock:
            return self._usage.get((tenant_id, period))

    def set_loaded(self, tenant_id: int, period: Period, usage: MonthlyUsage) -> None:
        """Start tracking from a total read from the database; drops months before period."""
        with self._lock:
            for key in [key for key in self._usage if key[1] < period]:
                del self._usage[key]
            self._usage[(tenant_id, period)] = usage

    def get_key(self, api_key_id: int, period: Period) -> MonthlyUsage | None:
        """An API key's running total, or None when it has not been loaded yet."""
        with self._lock:
            return self._key_usage.get((api_key_id, period))

    def set_key_loaded(self, api_key_id: int, period: Period, usage: MonthlyUsage) -> None:
        """set_loaded for an API key's own total."""
        with self._lock:
            for key in [key for key in self._key_usage if key[1] < period]:
                del self._key_usage[key]
            self._key_usage[(api_key_id, period)] = usage

    def add(self, records: Iterable[UsageRecord]) -> None:
        """Count newly durable records towards the totals already loaded."""
        with self._lock:
            for record in records:
                period = Period.containing(record.finished_at)
                _add(self._usage, record.tenant_id, period, record.num_tokens,
                     record.amount_usd_micros)
                if record.api_key_id is not None:
                    _add(self._key_usage, record.api_key_id, period, record.num_tokens,
                         record.amount_usd_micros)
                if record.recompute_charged_tenant_id is not None:
                    _add(
                        self._usage,
                        record.recompute_charged_tenant_id,
                        period,
                        0,
                        record.recompute_amount_usd_micros,
                    )


def _add(
    totals: dict[tuple[int, Period], MonthlyUsage],
    owner_id: int,
    period: Period,
    num_tokens: int,
    usd_micros: int,
) -> None:
    """Add to a total already loaded (one not loaded is read whole when first needed)."""
    usage = totals.get((owner_id, period))
    if usage is not None:
        totals[(owner_id, period)] = MonthlyUsage(
            usage.num_tokens + num_tokens, usage.spend_usd_micros + usd_micros
        )
