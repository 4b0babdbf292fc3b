"""Admin authentication and authorisation: how every /admin route checks who is asking and
whether their role may use it.

Two kinds of credential open the admin API, sent as ``x-admin-token: <secret>`` or
``Authorization: Bearer <secret>``:

- admin credentials minted with ``tiergate admin-credentials create`` (secrets ``tga-...``),
  each with a name and a role (tenants.AdminRole), looked up through a short cache
  (gateway.admin.credentials): a revoked one gets 401 ``admin_credential_revoked``;
- the deployment's TIERGATE_ADMIN_TOKEN, if set: an owner credential named "env", compared in
  constant time.

The admin API is on while either exists: with no token set and no unrevoked credential in
the database every admin route answers 404 ``admin_api_disabled``. A tenant key presented
here gets 403: tenant keys never open admin routes. A credential whose role does not cover
the route (gateway.admin.roles) gets 403 ``admin_role_required`` naming the role needed.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import tenants
from gateway.access.auth import bearer_token
from gateway.admin.credentials import (
    DEFAULT_ADMIN_CACHE_TTL_S,
    ENV_CREDENTIAL_NAME,
    AdminCredentialCache,
    AdminPrincipal,
)
from gateway.admin.roles import grants, required_role
from gateway.http.errors import (
    AuthenticationError,
    GatewayError,
    NotFoundError,
    PermissionDeniedError,
)
from tenants import AdminRole

logger = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "TIERGATE_ADMIN_TOKEN"
MIN_ADMIN_TOKEN_LENGTH = 16
# Bits a token's length and alphabet allow at most (len x log2(distinct characters)): 128 for
# secrets.token_hex(16), 0 for one character repeated.
MIN_ADMIN_TOKEN_BITS = 64
# Failed admin authentications are logged, at most this many lines a second (a flood is
# counted, not written line by line).
MAX_FAILURE_LOG_LINES_PER_S = 5

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
    """Wraps admin endpoints: who is asking and whether their role covers the route are
    checked first; every error leaves OpenAI-shaped. The principal is left in
    ``request.state.admin`` for the handler (the audit log's actor, whoami)."""

    def __init__(self, admin_token: str | None = None,
                 credentials: AdminCredentialCache | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._admin_token = None if not admin_token else validate_admin_token(admin_token).encode()
        self._credentials = credentials
        self._failures = _FailureLog(clock)

    @classmethod
    def for_deployment(cls, admin_token: str | None, session_factory: sessionmaker[Session],
                       ttl_s: float = DEFAULT_ADMIN_CACHE_TTL_S) -> AdminGuard:
        """The token (if set) and the database's credentials, cached for ttl_s seconds."""
        if not admin_token:
            logger.info(
                "%s is not set: the admin API answers admin credentials only, and 404 "
                "while none exists (tiergate admin-credentials create)", ADMIN_TOKEN_ENV)
        return cls(admin_token, AdminCredentialCache(session_factory, ttl_s=ttl_s))

    def route(self, path: str, handler: Endpoint, method: str, *, mounted_at: str = "") -> Route:
        """A Route for path (relative to the Mount at mounted_at, if any), guarded by the role
        gateway.admin.roles names for it; raises for a route the table does not name."""
        return Route(path, self.requiring(method, mounted_at + path)(handler), methods=[method])

    def requiring(self, method: str, full_path: str) -> Callable[[Endpoint], Endpoint]:
        """The wrapper of the endpoint at full_path (for routes built elsewhere, e.g. the
        metrics route)."""
        role = required_role(method, full_path)
        if role is None:
            raise ValueError(f"{method} {full_path} needs no credential: do not guard it")

        def wrap(handler: Endpoint) -> Endpoint:
            async def endpoint(request: Request) -> Response:
                try:
                    request.state.admin = await self.check(request, role)
                    return await handler(request)
                except GatewayError as exc:
                    return exc.to_response()

            return endpoint

        return wrap

    async def check(self, request: Request, role: AdminRole) -> AdminPrincipal:
        """The principal of request if its credential's role covers role; raises otherwise
        (a failure is logged, never the secret presented; a disabled API is not a failure)."""
        await self._ensure_enabled()
        try:
            principal = await self._authenticate(request)
            if not grants(principal.role, role):
                raise PermissionDeniedError(
                    f"this route needs the {role.value!r} role (or owner); the credential "
                    f"{principal.name!r} has {principal.role.value!r}",
                    code="admin_role_required")
            return principal
        except GatewayError as exc:
            self._failures.record(request, exc)
            raise

    async def _ensure_enabled(self) -> None:
        """The admin API is on while the token is set or an unrevoked credential exists."""
        if self._admin_token is None and (
                self._credentials is None or not await self._credentials.has_credentials()):
            raise NotFoundError(
                f"the admin API is disabled: set {ADMIN_TOKEN_ENV} or create an admin "
                "credential (tiergate admin-credentials create) to enable it",
                code="admin_api_disabled")

    async def _authenticate(self, request: Request) -> AdminPrincipal:
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
        if self._admin_token is not None and hmac.compare_digest(
                presented.encode(), self._admin_token):
            return AdminPrincipal(None, ENV_CREDENTIAL_NAME, AdminRole.OWNER)
        if self._credentials is not None and tenants.looks_like_admin_secret(presented):
            lookup = await self._credentials.lookup(presented)
            if lookup.is_revoked:
                raise AuthenticationError("this admin credential has been revoked",
                                          code="admin_credential_revoked")
            if lookup.principal is not None:
                return lookup.principal
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
