"""Exports of a billing month: a line per tenant per UTC day, or every record (detail).

The same lines feed ``tiergate billing export`` (a file or stdout) and the admin route
``/admin/v1/billing/export`` (a streamed download). Records stream from the database in
chunks (``yield_per``; a server-side cursor on PostgreSQL), so a month of any size is
exported in constant memory.

Amounts are exact: integer micro-dollars, and US dollars as a decimal string. The daily
lines of a month add up to the records' totals (see billing.rollups for the attribution of
recompute charges); a tenant's detail export includes the records whose recompute it paid.
"""

from __future__ import annotations

import csv
import enum
import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import RowMapping, Select, func, or_, select
from sqlalchemy.orm import Session

from billing.models import USAGE_RECORDS
from billing.period import Period
from billing.pricing import format_usd
from billing.records import RECORD_FIELDS, record_json
from billing.rollups import DailyUsage, daily_usage

DAILY_COLUMNS = (
    "date",
    "tenant_id",
    "tenant_name",
    "num_requests",
    "num_prompt_tokens",
    "num_cached_prompt_tokens",
    "num_completion_tokens",
    "gpu_seconds",
    "recompute_gpu_seconds_charged",
    "amount_usd_micros",
    "amount_usd",
)
DETAIL_COLUMNS = RECORD_FIELDS
# Rows fetched per round trip while streaming records.
_CHUNK_ROWS = 2000


class ExportFormat(enum.StrEnum):
    CSV = "csv"
    JSONL = "jsonl"

    @property
    def media_type(self) -> str:
        return "text/csv" if self is ExportFormat.CSV else "application/x-ndjson"


@dataclass(frozen=True)
class ExportRequest:
    """What to export."""

    period: Period  # the billing month
    format: ExportFormat  # csv (with a header line) or jsonl (one object per line)
    tenant_id: int | None = None  # one tenant, or None for all
    is_detail: bool = False  # every record instead of daily rows

    @property
    def filename(self) -> str:
        tenant = "" if self.tenant_id is None else f"-tenant-{self.tenant_id}"
        kind = "records" if self.is_detail else "daily"
        return f"tiergate-usage-{self.period}{tenant}-{kind}.{self.format.value}"


def export_lines(session: Session, request: ExportRequest) -> Iterator[str]:
    """The export as text lines, each ending in a newline (CSV starts with its header)."""
    if request.is_detail:
        records = _record_rows(session, request.period, request.tenant_id)
        return _lines(request.format, DETAIL_COLUMNS, (record_json(r) for r in records))
    rows = daily_usage(session, request.period.start, request.period.end, request.tenant_id)
    return _lines(request.format, DAILY_COLUMNS, (daily_row_json(row) for row in rows))


def count_records(session: Session, period: Period, tenant_id: int | None = None) -> int:
    """How many records a detail export of period writes (for a progress bar)."""
    query = _records_query(select(func.count()).select_from(USAGE_RECORDS), period, tenant_id)
    return int(session.execute(query).scalar_one())


def daily_row_json(row: DailyUsage) -> dict[str, Any]:
    """A daily line as a JSON-ready dict (DAILY_COLUMNS)."""
    totals = row.totals
    return {
        "date": row.date,
        "tenant_id": row.tenant_id,
        "tenant_name": row.tenant_name,
        "num_requests": totals.num_requests,
        "num_prompt_tokens": totals.num_prompt_tokens,
        "num_cached_prompt_tokens": totals.num_cached_prompt_tokens,
        "num_completion_tokens": totals.num_completion_tokens,
        "gpu_seconds": totals.gpu_seconds,
        "recompute_gpu_seconds_charged": totals.recompute_gpu_seconds_charged,
        "amount_usd_micros": totals.amount_usd_micros,
        "amount_usd": format_usd(totals.amount_usd_micros),
    }


def _record_rows(session: Session, period: Period, tenant_id: int | None) -> Iterator[RowMapping]:
    """Records that finished in period, oldest first: a tenant's own, and those whose
    recompute it paid. Stored rows go straight to lines: they were validated on the way in."""
    columns = [USAGE_RECORDS.c[name] for name in RECORD_FIELDS]
    query = _records_query(select(*columns), period, tenant_id).order_by(
        USAGE_RECORDS.c.finished_at, USAGE_RECORDS.c.request_id
    )
    return iter(session.execute(query.execution_options(yield_per=_CHUNK_ROWS)).mappings())


def _records_query(query: Select[Any], period: Period, tenant_id: int | None) -> Select[Any]:
    table = USAGE_RECORDS
    query = query.where(table.c.finished_at >= period.start, table.c.finished_at < period.end)
    if tenant_id is not None:
        query = query.where(
            or_(table.c.tenant_id == tenant_id, table.c.recompute_charged_tenant_id == tenant_id)
        )
    return query


def _lines(
    export_format: ExportFormat, columns: Sequence[str], objects: Iterator[dict[str, Any]]
) -> Iterator[str]:
    if export_format is ExportFormat.JSONL:
        for data in objects:
            yield json.dumps(data, separators=(",", ":")) + "\n"
        return
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    yield buffer.getvalue()
    for data in objects:
        buffer.seek(0)
        buffer.truncate()
        writer.writerow([data[column] for column in columns])
        yield buffer.getvalue()
