"""OpenAI-shaped errors: the gateway's exception tree and its translation to responses.

Every error leaves the gateway as ``{"error": {"message", "type", "param", "code"}}``,
never an HTML page or a stack trace.

    GatewayError                      500 server_error
    ├── BadRequestError               400 invalid_request_error (param names the field)
    ├── AuthenticationError           401 authentication_error
    ├── PermissionDeniedError         403 permission_error
    ├── NotFoundError                 404 not_found_error
    ├── ConflictError                 409 conflict_error
    ├── PayloadTooLargeError          413 invalid_request_error, code request_too_large
    ├── RateLimitError                429 rate_limit_error, code rate_limit_exceeded
    │   └── InsufficientQuotaError    429 insufficient_quota, x-should-retry: false
    ├── ServiceUnavailableError       503 service_unavailable
    └── InternalServerError           500 server_error
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

# Error type for statuses raised by Starlette itself (unknown route, wrong method).
_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The error object, also used for the one ``data: {"error": ...}`` event of a stream."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    status_code: int,
    message: str,
    error_type: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(message, error_type, param=param, code=code),
        status_code=status_code,
        headers=dict(headers) if headers else None,
    )


class GatewayError(Exception):
    """Base of the tree; subclasses fix the status and type, instances the message."""

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    default_headers: ClassVar[Mapping[str, str]] = {}

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = {**self.default_headers, **(headers or {})}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, param=self.param, code=self.code)

    def to_response(self) -> JSONResponse:
        return error_response(
            self.status_code,
            self.message,
            self.error_type,
            param=self.param,
            code=self.code,
            headers=self.headers,
        )


class BadRequestError(GatewayError):
    """The body or query is malformed or out of range; param names the offending field."""

    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(GatewayError):
    """No credentials, or credentials that match nothing."""

    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(GatewayError):
    """Valid credentials that may not do this (revoked key, disabled tenant)."""

    status_code = 403
    error_type = "permission_error"


class NotFoundError(GatewayError):
    status_code = 404
    error_type = "not_found_error"


class ConflictError(GatewayError):
    """The change conflicts with existing state (e.g. a name already taken)."""

    status_code = 409
    error_type = "conflict_error"


class PayloadTooLargeError(GatewayError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimitError(GatewayError):
    """Too many requests or tokens now; retry-after headers say when to come back."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class InsufficientQuotaError(RateLimitError):
    """A budget is exhausted: retrying will not help until it is raised or renewed."""

    error_type = "insufficient_quota"
    default_code = "insufficient_quota"
    default_headers: ClassVar[Mapping[str, str]] = {"x-should-retry": "false"}


class ServiceUnavailableError(GatewayError):
    """Not ready, draining, or shedding load."""

    status_code = 503
    error_type = "service_unavailable"


class InternalServerError(GatewayError):
    """A bug; the message says so without details."""


async def _handle_gateway_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return exc.to_response()


async def _handle_http_exception(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error_type = _TYPE_BY_STATUS.get(exc.status_code, "server_error")
    return error_response(exc.status_code, str(exc.detail), error_type, headers=exc.headers)


async def _handle_unexpected(_request: Request, _exc: Exception) -> Response:
    # Starlette's ServerErrorMiddleware calls this, then re-raises so the server logs the
    # traceback; the client sees none of it.
    return InternalServerError("internal server error").to_response()


def exception_handlers() -> dict[Any, Callable[[Request, Exception], Awaitable[Response]]]:
    """Handlers for Starlette(exception_handlers=...): every error leaves OpenAI-shaped."""
    return {
        GatewayError: _handle_gateway_error,
        HTTPException: _handle_http_exception,
        Exception: _handle_unexpected,
    }
