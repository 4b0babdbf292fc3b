"""The Files API: POST /v1/files (purpose "batch": a JSONL batch input file, checked line by
line), GET /v1/files (a page of the tenant's files), GET /v1/files/{id}, GET
/v1/files/{id}/content, DELETE /v1/files/{id}. Each file is its tenant's: another tenant's id
is the same 404 as one that never existed. A tenant's files together stay within its quota's
file_storage_bytes."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

import tenants
from gateway.files.batch_lines import check_batch_lines
from gateway.files.storage import FileStorage
from gateway.files.upload import read_upload
from gateway.http.errors import BadRequestError, GatewayError, NotFoundError
from gateway.http.list_page import list_page
from gateway.server.db_work import detached, in_transaction
from gateway.server.runtime import GatewayRuntime

T = TypeVar("T")

PURPOSES = ("batch",)
MAX_LIST_LIMIT = 10_000


def files_routes(runtime: GatewayRuntime, storage: FileStorage) -> list[BaseRoute]:
    api = _FilesApi(runtime, storage)
    return [
        Route("/v1/files", api.create, methods=["POST"]),
        Route("/v1/files", api.list, methods=["GET"]),
        Route("/v1/files/{file_id}", api.retrieve, methods=["GET"]),
        Route("/v1/files/{file_id}", api.delete, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", api.content, methods=["GET"]),
    ]


def file_object(row: tenants.StoredFile) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes,
            "created_at": int(row.created_at.timestamp()), "expires_at": None,
            "filename": row.filename, "purpose": row.purpose, "status": "processed",
            "status_details": None}


def storage_key(row: tenants.StoredFile) -> str:
    return f"{row.tenant_id}/{row.id}"


class _FilesApi:
    def __init__(self, runtime: GatewayRuntime, storage: FileStorage) -> None:
        self.runtime = runtime
        self.storage = storage
        self._session_factory: sessionmaker[Session] = runtime.session_factory

    async def create(self, request: Request) -> Response:
        self.runtime.check_accepting()
        principal = await self.runtime.key_resolver.authenticate(request)
        upload = await read_upload(request, self.runtime.settings.max_file_bytes)
        try:
            if upload.purpose not in PURPOSES:
                raise BadRequestError(
                    f"purpose must be one of: {', '.join(PURPOSES)} (this server runs batches "
                    "only)", param="purpose", code="unsupported_parameter")
            await self._in_session(lambda session: tenants.check_file_room(
                session, principal.tenant_id, upload.size))
            num_lines = await run_in_threadpool(check_batch_lines, upload.file)
            upload.file.seek(0)
            row = tenants.StoredFile(
                id=f"file-{secrets.token_hex(12)}", tenant_id=principal.tenant_id,
                filename=upload.filename, purpose=upload.purpose, bytes=upload.size,
                num_lines=num_lines)
            # The bytes first, then the row (in the quota's transaction): a row never names
            # bytes that are not there.
            await run_in_threadpool(self.storage.put, storage_key(row), upload.file)
        except tenants.StorageQuotaExceeded as exc:
            raise _over_quota(exc) from None
        finally:
            upload.close()
        try:
            await self._in_session(lambda session: tenants.add_file(session, row))
        except BaseException as exc:
            await run_in_threadpool(self.storage.delete, storage_key(row))
            if isinstance(exc, tenants.StorageQuotaExceeded):
                raise _over_quota(exc) from None
            raise
        return JSONResponse(file_object(row))

    async def list(self, request: Request) -> Response:
        self.runtime.check_accepting()
        principal = await self.runtime.key_resolver.authenticate(request)
        query = request.query_params
        limit = _limit(query.get("limit"))
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequestError('order must be "asc" or "desc"', param="order")

        def read(session: Session) -> list[dict[str, Any]]:
            rows = tenants.list_files(
                session, principal.tenant_id, purpose=query.get("purpose"),
                after=query.get("after"), limit=limit + 1, newest_first=order == "desc")
            return [file_object(row) for row in rows]

        return list_page(await self._in_session(read), limit)

    async def retrieve(self, request: Request) -> Response:
        row = await self._own_file(request)
        return JSONResponse(file_object(row))

    async def content(self, request: Request) -> Response:
        row = await self._own_file(request)
        chunks = await run_in_threadpool(_first_chunk, self.storage, storage_key(row))
        return StreamingResponse(chunks, media_type="application/octet-stream")

    async def delete(self, request: Request) -> Response:
        row = await self._own_file(request)
        if not await self._in_session(
                lambda session: tenants.delete_file(session, row.tenant_id, row.id)):
            raise _unknown_file(row.id)
        await run_in_threadpool(self.storage.delete, storage_key(row))
        return JSONResponse({"id": row.id, "object": "file", "deleted": True})

    async def _own_file(self, request: Request) -> tenants.StoredFile:
        self.runtime.check_accepting()
        principal = await self.runtime.key_resolver.authenticate(request)
        file_id = request.path_params["file_id"]

        row = await self._in_session(lambda session: detached(
            session, tenants.find_file(session, principal.tenant_id, file_id)))
        if row is None:
            raise _unknown_file(file_id)
        return row

    async def _in_session(self, work: Callable[[Session], T]) -> T:
        return await in_transaction(self._session_factory, work)


def _first_chunk(storage: FileStorage, key: str) -> Iterator[bytes]:
    """The file's chunks, the first one already read (a missing file fails here, before the
    response starts)."""
    chunks = storage.chunks(key)
    try:
        first = next(chunks)
    except StopIteration:
        return iter(())
    except FileNotFoundError:
        raise _missing_bytes(key) from None

    def all_chunks() -> Iterator[bytes]:
        yield first
        yield from chunks

    return all_chunks()


def _limit(value: str | None) -> int:
    if value is None:
        return MAX_LIST_LIMIT
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise BadRequestError(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}",
                              param="limit")
    return limit


def _over_quota(exc: tenants.StorageQuotaExceeded) -> GatewayError:
    return BadRequestError(str(exc), param="file", code="storage_quota_exceeded")


def _unknown_file(file_id: str) -> GatewayError:
    return NotFoundError(f"no file with id {file_id!r}", param="file_id", code="file_not_found")


def _missing_bytes(key: str) -> GatewayError:
    return NotFoundError("the file's bytes are missing from the file storage",
                         code="file_content_missing")
