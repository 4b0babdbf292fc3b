"""Aggregates over usage records: per tenant per UTC day, and totals over an interval.

Attribution, the same everywhere (rollups, totals, monthly budgets):
- a record's tokens, GPU-seconds and amount_usd_micros belong to its tenant_id;
- its recompute_gpu_seconds and recompute_amount_usd_micros belong to
  recompute_charged_tenant_id (nobody when that is None).

So a tenant's daily row may show recompute charged to it on a day it sent no request.
Intervals are half-open [start, end) on finished_at; days are UTC days.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, String, func, select
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from billing.models import UsageRecordRow as Row
from billing.records import UsageRecord
from tenants import Tenant


@dataclass(frozen=True)
class UsageTotals:
    """Sums over some records, attributed as described in the module docstring."""

    num_requests: int = 0  # requests of the tenant(s), refusals included
    num_prompt_tokens: int = 0  # prompt tokens, cached ones included
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_completion_tokens: int = 0  # generated tokens
    gpu_seconds: float = 0.0  # own compute
    recompute_gpu_seconds_charged: float = 0.0  # others' recompute this tenant caused
    amount_usd_micros: int = 0  # own charges plus recompute charges

    def __add__(self, other: UsageTotals) -> UsageTotals:
        return UsageTotals(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(UsageTotals))
        )

    @classmethod
    def of_records(
        cls, records: Iterable[UsageRecord], tenant_id: int | None = None
    ) -> UsageTotals:
        """Totals computed in Python from records (of tenant_id, or of everyone)."""
        totals = cls()
        for record in records:
            if tenant_id is None or record.tenant_id == tenant_id:
                totals += cls(
                    record.num_requests,
                    record.num_prompt_tokens,
                    record.num_cached_prompt_tokens,
                    record.num_completion_tokens,
                    record.gpu_seconds,
                    0.0,
                    record.amount_usd_micros,
                )
            charged = record.recompute_charged_tenant_id
            if charged is not None and (tenant_id is None or charged == tenant_id):
                totals += cls(
                    recompute_gpu_seconds_charged=record.recompute_gpu_seconds,
                    amount_usd_micros=record.recompute_amount_usd_micros,
                )
        return totals


@dataclass(frozen=True)
class DailyUsage:
    """One tenant's usage on one UTC day: a line of the daily export and of the usage API."""

    date: str  # the UTC day, YYYY-MM-DD
    tenant_id: int
    tenant_name: str | None  # None once the tenant has been deleted
    totals: UsageTotals  # that tenant's sums that day


class utc_day(FunctionElement[str]):
    """The UTC calendar day of a timestamp column as 'YYYY-MM-DD' text, on both backends."""

    type = String()
    inherit_cache = True
    name = "utc_day"


@compiles(utc_day, "sqlite")
def _utc_day_sqlite(element: utc_day, compiler: SQLCompiler, **kw: Any) -> str:
    # UtcDateTime stores UTC wall time as text on SQLite.
    return f"date({compiler.process(element.clauses, **kw)})"


@compiles(utc_day, "postgresql")
def _utc_day_postgresql(element: utc_day, compiler: SQLCompiler, **kw: Any) -> str:
    # Explicitly UTC: a bare ::date would follow the session's TimeZone setting.
    column = compiler.process(element.clauses, **kw)
    return f"to_char(({column}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


def daily_usage(
    session: Session, start: datetime, end: datetime, tenant_id: int | None = None
) -> list[DailyUsage]:
    """Rows per (day, tenant) over [start, end), ordered by day then tenant id."""
    day = utc_day(Row.finished_at)
    own = (
        select(day, Row.tenant_id, *_own_sums())
        .where(*_own_filter(start, end, tenant_id))
        .group_by(day, Row.tenant_id)
    )
    charged = (
        select(day, Row.recompute_charged_tenant_id, *_charged_sums())
        .where(*_charged_filter(start, end, tenant_id))
        .group_by(day, Row.recompute_charged_tenant_id)
    )
    by_key: dict[tuple[str, int], UsageTotals] = {}
    for date, tenant, *sums in session.execute(own):
        by_key[(date, tenant)] = _own_totals(sums)
    for date, tenant, *sums in session.execute(charged):
        by_key[(date, tenant)] = by_key.get((date, tenant), UsageTotals()) + _charged_totals(sums)
    names = _tenant_names(session, {tenant for _, tenant in by_key})
    return [
        DailyUsage(date, tenant, names.get(tenant), totals)
        for (date, tenant), totals in sorted(by_key.items())
    ]


def interval_totals(
    session: Session, start: datetime, end: datetime, tenant_id: int | None = None
) -> UsageTotals:
    """Totals over [start, end) straight from the records (reconciliation, monthly budgets)."""
    own = session.execute(select(*_own_sums()).where(*_own_filter(start, end, tenant_id))).one()
    charged = session.execute(
        select(*_charged_sums()).where(*_charged_filter(start, end, tenant_id))
    ).one()
    return _own_totals(own) + _charged_totals(charged)


def key_interval_totals(
    session: Session, start: datetime, end: datetime, api_key_id: int
) -> UsageTotals:
    """An API key's own totals over [start, end) (its budgets): its records' tokens and
    charges; recompute charges go to tenants, never to a key."""
    conditions = [*_own_filter(start, end, None), Row.api_key_id == api_key_id]
    return _own_totals(session.execute(select(*_own_sums()).where(*conditions)).one())


def _own_sums() -> list[ColumnElement[Any]]:
    return [
        func.coalesce(func.sum(Row.num_requests), 0),
        func.coalesce(func.sum(Row.num_prompt_tokens), 0),
        func.coalesce(func.sum(Row.num_cached_prompt_tokens), 0),
        func.coalesce(func.sum(Row.num_completion_tokens), 0),
        func.coalesce(func.sum(Row.gpu_seconds), 0.0),
        func.coalesce(func.sum(Row.amount_usd_micros), 0),
    ]


def _own_filter(start: datetime, end: datetime, tenant_id: int | None) -> list[ColumnElement[bool]]:
    conditions = [Row.finished_at >= start, Row.finished_at < end]
    if tenant_id is not None:
        conditions.append(Row.tenant_id == tenant_id)
    return conditions


def _charged_sums() -> list[ColumnElement[Any]]:
    return [
        func.coalesce(func.sum(Row.recompute_gpu_seconds), 0.0),
        func.coalesce(func.sum(Row.recompute_amount_usd_micros), 0),
    ]


def _charged_filter(
    start: datetime, end: datetime, tenant_id: int | None
) -> list[ColumnElement[bool]]:
    charged = (
        Row.recompute_charged_tenant_id.is_not(None)
        if tenant_id is None
        else Row.recompute_charged_tenant_id == tenant_id
    )
    return [charged, Row.finished_at >= start, Row.finished_at < end]


def _own_totals(sums: Any) -> UsageTotals:
    # int()/float(): PostgreSQL sums bigint columns as numeric (Decimal in Python).
    requests, prompt, cached, completion, gpu, amount = sums
    return UsageTotals(
        int(requests), int(prompt), int(cached), int(completion), float(gpu), 0.0, int(amount)
    )


def _charged_totals(sums: Any) -> UsageTotals:
    seconds, amount = sums
    return UsageTotals(recompute_gpu_seconds_charged=float(seconds), amount_usd_micros=int(amount))


def _tenant_names(session: Session, tenant_ids: set[int]) -> dict[int, str]:
    if not tenant_ids:
        return {}
    query = select(Tenant.id, Tenant.name).where(Tenant.id.in_(tenant_ids))
    return {tenant_id: name for tenant_id, name in session.execute(query)}
