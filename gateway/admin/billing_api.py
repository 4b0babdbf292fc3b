"""Admin routes for billing: daily usage as JSON (the console charts it) and month exports.

    GET /admin/v1/billing/usage?start=YYYY-MM-DD&end=YYYY-MM-DD[&tenant_id=N]
        {"rows": [{"date", "tenant_id", "tenant_name", "num_requests", "num_prompt_tokens",
                   "num_cached_prompt_tokens", "num_completion_tokens", "gpu_seconds",
                   "recompute_gpu_seconds_charged", "amount_usd"}]}  (both days included)
    GET /admin/v1/billing/export?period=YYYY-MM&format=csv|jsonl[&tenant_id=N][&detail=true]
        the same file as `tiergate billing export`, streamed as a download

Guarded like every admin route (gateway.admin.auth): usage needs read-only, the export
billing (gateway.admin.roles). These are plain routes under
/admin/v1/billing, so the app must list them before admin.api's /admin/v1 mount, which would
otherwise answer 404 for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from itertools import chain
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute

import tenants
from billing import (
    MICROS_PER_USD,
    DailyUsage,
    ExportFormat,
    ExportRequest,
    InvalidPeriodError,
    Period,
    daily_row_json,
    daily_usage,
    day_range,
    export_lines,
    parse_day,
)
from gateway.admin.auth import AdminGuard
from gateway.http.errors import BadRequestError, ServiceUnavailableError

# Longest range /usage answers in one response, both days included: a year, leap or not.
MAX_USAGE_DAYS = 366
# Characters of export text per chunk of the streamed response.
_STREAM_CHUNK_CHARS = 64 * 1024
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no", "")


def billing_routes(session_factory: sessionmaker[Session], guard: AdminGuard) -> list[BaseRoute]:
    """The billing admin routes, checked by guard."""
    api = _BillingApi(session_factory)
    return [
        guard.route("/admin/v1/billing/usage", api.usage, "GET"),
        guard.route("/admin/v1/billing/export", api.export, "GET"),
    ]


class _BillingApi:
    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._session_factory = session_factory

    async def usage(self, request: Request) -> Response:
        query = request.query_params
        try:
            start, end = day_range(
                parse_day(_required(query, "start"), "start"),
                parse_day(_required(query, "end"), "end"),
                max_days=MAX_USAGE_DAYS,
            )
        except InvalidPeriodError as exc:
            raise BadRequestError(str(exc), param=exc.param) from None
        tenant_id = _tenant_id(query)
        rows = await run_in_threadpool(self._daily_usage, start, end, tenant_id)
        return JSONResponse({"rows": [_usage_row(row) for row in rows]})

    async def export(self, request: Request) -> Response:
        query = request.query_params
        try:
            period = Period.parse(_required(query, "period"))
        except InvalidPeriodError as exc:
            raise BadRequestError(str(exc), param=exc.param) from None
        export = ExportRequest(
            period=period,
            format=_export_format(query.get("format", "csv")),
            tenant_id=_tenant_id(query),
            is_detail=_flag(query.get("detail", ""), "detail"),
        )
        chunks = self._chunks(export)
        # The first chunk runs the query: a database that is down is still a 503, not a
        # 200 with a truncated body.
        try:
            first = await run_in_threadpool(next, chunks, "")
        except SQLAlchemyError as exc:
            raise ServiceUnavailableError(
                f"the database is unavailable: {exc.__class__.__name__}",
                code="database_unavailable",
            ) from exc
        return StreamingResponse(
            chain([first], chunks),
            media_type=export.format.media_type,
            headers={"content-disposition": f'attachment; filename="{export.filename}"'},
        )

    def _daily_usage(
        self, start: datetime, end: datetime, tenant_id: int | None
    ) -> list[DailyUsage]:
        try:
            with self._session_factory() as session:
                return daily_usage(session, start, end, tenant_id)
        except SQLAlchemyError as exc:
            raise ServiceUnavailableError(
                f"the database is unavailable: {exc.__class__.__name__}",
                code="database_unavailable",
            ) from exc

    def _chunks(self, export: ExportRequest) -> Iterator[str]:
        with self._session_factory() as session:
            pending: list[str] = []
            num_chars = 0
            for line in export_lines(session, export):
                pending.append(line)
                num_chars += len(line)
                if num_chars >= _STREAM_CHUNK_CHARS:
                    yield "".join(pending)
                    pending.clear()
                    num_chars = 0
            if pending:
                yield "".join(pending)


def _usage_row(row: DailyUsage) -> dict[str, Any]:
    """The export's daily line with the amount as a number of dollars (no micros)."""
    line = daily_row_json(row)
    del line["amount_usd_micros"]
    line["amount_usd"] = row.totals.amount_usd_micros / MICROS_PER_USD
    return line


def _required(query: QueryParams, param: str) -> str:
    value = query.get(param)
    if value is None:
        raise BadRequestError(f"missing query parameter {param!r}", param=param)
    return value


def _tenant_id(query: QueryParams) -> int | None:
    value = query.get("tenant_id")
    if value is None or value == "":
        return None
    try:
        return tenants.validate_row_id(value, "tenant_id")
    except tenants.InvalidFieldError as exc:
        raise BadRequestError(str(exc), param=exc.param) from None


def _export_format(value: str) -> ExportFormat:
    try:
        return ExportFormat(value)
    except ValueError:
        choices = ", ".join(f.value for f in ExportFormat)
        raise BadRequestError(f"format must be one of: {choices}", param="format") from None


def _flag(value: str, param: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise BadRequestError(f"{param} must be true or false", param=param)
