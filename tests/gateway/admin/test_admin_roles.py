"""Admin credentials and roles on the replica's real composition (SQLite and PostgreSQL): every
admin route has a role, each role reaches exactly the routes it should, revoked credentials
are refused once the cache lets go, changes are audited with the credential, whoami."""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.testclient import TestClient

import tenants
from gateway.admin.api import admin_routes
from gateway.admin.auth import AdminGuard
from gateway.admin.credentials import AdminCredentialCache
from gateway.admin.roles import NO_CREDENTIAL, ROUTE_ROLES, UnmappedAdminRouteError
from gateway.http.errors import exception_handlers
from gateway.server.model_source import DEMO_MODEL
from gateway.server.model_spec import ModelSpec
from gateway.server.replica import compose_replica
from gateway.server.settings import GatewaySettings
from policies import TierTable
from tenants import AdminRole
from tests.gateway.app_harness import FakeModelLoader
from tests.gateway.conftest import ADMIN_TOKEN
from tests.manual_clock import ManualClock

CACHE_TTL_S = 5.0
# Written apart from gateway.admin.roles: the roles each role's holder may act as.
ACTS_AS: dict[AdminRole, set[AdminRole]] = {
    AdminRole.READ_ONLY: {AdminRole.READ_ONLY},
    AdminRole.BILLING: {AdminRole.READ_ONLY, AdminRole.BILLING},
    AdminRole.OPERATOR: {AdminRole.READ_ONLY, AdminRole.OPERATOR},
    AdminRole.OWNER: set(AdminRole),
}
_PATH_VALUES = {"tenant": "acme", "key_id:int": "1", "name": "no-such-adapter",
                "file": "console.js"}


def _expected_role(method: str, path: str) -> AdminRole | None:
    """What the user's guide promises, by rule rather than route by route: the console's
    files need nothing; reads need read-only, except the billing export (billing's); any
    other change under billing is billing's, every other change the operator's."""
    if not path.startswith("/admin/v1"):
        return None
    if method == "GET":
        return AdminRole.BILLING if path == "/admin/v1/billing/export" else AdminRole.READ_ONLY
    return AdminRole.BILLING if path.startswith("/admin/v1/billing/") else AdminRole.OPERATOR


def _walk(routes: list[BaseRoute], prefix: str = "") -> Iterator[tuple[str, str]]:
    for route in routes:
        if isinstance(route, Mount):
            yield from _walk(route.routes, prefix + route.path)
        elif isinstance(route, Route):
            for method in sorted(route.methods or ()):
                if method != "HEAD":  # Starlette adds it to every GET
                    yield method, prefix + route.path
        else:
            raise AssertionError(f"unexpected route type {type(route).__name__} at {prefix}")


def _concrete(path: str) -> str:
    return re.sub(r"\{([^}]+)\}", lambda m: _PATH_VALUES[m.group(1)], path)


