"""Gateway test fixtures: the database fixtures of tests/tenants/conftest.py (SQLite and
PostgreSQL) and a small app wiring the admin API and tenant authentication together.

pytest shares conftest fixtures only down a folder tree, so this re-exports those fixtures
rather than keeping a second copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.access.auth import TenantKeyResolver
from gateway.admin.api import admin_routes
from gateway.http.errors import exception_handlers
from tenants import DEFAULT_TIERS
from tests.manual_clock import ManualClock
from tests.tenants.conftest import (
    database_url,
    db,
    engine,
    fresh_database_url,
    session,
    session_factory,
    stored_values,
)

__all__ = [
    "database_url",
    "db",
    "engine",
    "fresh_database_url",
    "session",
    "session_factory",
    "stored_values",
]


ADMIN_TOKEN = "admin-token-for-tests-0123456789"


@dataclass
class GatewayHarness:
    """A small app: the admin API plus one tenant-authenticated route, /v1/whoami."""

    app: Starlette
    resolver: TenantKeyResolver
    clock: ManualClock  # moved past the key cache TTL by the tests
    admin_headers: dict[str, str]


def build_harness(
    session_factory: sessionmaker[Session],
    *,
    admin_token: str | None = ADMIN_TOKEN,
    known_tiers: Collection[str] = DEFAULT_TIERS,
) -> GatewayHarness:
    clock = ManualClock()
    resolver = TenantKeyResolver(session_factory, ttl_s=5.0, clock=clock)

    async def whoami(request: Request) -> Response:
        principal = await resolver.authenticate(request)
        return JSONResponse(
            {
                "tenant_id": principal.tenant_id,
                "tenant": principal.tenant_name,
                "tier": principal.tier,
                "api_key_id": principal.api_key_id,
                "requests_per_minute": principal.quota.requests_per_minute,
                "key_requests_per_minute": principal.key_quota.requests_per_minute,
            }
        )

    async def boom(_request: Request) -> Response:
        raise RuntimeError("internal detail that must not leak")

    routes = [
        *admin_routes(
            session_factory=session_factory,
            admin_token=admin_token,
            key_resolver=resolver,
            known_tiers=known_tiers,
        ),
        Route("/v1/whoami", whoami),
        Route("/boom", boom),
    ]
    app = Starlette(routes=routes, exception_handlers=exception_handlers())
    return GatewayHarness(app, resolver, clock, {"x-admin-token": admin_token or ""})


@pytest.fixture
def harness_factory(session_factory: sessionmaker[Session]) -> Callable[..., GatewayHarness]:
    """build_harness on the test's database, for tests that need other admin settings."""
    return functools.partial(build_harness, session_factory)


@pytest.fixture
def harness(session_factory: sessionmaker[Session]) -> GatewayHarness:
    return build_harness(session_factory)


@pytest.fixture
def client(harness: GatewayHarness) -> Iterator[TestClient]:
    # raise_server_exceptions=False: a bug must come back as an OpenAI-shaped 500.
    with TestClient(harness.app, raise_server_exceptions=False) as client:
        yield client
