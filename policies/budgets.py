"""Monthly token and spend budgets, checked against running totals the billing ledger keeps."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from policies.errors import BudgetExhausted
from policies.rate_limits import TenantLimits


@dataclass(frozen=True)
class MonthlyUsage:
    """A tenant's usage so far in the current calendar month (UTC)."""

    num_tokens: int  # prompt + completion tokens billed this month
    spend_usd_micros: int  # amount billed this month, in millionths of a dollar


class MonthlyUsageSource(Protocol):
    """Running monthly totals per tenant (implemented over the billing ledger).

    Awaited on every admission that has a budget: it should answer from memory, going to the
    database at most once per tenant and month.
    """

    async def monthly_usage(self, tenant_id: str) -> MonthlyUsage: ...


def check_budgets(
    tenant_id: str, limits: TenantLimits, usage: MonthlyUsage, now: datetime | None = None
) -> BudgetExhausted | None:
    """The refusal for a tenant whose monthly token or spend budget is used up, or None.

    A budget is exhausted once usage reaches it; the request's own cost is not known yet and
    is not counted, so a tenant may go over by at most its requests in flight.
    """
    budget = limits.monthly_token_budget
    if budget is not None and usage.num_tokens >= budget:
        resets = _resets(now)
        return BudgetExhausted(
            f"Monthly token budget exhausted for tenant {tenant_id}: used {usage.num_tokens} of "
            f"{budget} tokens, 0 remaining. {resets}",
            budget_name="tokens",
            used=usage.num_tokens,
            budget=budget,
        )
    budget = limits.monthly_spend_budget_usd_micros
    if budget is not None and usage.spend_usd_micros >= budget:
        resets = _resets(now)
        return BudgetExhausted(
            f"Monthly spend budget exhausted for tenant {tenant_id}: spent "
            f"${usage.spend_usd_micros / 1e6:.2f} of ${budget / 1e6:.2f}, $0.00 remaining. "
            f"{resets}",
            budget_name="spend_usd_micros",
            used=usage.spend_usd_micros,
            budget=budget,
        )
    return None


def _resets(now: datetime | None) -> str:
    """When the budget period ends: the first day of the next calendar month (UTC)."""
    now = now or datetime.now(UTC)
    year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
    return f"It resets on {year:04d}-{month:02d}-01 (UTC)."
