"""What every admin route reads and answers alike: JSON bodies (bounded), list responses,
the actor the audit log names, tenants errors as HTTP errors."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

import tenants
from gateway.admin.credentials import AdminPrincipal
from gateway.http.errors import (
    BadRequestError,
    ConflictError,
    GatewayError,
    NotFoundError,
    PayloadTooLargeError,
)
from gateway.http.json_body import declared_length, parse_json_body

MAX_BODY_BYTES = 64 * 1024


def translate_tenants_error(exc: tenants.TenantsError) -> GatewayError:
    if isinstance(exc, tenants.InvalidFieldError):
        return BadRequestError(str(exc), param=exc.param)
    if isinstance(exc, tenants.RowNotFoundError):
        return NotFoundError(str(exc), code="not_found")
    if isinstance(exc, tenants.DuplicateError):
        return ConflictError(str(exc), param=exc.param, code="conflict")
    raise AssertionError(f"untranslated tenants error {type(exc).__name__}") from exc


def admin_principal(request: Request) -> AdminPrincipal:
    """Who AdminGuard authenticated the request as (every admin route is guarded)."""
    principal = getattr(request.state, "admin", None)
    assert isinstance(principal, AdminPrincipal), "admin route reached without AdminGuard"
    return principal


def admin_actor(request: Request) -> str:
    """The audit log's actor for a change made through the admin API: the credential's id
    and name ("admin:<id>:<name>"), never its secret."""
    return admin_principal(request).actor(request.client.host if request.client else "unknown")


def list_response(data: list[dict[str, Any]]) -> JSONResponse:
    return JSONResponse({"object": "list", "data": data})


async def json_object(request: Request, *, allow_empty: bool = False) -> dict[str, Any]:
    declared = declared_length(request)
    if declared is not None and declared > MAX_BODY_BYTES:
        raise PayloadTooLargeError(f"request body is larger than {MAX_BODY_BYTES} bytes")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise PayloadTooLargeError(f"request body is larger than {MAX_BODY_BYTES} bytes")
    if allow_empty and not raw.strip():
        return {}
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise BadRequestError("request body must be a JSON object")
    return body


def reject_unknown(body: Mapping[str, object], allowed: Collection[str]) -> None:
    for field in body:
        if field not in allowed:
            raise BadRequestError(
                f"unknown field {field!r}; expected some of: {', '.join(allowed)}", param=field
            )
