"""Monthly token and spend budgets, checked against running totals the billing ledger keeps."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from policies.errors import BudgetExhausted, BudgetHeld, KeyBudgetExhausted, KeyBudgetHeld
from policies.key_limits import KeyLimits
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

    async def key_monthly_usage(self, api_key_id: str) -> MonthlyUsage:
        """An API key's own usage this month (its requests' tokens and charges), for the
        key's budgets; the same caching as monthly_usage."""
        ...


class BudgetLimits(Protocol):
    """Whose monthly budgets are checked: a tenant's (TenantLimits) or a key's (KeyLimits)."""

    @property
    def monthly_token_budget(self) -> int | None: ...

    @property
    def monthly_spend_budget_usd_micros(self) -> int | None: ...


def check_budgets(
    tenant_id: str, limits: TenantLimits, usage: MonthlyUsage, now: datetime | None = None
) -> BudgetExhausted | None:
    """The refusal for a tenant whose monthly token or spend budget is used up, or None.

    A budget is exhausted once usage reaches it; check_token_reservation then keeps the
    tokens a request may use within what is left.
    """
    return _check_budgets(f"tenant {tenant_id}", limits, usage, now, BudgetExhausted)


def check_key_budgets(
    key: KeyLimits, usage: MonthlyUsage, now: datetime | None = None
) -> BudgetExhausted | None:
    """check_budgets for an API key's own budgets against the key's usage this month
    (KeyBudgetExhausted, naming the key)."""
    return _check_budgets(f"API key {key.api_key_id}", key, usage, now, KeyBudgetExhausted)


def _check_budgets(
    owner: str,
    limits: BudgetLimits,
    usage: MonthlyUsage,
    now: datetime | None,
    exhausted: type[BudgetExhausted],
) -> BudgetExhausted | None:
    budget = limits.monthly_token_budget
    if budget is not None and usage.num_tokens >= budget:
        resets = _resets(now)
        return exhausted(
            f"Monthly token budget exhausted for {owner}: used {usage.num_tokens} of "
            f"{budget} tokens, 0 remaining. {resets}",
            budget_name="tokens",
            used=usage.num_tokens,
            budget=budget,
        )
    budget = limits.monthly_spend_budget_usd_micros
    if budget is not None and usage.spend_usd_micros >= budget:
        resets = _resets(now)
        return exhausted(
            f"Monthly spend budget exhausted for {owner}: spent "
            f"${usage.spend_usd_micros / 1e6:.2f} of ${budget / 1e6:.2f}, $0.00 remaining. "
            f"{resets}",
            budget_name="spend_usd_micros",
            used=usage.spend_usd_micros,
            budget=budget,
        )
    return None


def check_token_reservation(
    tenant_id: str,
    limits: TenantLimits,
    usage: MonthlyUsage,
    num_tokens_held: int,
    num_tokens: int,
) -> BudgetExhausted | BudgetHeld | None:
    """The refusal for a request whose tokens (prompt + max_tokens x n, as the rate limiter
    reserves them) the monthly token budget cannot cover, or None.

    num_tokens_held: what the tenant's requests in flight reserved (on this replica, or on
    every replica as Redis counts them: policies/budget_hold.py). A request
    larger than what is left at all is refused for good (lower max_tokens); one that fits
    only once those in flight end is told to retry.
    """
    return _check_reservation(
        f"tenant {tenant_id}", "its", limits, usage, num_tokens_held, num_tokens,
        BudgetExhausted, BudgetHeld,
    )


def check_key_reservation(
    key: KeyLimits, usage: MonthlyUsage, num_tokens_held: int, num_tokens: int
) -> BudgetExhausted | BudgetHeld | None:
    """check_token_reservation for an API key's own token budget, num_tokens_held being
    what the key's requests in flight reserved (KeyBudgetExhausted, KeyBudgetHeld)."""
    return _check_reservation(
        f"API key {key.api_key_id}", "the key's", key, usage, num_tokens_held, num_tokens,
        KeyBudgetExhausted, KeyBudgetHeld,
    )


def _check_reservation(
    owner: str,
    whose: str,
    limits: BudgetLimits,
    usage: MonthlyUsage,
    num_tokens_held: int,
    num_tokens: int,
    exhausted: type[BudgetExhausted],
    held: type[BudgetHeld],
) -> BudgetExhausted | BudgetHeld | None:
    budget = limits.monthly_token_budget
    if budget is None:
        return None
    remaining = max(0, budget - usage.num_tokens)
    if num_tokens > remaining:
        return exhausted(
            f"This request may use up to {num_tokens} tokens (prompt and max_tokens for each "
            f"choice), and {remaining} of the monthly token budget of {owner} "
            f"remain; lower max_tokens. {_resets(None)}",
            budget_name="tokens",
            used=usage.num_tokens,
            budget=budget,
        )
    if num_tokens > remaining - num_tokens_held:
        return held(
            f"{num_tokens_held} of the {remaining} tokens left in the monthly budget of "
            f"{owner} are held by {whose} requests in flight; retry when they end.",
            num_tokens_held=num_tokens_held,
        )
    return None


def _resets(now: datetime | None) -> str:
    """When the budget period ends: the first day of the next calendar month (UTC)."""
    now = now or datetime.now(UTC)
    year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
    return f"It resets on {year:04d}-{month:02d}-01 (UTC)."