def _error(response: httpx2.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture
def replica_app(db: Engine) -> Iterator[Starlette]:
    """The app `tiergate serve` composes, on the test's database; its lifespan never runs
    (no model loads), which the admin routes do not need."""
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        settings = GatewaySettings(
            host="127.0.0.1", port=0, database_url=str(db.url), admin_token=ADMIN_TOKEN,
            demo_model_dir=work / "demo", data_dir=work / "data",
            models=(ModelSpec(source=DEMO_MODEL),))
        replica = compose_replica(settings, TierTable(), db,
                                  model_loader=FakeModelLoader(work / "demo"))
        yield replica.app


def _without_lifespan(app: Starlette) -> TestClient:
    """A client that never enters the app's lifespan (which would start the replica: load a
    model, start the ledger's writer); the admin routes need none of it."""
    return TestClient(app, raise_server_exceptions=False)


def _mint(session_factory: sessionmaker[Session], name: str, role: AdminRole) -> tuple[int, str]:
    with session_factory.begin() as session:
        created = tenants.create_admin_credential(session, name=name, role=role.value,
                                                  actor="test")
        return created.credential.id, created.plaintext


@pytest.fixture
def secrets_by_role(session_factory: sessionmaker[Session]) -> dict[AdminRole, str]:
    return {role: _mint(session_factory, f"{role.value}-bot", role)[1] for role in AdminRole}


# --- the route table -----------------------------------------------------------------------------


def test_every_admin_route_of_the_replica_is_in_the_table_and_nothing_else(
        replica_app: Starlette) -> None:
    served = {key for key in _walk(replica_app.routes) if key[1].startswith("/admin")}
    assert served == set(ROUTE_ROLES)


def test_the_table_says_what_the_guide_promises() -> None:
    assert {key: _expected_role(*key) for key in ROUTE_ROLES} == ROUTE_ROLES


def test_a_route_missing_from_the_table_cannot_be_built() -> None:
    async def handler(_request: object) -> Response:
        return JSONResponse({})

    guard = AdminGuard(ADMIN_TOKEN)
    with pytest.raises(UnmappedAdminRouteError, match="GET /admin/v1/new-thing"):
        guard.route("/new-thing", handler, "GET", mounted_at="/admin/v1")
    with pytest.raises(UnmappedAdminRouteError):
        guard.route("/admin/v1/tenants", handler, "PUT")  # mapped for other methods only


@pytest.mark.parametrize("role", list(AdminRole), ids=lambda r: r.value)
def test_each_role_reaches_exactly_its_routes(
        replica_app: Starlette, secrets_by_role: dict[AdminRole, str], role: AdminRole) -> None:
    headers = {"authorization": f"Bearer {secrets_by_role[role]}"}
    client = _without_lifespan(replica_app)
    for (method, path), needed in ROUTE_ROLES.items():
        if needed is NO_CREDENTIAL:
            continue
        kwargs: dict[str, Any] = {"json": {}} if method in ("POST", "PATCH") else {}
        response = client.request(method, _concrete(path), headers=headers, **kwargs)
        expected = _expected_role(method, path)
        assert expected is not None
        if expected in ACTS_AS[role]:
            assert response.status_code not in (401, 403), (method, path, response.text)
        else:
            error = _error(response, 403)
            assert error["code"] == "admin_role_required", (method, path)
            assert f"'{expected.value}'" in error["message"]


def test_the_console_files_need_no_credential_and_the_token_is_owner(
        replica_app: Starlette) -> None:
    client = _without_lifespan(replica_app)
    for method, path in [k for k, role in ROUTE_ROLES.items() if role is NO_CREDENTIAL]:
        assert client.request(method, _concrete(path)).status_code == 200, path
    whoami = client.get("/admin/v1/whoami", headers={"x-admin-token": ADMIN_TOKEN}).json()
    assert whoami == {"object": "admin_credential", "id": None, "name": "env",
                      "role": "owner", "grants": {r.value: True for r in AdminRole}}


def test_whoami_names_the_credential_and_what_it_may_do(
        replica_app: Starlette, session_factory: sessionmaker[Session]) -> None:
    credential_id, secret = _mint(session_factory, "ledger-export", AdminRole.BILLING)
    response = _without_lifespan(replica_app).get("/admin/v1/whoami",
                                                  headers={"x-admin-token": secret})
    assert response.json() == {
        "object": "admin_credential", "id": credential_id, "name": "ledger-export",
        "role": "billing",
        "grants": {"read-only": True, "billing": True, "operator": False, "owner": False},
    }
    with session_factory() as session:
        assert tenants.get_admin_credential(session, credential_id).last_used_at is not None


# --- credentials without the token, revocation, the cache ----------------------------------------


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def tokenless_app(session_factory: sessionmaker[Session], clock: ManualClock) -> Starlette:
    """The admin API with no TIERGATE_ADMIN_TOKEN: credentials only, cached CACHE_TTL_S."""
    cache = AdminCredentialCache(session_factory, ttl_s=CACHE_TTL_S, clock=clock)
    guard = AdminGuard(None, cache, clock=clock)
    return Starlette(routes=admin_routes(session_factory=session_factory, admin_token=None,
                                         guard=guard),
                     exception_handlers=exception_handlers())


def test_without_the_token_the_api_opens_once_a_credential_exists(
        tokenless_app: Starlette, session_factory: sessionmaker[Session],
        clock: ManualClock) -> None:
    with TestClient(tokenless_app) as client:
        error = _error(client.get("/admin/v1/tenants", headers={"x-admin-token": ADMIN_TOKEN}),
                       404)
        assert error["code"] == "admin_api_disabled"
        _, secret = _mint(session_factory, "alice", AdminRole.READ_ONLY)
        clock.advance(CACHE_TTL_S)
        assert client.get("/admin/v1/tenants", headers={"x-admin-token": secret}).status_code == 200
        # The token is not configured here: presenting it opens nothing.
        wrong = client.get("/admin/v1/tenants", headers={"x-admin-token": ADMIN_TOKEN})
        assert _error(wrong, 401)["code"] == "invalid_admin_token"


def test_a_revoked_credential_is_refused_within_the_cache_ttl(
        tokenless_app: Starlette, session_factory: sessionmaker[Session],
        clock: ManualClock) -> None:
    _mint(session_factory, "keeps-the-api-on", AdminRole.OWNER)
    credential_id, secret = _mint(session_factory, "leaver", AdminRole.OPERATOR)
    headers = {"authorization": f"Bearer {secret}"}
    with TestClient(tokenless_app) as client:
        assert client.get("/admin/v1/tenants", headers=headers).status_code == 200
        with session_factory.begin() as session:
            tenants.revoke_admin_credential(
                session, tenants.get_admin_credential(session, credential_id), actor="test")
        # Another replica's revocation: this one still holds the credential until its TTL.
        assert client.get("/admin/v1/tenants", headers=headers).status_code == 200
        clock.advance(CACHE_TTL_S)
        error = _error(client.get("/admin/v1/tenants", headers=headers), 401)
        assert error["code"] == "admin_credential_revoked"
        made_up = secret[:-4] + ("aaaa" if not secret.endswith("aaaa") else "bbbb")
        assert _error(client.get("/admin/v1/tenants", headers={"x-admin-token": made_up}),
                      401)["code"] == "invalid_admin_token"


def test_failures_are_logged_without_the_secret(
        tokenless_app: Starlette, session_factory: sessionmaker[Session],
        caplog: pytest.LogCaptureFixture) -> None:
    _, secret = _mint(session_factory, "reader", AdminRole.READ_ONLY)
    with TestClient(tokenless_app) as client, caplog.at_level(logging.DEBUG):
        client.post("/admin/v1/tenants", json={"name": "x"}, headers={"x-admin-token": secret})
        client.get("/admin/v1/tenants", headers={"x-admin-token": secret[:-1] + "!"})
    assert "admin_role_required" in caplog.text and "invalid_admin_token" in caplog.text
    assert secret not in caplog.text and secret[:-1] not in caplog.text


# --- the audit log -------------------------------------------------------------------------------


def test_every_change_is_audited_with_the_credential(
        tokenless_app: Starlette, session_factory: sessionmaker[Session]) -> None:
    credential_id, secret = _mint(session_factory, "ops-bot", AdminRole.OPERATOR)
    _, reader = _mint(session_factory, "auditor", AdminRole.READ_ONLY)
    with TestClient(tokenless_app) as client:
        client.headers["x-admin-token"] = secret
        assert client.post("/admin/v1/tenants", json={"name": "acme"}).status_code == 201
        client.patch("/admin/v1/tenants/acme", json={"weight": 2})
        client.post("/admin/v1/tenants/acme/disable")
        client.post("/admin/v1/tenants/acme/enable")
        key = client.post("/admin/v1/tenants/acme/keys", json={"name": "ci"}).json()
        client.patch(f"/admin/v1/keys/{key['id']}", json={"allowed_models": ["m"]})
        client.post(f"/admin/v1/keys/{key['id']}/rotate", json={})
        client.delete(f"/admin/v1/keys/{key['id']}")
        audit = client.get("/admin/v1/audit", headers={"x-admin-token": reader})
    changes = [e for e in audit.json()["data"] if e["target_type"] != "admin_credential"]
    assert [e["action"] for e in reversed(changes)] == [
        "tenant.create", "tenant.update", "tenant.disable", "tenant.enable",
        "api_key.create", "api_key.update", "api_key.rotate", "api_key.revoke"]
    assert {e["actor"] for e in changes} == {f"admin:{credential_id}:ops-bot"}
    assert secret not in audit.text
