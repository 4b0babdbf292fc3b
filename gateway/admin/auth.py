"""The admin token: how it is configured and how every /admin route checks it.

One token (TIERGATE_ADMIN_TOKEN), sent as ``x-admin-token: <token>`` or
``Authorization: Bearer <token>``, compared in constant time. A tenant key presented here
gets 403: tenant keys never open admin routes. With no token configured the admin API is
off and its routes answer 404 ``admin_api_disabled``.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

import tenants
from gateway.access.auth import bearer_token
from gateway.http.errors import (
    AuthenticationError,
    GatewayError,
    NotFoundError,
    PermissionDeniedError,
)

logger = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "TIERGATE_ADMIN_TOKEN"
MIN_ADMIN_TOKEN_LENGTH = 16
# Bits a token's length and alphabet allow at most (len x log2(distinct characters)): 128 for
# secrets.token_hex(16), 0 for one character repeated.
MIN_ADMIN_TOKEN_BITS = 64
# Failed admin authentications are logged, at most this many lines a second (a flood is
# counted, not written line by line).
MAX_FAILURE_LOG_LINES_PER_S = 5
ADMIN_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

Endpoint = Callable[[Request], Awaitable[Response]]


class InvalidAdminTokenError(ValueError):
    """The configured admin token is too weak or could be mistaken for a tenant key."""


def validate_admin_token(token: str) -> str:
    """The token if it can be a random secret: at least MIN_ADMIN_TOKEN_LENGTH characters and
    MIN_ADMIN_TOKEN_BITS bits by its length and alphabet (len x log2(distinct characters)), so
    "aaaaaaaaaaaaaaaa" or "1234123412341234" are refused; not shaped like a tenant key."""
    if len(token) < MIN_ADMIN_TOKEN_LENGTH:
        raise InvalidAdminTokenError(
            f"{ADMIN_TOKEN_ENV} must be at least {MIN_ADMIN_TOKEN_LENGTH} characters"
        )
    if len(token) * math.log2(max(len(set(token)), 1)) < MIN_ADMIN_TOKEN_BITS:
        raise InvalidAdminTokenError(
            f"{ADMIN_TOKEN_ENV} is too repetitive to be a secret: use a random one, e.g. "
            "python3 -c 'import secrets; print(secrets.token_hex(16))'"
        )
    if tenants.looks_like_key(token):
        raise InvalidAdminTokenError(f"{ADMIN_TOKEN_ENV} must not start like a tenant key (tg-)")
    return token


class AdminGuard:
    """Wraps admin endpoints: the token is checked first, every error leaves OpenAI-shaped."""

    def __init__(self, admin_token: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._admin_token = validate_admin_token(admin_token).encode()
        self._failures = _FailureLog(clock)

    def __call__(self, handler: Endpoint) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            try:
                self.check(request)
                return await handler(request)
            except GatewayError as exc:
                return exc.to_response()

        return endpoint

    def check(self, request: Request) -> None:
        """Raise unless request carries the admin token; a failure is logged (never the
        token presented)."""
        try:
            self._check(request)
        except GatewayError as exc:
            self._failures.record(request, exc)
            raise

    def _check(self, request: Request) -> None:
        presented = request.headers.get("x-admin-token") or bearer_token(
            request.headers.get("authorization")
        )
        if not presented:
            raise AuthenticationError(
                "missing admin token: send 'x-admin-token: <token>' or 'Authorization: Bearer'",
                code="missing_admin_token",
            )
        if tenants.looks_like_key(presented):
            raise PermissionDeniedError(
                "tenant API keys cannot use the admin API", code="tenant_key_not_allowed"
            )
        if not hmac.compare_digest(presented.encode(), self._admin_token):
            raise AuthenticationError("invalid admin token", code="invalid_admin_token")


class _FailureLog:
    """Warnings of failed admin authentications, at most MAX_FAILURE_LOG_LINES_PER_S lines a
    second; the failures a full second left out are counted on the next line."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._second = -1
        self._lines_this_second = 0
        self._unlogged = 0

    def record(self, request: Request, exc: GatewayError) -> None:
        second = int(self._clock())
        if second != self._second:
            self._second, self._lines_this_second = second, 0
        if self._lines_this_second >= MAX_FAILURE_LOG_LINES_PER_S:
            self._unlogged += 1
            return
        self._lines_this_second += 1
        unlogged, self._unlogged = self._unlogged, 0
        client = request.client.host if request.client else "unknown"
        logger.warning(
            "admin authentication failed: %s from %s for %s %s%s", exc.code, client,
            request.method, request.url.path,
            f" ({unlogged} more failures not logged)" if unlogged else "",
        )


async def admin_disabled(_request: Request) -> Response:
    """The answer of every admin route while no admin token is configured."""
    return NotFoundError(
        f"the admin API is disabled: set {ADMIN_TOKEN_ENV} to enable it",
        code="admin_api_disabled",
    ).to_response()
