"""The admin token: how it is configured and how every /admin route checks it.

One token (TIERGATE_ADMIN_TOKEN), sent as ``x-admin-token: <token>`` or
``Authorization: Bearer <token>``, compared in constant time. A tenant key presented here
gets 403: tenant keys never open admin routes. With no token configured the admin API is
off and its routes answer 404 ``admin_api_disabled``.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

import tenants
from gateway.auth import bearer_token
from gateway.errors import AuthenticationError, GatewayError, NotFoundError, PermissionDeniedError

ADMIN_TOKEN_ENV = "TIERGATE_ADMIN_TOKEN"
MIN_ADMIN_TOKEN_LENGTH = 16
ADMIN_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

Endpoint = Callable[[Request], Awaitable[Response]]


class InvalidAdminTokenError(ValueError):
    """The configured admin token is too weak or could be mistaken for a tenant key."""


def validate_admin_token(token: str) -> str:
    if len(token) < MIN_ADMIN_TOKEN_LENGTH:
        raise InvalidAdminTokenError(
            f"{ADMIN_TOKEN_ENV} must be at least {MIN_ADMIN_TOKEN_LENGTH} characters"
        )
    if tenants.looks_like_key(token):
        raise InvalidAdminTokenError(f"{ADMIN_TOKEN_ENV} must not start like a tenant key (tg-)")
    return token


class AdminGuard:
    """Wraps admin endpoints: the token is checked first, every error leaves OpenAI-shaped."""

    def __init__(self, admin_token: str) -> None:
        self._admin_token = validate_admin_token(admin_token).encode()

    def __call__(self, handler: Endpoint) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            try:
                self.check(request)
                return await handler(request)
            except GatewayError as exc:
                return exc.to_response()

        return endpoint

    def check(self, request: Request) -> None:
        """Raise unless request carries the admin token."""
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


async def admin_disabled(_request: Request) -> Response:
    """The answer of every admin route while no admin token is configured."""
    return NotFoundError(
        f"the admin API is disabled: set {ADMIN_TOKEN_ENV} to enable it",
        code="admin_api_disabled",
    ).to_response()
