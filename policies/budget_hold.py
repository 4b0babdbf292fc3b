"""A request's hold on its tenant's monthly token budget, shared by the replicas.

An admission under a token budget holds the tokens it may use (prompt + max_tokens for each
choice, what the tokens bucket reserves) until its release, which counts what it used
instead. On one replica the admission controller's own holds are the whole picture; with
Redis, the limiter's script keeps every replica's holds and the month's count of tokens used,
so requests arriving together on several replicas cannot spend past the budget either.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime


@dataclass(frozen=True)
class BudgetHold:
    period: str  # the budget's month, "2026-11" (UTC)
    num_tokens_used: int  # the month's tokens used as this replica's ledger knew them at admission


def budget_period(now: datetime | None = None) -> str:
    """The calendar month (UTC) a budget counts, as "YYYY-MM"."""
    now = now or datetime.now(UTC)
    return f"{now.year:04d}-{now.month:02d}"
