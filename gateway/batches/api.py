"""POST /v1/batches, GET /v1/batches/{id}, GET /v1/batches, POST /v1/batches/{id}/cancel.

A batch is created from one of the tenant's files (purpose "batch"): its lines, each a request
of the batch's endpoint, are stored as the batch's lines in the database, in prefix order
(`prefix_key`: the start of each prompt) so replicas run lines sharing a prefix together. The
window is OpenAI's only one, 24h; lines not run by then end as `batch_expired`. Another
tenant's batch id is the same 404 as one that never existed.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

import tenants
from gateway.files.api import storage_key
from gateway.files.batch_lines import BATCH_URLS
from gateway.files.storage import FileStorage
from gateway.http.errors import BadRequestError, GatewayError, NotFoundError
from gateway.http.json_body import parse_json_body
from gateway.http.list_page import list_page
from gateway.openai.metadata import parse_metadata
from gateway.server.db_work import detached, in_transaction
from gateway.server.runtime import GatewayRuntime

T = TypeVar("T")

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
PREFIX_KEY_CHARS = 128
MAX_LIST_LIMIT = 100


def batch_routes(runtime: GatewayRuntime, storage: FileStorage) -> list[BaseRoute]:
    api = _BatchesApi(runtime, storage)
    return [
        Route("/v1/batches", api.create, methods=["POST"]),
        Route("/v1/batches", api.list, methods=["GET"]),
        Route("/v1/batches/{batch_id}", api.retrieve, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", api.cancel, methods=["POST"]),
    ]


def batch_object(batch: tenants.Batch, counts: tenants.LineCounts) -> dict[str, Any]:
    def stamp(value: datetime | None) -> int | None:
        return None if value is None else int(value.timestamp())

    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
        "errors": None if not batch.errors else {"object": "list", "data": batch.errors},
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": batch.status, "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id, "created_at": stamp(batch.created_at),
        "in_progress_at": stamp(batch.in_progress_at), "expires_at": stamp(batch.expires_at),
        "finalizing_at": stamp(batch.finalizing_at), "completed_at": stamp(batch.completed_at),
        "failed_at": stamp(batch.failed_at), "expired_at": stamp(batch.expired_at),
        "cancelling_at": stamp(batch.cancelling_at), "cancelled_at": stamp(batch.cancelled_at),
        "request_counts": {"total": counts.total, "completed": counts.completed,
                           "failed": counts.failed},
        "metadata": batch.metadata_ or {},
    }


def prefix_key(body: dict[str, Any]) -> str:
    """The start of the prompt a line's body holds: lines sorted by it run next to those
    they share a prefix with."""
    if isinstance(body.get("messages"), list):
        parts = [m.get("content") for m in body["messages"] if isinstance(m, dict)]
    elif "input" in body:
        parts = [body.get("instructions"), body.get("input")]
    else:
        parts = [body.get("prompt")]
    text = "\x1f".join(p if isinstance(p, str) else json.dumps(p) for p in parts if p)
    return text[:PREFIX_KEY_CHARS]


class _BatchesApi:
    def __init__(self, runtime: GatewayRuntime, storage: FileStorage) -> None:
        self.runtime = runtime
        self.storage = storage

    async def create(self, request: Request) -> Response:
        self.runtime.check_accepting()
        principal = await self.runtime.key_resolver.authenticate(request)
        body = parse_json_body(await request.body())
        if not isinstance(body, dict):
            raise BadRequestError("the request body must be a JSON object")
        unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                               "output_expires_after"}
        if unknown:
            raise BadRequestError(f"Unrecognized request argument supplied: {min(unknown)}",
                                  param=min(unknown))
        endpoint = body.get("endpoint")
        if endpoint not in BATCH_URLS:
            raise BadRequestError(f"endpoint must be one of: {', '.join(BATCH_URLS)}",
                                  param="endpoint")
        window = body.get("completion_window")
        if window not in COMPLETION_WINDOWS:
            raise BadRequestError('completion_window must be "24h"', param="completion_window")
        metadata = parse_metadata(body.get("metadata"))
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise BadRequestError("input_file_id must be a string", param="input_file_id")
        file = await self._in_session(
            lambda session: detached(session, tenants.find_file(
                session, principal.tenant_id, file_id)))
        if file is None or file.purpose != "batch":
            raise NotFoundError(f"no batch input file with id {file_id!r}",
                                param="input_file_id", code="file_not_found")
        content = await run_in_threadpool(
            lambda: b"".join(self.storage.chunks(storage_key(file))))
        now = datetime.now(UTC)
        batch = tenants.Batch(
            id=f"batch_{secrets.token_hex(16)}", tenant_id=principal.tenant_id,
            api_key_id=principal.api_key_id, endpoint=endpoint, input_file_id=file_id,
            completion_window=window, status="in_progress", metadata_=metadata or None,
            total=0, created_at=now, in_progress_at=now,
            expires_at=now + COMPLETION_WINDOWS[window])
        lines = await run_in_threadpool(_lines, batch, content)
        batch.total = len(lines)

        def add(session: Session) -> dict[str, Any]:
            tenants.add_batch(session, batch, lines)
            session.flush()
            return batch_object(batch, tenants.LineCounts(len(lines), 0, 0, 0))

        return JSONResponse(await self._in_session(add))

    async def retrieve(self, request: Request) -> Response:
        principal = await self._principal(request)
        batch_id = request.path_params["batch_id"]
        return JSONResponse(await self._in_session(
            lambda session: self._object(session, principal.tenant_id, batch_id)))

    async def list(self, request: Request) -> Response:
        principal = await self._principal(request)
        query = request.query_params
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise BadRequestError(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}",
                                  param="limit")

        def read(session: Session) -> list[dict[str, Any]]:
            batches = tenants.list_batches(session, principal.tenant_id,
                                           after=query.get("after"), limit=limit + 1)
            return [batch_object(b, tenants.line_counts(session, b.id)) for b in batches]

        return list_page(await self._in_session(read), limit)

    async def cancel(self, request: Request) -> Response:
        """Lines not started are cancelled at once; those running finish, then the batch's
        files are written (the batch runner) and it is cancelled."""
        principal = await self._principal(request)
        batch_id = request.path_params["batch_id"]

        def cancel(session: Session) -> dict[str, Any]:
            self._object(session, principal.tenant_id, batch_id)  # 404 unless the tenant's
            if tenants.set_batch_status(session, batch_id, ("in_progress",), "cancelling",
                                        datetime.now(UTC)):
                tenants.end_pending_lines(session, batch_id, status="cancelled")
            return self._object(session, principal.tenant_id, batch_id)

        return JSONResponse(await self._in_session(cancel))

    def _object(self, session: Session, tenant_id: int, batch_id: str) -> dict[str, Any]:
        batch = tenants.find_batch(session, tenant_id, batch_id)
        if batch is None:
            raise _unknown_batch(batch_id)
        return batch_object(batch, tenants.line_counts(session, batch_id))

    async def _principal(self, request: Request) -> Any:
        self.runtime.check_accepting()
        return await self.runtime.key_resolver.authenticate(request)

    async def _in_session(self, work: Callable[[Session], T]) -> T:
        return await in_transaction(self.runtime.session_factory, work)


def _lines(batch: tenants.Batch, content: bytes) -> list[tenants.BatchLine]:
    """The batch's lines from its input file (checked at upload); a line of another endpoint
    than the batch's is a 400 naming it."""
    lines: list[tenants.BatchLine] = []
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        line = json.loads(raw)
        if line["url"] != batch.endpoint:
            raise BadRequestError(
                f"line {number} of the input file is for {line['url']}, not the batch's "
                f"endpoint {batch.endpoint}", param="input_file_id", code="invalid_batch_line")
        lines.append(tenants.BatchLine(
            batch_id=batch.id, line_index=len(lines), custom_id=line["custom_id"],
            body=line["body"], prefix_key=prefix_key(line["body"]), status="pending",
            attempts=0, is_error=False))
    return lines


def _unknown_batch(batch_id: str) -> GatewayError:
    return NotFoundError(f"no batch with id {batch_id!r}", param="batch_id",
                         code="batch_not_found")
