"""The admin API under /admin/v1 on SQLite and PostgreSQL: admin token, tenants and quotas,
keys, audit log, OpenAI-shaped validation errors."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx2
import pytest
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import Request
from starlette.testclient import TestClient

from gateway.admin.api import admin_routes
from gateway.admin.auth import (
    MAX_FAILURE_LOG_LINES_PER_S,
    AdminGuard,
    InvalidAdminTokenError,
    validate_admin_token,
)
from gateway.http.errors import AuthenticationError
from tenants import AdminRole
from tenants.keys import PREFIX_LENGTH
from tests.manual_clock import ManualClock

if TYPE_CHECKING:
    from tests.gateway.conftest import GatewayHarness


@pytest.fixture
def admin(client: TestClient, harness: GatewayHarness) -> TestClient:
    """The test client, sending the admin token on every request."""
    client.headers.update(harness.admin_headers)
    return client


def _error(response: httpx2.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _create_tenant(admin: TestClient, name: str = "acme", **fields: Any) -> dict[str, Any]:
    response = admin.post("/admin/v1/tenants", json={"name": name, **fields})
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def _create_key(admin: TestClient, tenant: str = "acme") -> dict[str, Any]:
    response = admin.post(f"/admin/v1/tenants/{tenant}/keys", json={"name": "ci"})
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


# --- admin token -------------------------------------------------------------------------------


def test_missing_or_wrong_admin_token_is_401(client: TestClient) -> None:
    assert _error(client.get("/admin/v1/tenants"), 401)["code"] == "missing_admin_token"
    wrong = client.get("/admin/v1/tenants", headers={"x-admin-token": "not-the-admin-token!"})
    assert _error(wrong, 401)["code"] == "invalid_admin_token"
    wrong_bearer = client.get("/admin/v1/audit", headers={"authorization": "Bearer nope"})
    assert _error(wrong_bearer, 401)["type"] == "authentication_error"


def test_admin_token_as_header_or_bearer(client: TestClient, harness: GatewayHarness) -> None:
    token = harness.admin_headers["x-admin-token"]
    assert client.get("/admin/v1/tenants", headers={"x-admin-token": token}).status_code == 200
    bearer = {"authorization": f"Bearer {token}"}
    assert client.get("/admin/v1/tenants", headers=bearer).status_code == 200


def test_tenant_key_never_opens_an_admin_route(admin: TestClient) -> None:
    _create_tenant(admin)
    key = _create_key(admin)["key"]
    for headers in ({"authorization": f"Bearer {key}"}, {"x-admin-token": key}):
        admin.headers.clear()
        for method, path in [
            ("GET", "/admin/v1/tenants"),
            ("POST", "/admin/v1/tenants/acme/keys"),
            ("GET", "/admin/v1/audit"),
        ]:
            error = _error(admin.request(method, path, headers=headers), 403)
            assert error["code"] == "tenant_key_not_allowed"


def test_admin_api_off_without_token_or_credential_answers_404(
    caplog: pytest.LogCaptureFixture,
    harness_factory: Callable[..., GatewayHarness],
) -> None:
    with caplog.at_level(logging.INFO, logger="gateway.admin.auth"):
        harness = harness_factory(admin_token=None)
    assert "TIERGATE_ADMIN_TOKEN is not set" in caplog.text
    with TestClient(harness.app) as client:
        for method, path in [("GET", "/admin/v1/tenants"), ("POST", "/admin/v1/keys/1/revoke"),
                             ("GET", "/admin/v1/whoami")]:
            error = _error(client.request(method, path, headers={"x-admin-token": "x" * 20}), 404)
            assert error["code"] == "admin_api_disabled"


def test_weak_or_tenant_shaped_admin_tokens_are_refused(
    session_factory: sessionmaker[Session],
) -> None:
    # too short, tenant-shaped, and long enough but too repetitive to be a secret
    for token in ["short", "tg-" + "a" * 30, "s" * 16, "1234" * 4, "abcdefgh" * 2]:
        with pytest.raises(InvalidAdminTokenError):
            admin_routes(session_factory=session_factory, admin_token=token)
    for token in [secrets.token_hex(16), secrets.token_urlsafe(16), "admin-token-0123456789"]:
        assert validate_admin_token(token) == token


def test_failed_admin_logins_are_logged_without_the_token(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    presented = "wrong-admin-token-" + secrets.token_hex(8)
    with caplog.at_level(logging.WARNING, logger="gateway.admin.auth"):
        client.get("/admin/v1/tenants", headers={"x-admin-token": presented})
        client.post("/admin/v1/tenants", json={"name": "x"})
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.admin.auth"]
    assert len(lines) == 2
    assert "invalid_admin_token" in lines[0] and "GET /admin/v1/tenants" in lines[0]
    assert "missing_admin_token" in lines[1] and "POST /admin/v1/tenants" in lines[1]
    assert all(presented not in line for line in lines)


def test_a_flood_of_failures_is_counted_not_logged_line_by_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock(100.0)
    guard = AdminGuard(secrets.token_hex(16), clock=clock)
    request = Request({"type": "http", "method": "GET", "path": "/admin/v1/tenants",
                       "headers": [(b"x-admin-token", b"nope")], "client": ("10.0.0.9", 5),
                       "query_string": b"", "server": ("test", 80), "scheme": "http"})
    with caplog.at_level(logging.WARNING, logger="gateway.admin.auth"):
        for _ in range(MAX_FAILURE_LOG_LINES_PER_S + 7):
            with pytest.raises(AuthenticationError):
                asyncio.run(guard.check(request, AdminRole.READ_ONLY))
        clock.advance(1.0)
        with pytest.raises(AuthenticationError):
            asyncio.run(guard.check(request, AdminRole.READ_ONLY))
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.admin.auth"]
    assert len(lines) == MAX_FAILURE_LOG_LINES_PER_S + 1
    assert "from 10.0.0.9" in lines[0] and lines[-1].endswith("(7 more failures not logged)")


# --- tenants and quotas --------------------------------------------------------------------------


def test_create_get_list_tenants(admin: TestClient) -> None:
    created = _create_tenant(
        admin, tier="premium", weight=2, quota={"requests_per_minute": 600, "kv_cap_share": 0.3}
    )
    assert created["tier"] == "premium" and created["weight"] == 2.0
    assert created["status"] == "active"
    assert created["quota"]["requests_per_minute"] == 600
    assert created["quota"]["tokens_per_minute"] is None
    assert admin.get(f"/admin/v1/tenants/{created['id']}").json() == created
    assert admin.get("/admin/v1/tenants/acme").json() == created
    _create_tenant(admin, "other")
    listing = admin.get("/admin/v1/tenants").json()
    assert listing["object"] == "list"
    assert [t["name"] for t in listing["data"]] == ["acme", "other"]


def test_create_defaults_to_standard_tier(admin: TestClient) -> None:
    created = _create_tenant(admin)
    assert (created["tier"], created["weight"]) == ("standard", 1.0)
    assert len(created["cache_salt"]) == 32


def test_patch_changes_only_what_it_names(admin: TestClient) -> None:
    _create_tenant(admin, quota={"requests_per_minute": 60, "tokens_per_minute": 10_000})
    patched = admin.patch(
        "/admin/v1/tenants/acme",
        json={"weight": 0.5, "quota": {"tokens_per_minute": None, "max_concurrent_requests": 4}},
    )
    assert patched.status_code == 200
    quota = patched.json()["quota"]
    assert patched.json()["weight"] == 0.5
    assert quota["requests_per_minute"] == 60
    assert quota["tokens_per_minute"] is None  # null: unlimited
    assert quota["max_concurrent_requests"] == 4


def test_disable_and_enable(admin: TestClient) -> None:
    _create_tenant(admin)
    assert admin.post("/admin/v1/tenants/acme/disable").json()["status"] == "disabled"
    listing = admin.get("/admin/v1/tenants", params={"status": "disabled"}).json()["data"]
    assert [t["name"] for t in listing] == ["acme"]
    assert admin.post("/admin/v1/tenants/acme/enable").json()["status"] == "active"
    assert admin.get("/admin/v1/tenants", params={"status": "disabled"}).json()["data"] == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tier": "standard"}, "name"),
        ({"name": "Acme"}, "name"),
        ({"name": "acme", "tier": "gold"}, "tier"),
        ({"name": "acme", "weight": 0}, "weight"),
        ({"name": "acme", "weight": "2"}, "weight"),
        ({"name": "acme", "quota": {"kv_cap_share": 1.5}}, "quota.kv_cap_share"),
        ({"name": "acme", "quota": {"requests_per_minute": "60"}}, "quota.requests_per_minute"),
        ({"name": "acme", "quota": {"requests_per_minute": True}}, "quota.requests_per_minute"),
        ({"name": "acme", "quota": {"tokens_per_hour": 1}}, "quota.tokens_per_hour"),
        ({"name": "acme", "quota": 5}, "quota"),
        ({"name": "acme", "status": "disabled"}, "status"),
    ],
)
def test_invalid_create_bodies_are_400_naming_the_param(
    admin: TestClient, body: dict[str, Any], param: str
) -> None:
    error = _error(admin.post("/admin/v1/tenants", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert admin.get("/admin/v1/tenants").json()["data"] == []


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"", "not valid JSON")],
)
def test_malformed_bodies_are_400(admin: TestClient, content: bytes, message: str) -> None:
    response = admin.post(
        "/admin/v1/tenants", content=content, headers={"content-type": "application/json"}
    )
    assert message in _error(response, 400)["message"]


def test_oversized_body_is_413(admin: TestClient) -> None:
    response = admin.post("/admin/v1/tenants", json={"name": "acme", "pad": "x" * 70_000})
    assert _error(response, 413)["code"] == "request_too_large"


def test_patch_errors(admin: TestClient) -> None:
    _create_tenant(admin)
    _create_tenant(admin, "other")
    assert _error(admin.patch("/admin/v1/tenants/acme", json={"id": 3}), 400)["param"] == "id"
    renamed = admin.patch("/admin/v1/tenants/other", json={"name": "acme"})
    assert _error(renamed, 409)["param"] == "name"
    assert _error(admin.patch("/admin/v1/tenants/nobody", json={}), 404)["type"] == (
        "not_found_error"
    )


def test_duplicate_name_is_409(admin: TestClient) -> None:
    _create_tenant(admin)
    assert _error(admin.post("/admin/v1/tenants", json={"name": "acme"}), 409)["param"] == "name"


def test_unknown_tenant_or_key_is_404(admin: TestClient) -> None:
    for method, path in [
        ("GET", "/admin/v1/tenants/404"),
        ("POST", "/admin/v1/tenants/nobody/disable"),
        ("GET", "/admin/v1/tenants/nobody/keys"),
        ("POST", "/admin/v1/tenants/nobody/keys"),
        ("GET", "/admin/v1/keys/404"),
        ("DELETE", "/admin/v1/keys/404"),
    ]:
        assert _error(admin.request(method, path), 404)["code"] == "not_found"


@pytest.mark.parametrize(
    ("method", "path", "param"),
    [
        ("GET", "/admin/v1/tenants/12345678901234567890123", "tenant"),
        ("GET", "/admin/v1/tenants/2147483648", "tenant"),
        ("POST", "/admin/v1/tenants/99999999999999999999/disable", "tenant"),
        ("GET", "/admin/v1/keys/12345678901234567890123", "key_id"),
        ("DELETE", "/admin/v1/keys/2147483648", "key_id"),
        ("GET", "/admin/v1/audit?before=12345678901234567890123", "before"),
        ("GET", "/admin/v1/audit?before=%C2%B2", "before"),
        ("GET", "/admin/v1/audit?limit=%C2%B2", "limit"),
        ("GET", "/admin/v1/audit?limit=10000000000000000000000", "limit"),
        ("GET", "/admin/v1/audit?limit=+5", "limit"),
    ],
)
def test_ids_past_the_database_or_not_ascii_digits_are_400(
    admin: TestClient, method: str, path: str, param: str
) -> None:
    """Each was a 500: a database overflow, or int() refusing what isdigit() took."""
    error = _error(admin.request(method, path), 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


def test_a_tenant_ref_of_other_digits_is_a_name(admin: TestClient) -> None:
    """'²' is a digit to str.isdigit but not an id: it is looked up (and not found) by
    name, a 404 instead of a 500."""
    assert _error(admin.get("/admin/v1/tenants/%C2%B2"), 404)["code"] == "not_found"


def test_key_plaintext_is_returned_once(admin: TestClient) -> None:
    _create_tenant(admin)
    created = _create_key(admin)
    key = created["key"]
    assert key.startswith("tg-") and created["prefix"] == key[:PREFIX_LENGTH]
    listing = admin.get("/admin/v1/tenants/acme/keys")
    assert [k["prefix"] for k in listing.json()["data"]] == [created["prefix"]]
    shown = admin.get(f"/admin/v1/keys/{created['id']}")
    for response in (listing, shown):
        assert key not in response.text
        assert key[PREFIX_LENGTH + 1 :] not in response.text
        assert "key_hash" not in response.text


def test_create_key_with_empty_body_uses_default_name(admin: TestClient) -> None:
    _create_tenant(admin)
    response = admin.post("/admin/v1/tenants/acme/keys")
    assert response.status_code == 201 and response.json()["name"] == "default"


@pytest.mark.parametrize("method", ["DELETE", "POST"])
def test_revoke_key(admin: TestClient, method: str) -> None:
    _create_tenant(admin)
    created = _create_key(admin)
    path = f"/admin/v1/keys/{created['id']}" + ("/revoke" if method == "POST" else "")
    revoked = admin.request(method, path)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    again = admin.request(method, path)  # idempotent: same revocation time
    assert again.json()["revoked_at"] == revoked.json()["revoked_at"]
    whoami = admin.get("/v1/whoami", headers={"authorization": f"Bearer {created['key']}"})
    assert _error(whoami, 403)["code"] == "api_key_revoked"


def test_a_keys_own_limits_round_trip_validated_audited_and_reach_its_principal(
    admin: TestClient,
) -> None:
    _create_tenant(admin)
    created = admin.post("/admin/v1/tenants/acme/keys", json={
        "name": "ci", "requests_per_minute": 5, "monthly_spend_budget_usd_micros": 2_000_000})
    assert created.status_code == 201, created.text
    key = created.json()
    assert (key["requests_per_minute"], key["tokens_per_minute"], key["monthly_token_budget"],
            key["monthly_spend_budget_usd_micros"]) == (5, None, None, 2_000_000)
    bearer = {"authorization": f"Bearer {key['key']}"}
    assert admin.get("/v1/whoami", headers=bearer).json()["key_requests_per_minute"] == 5

    path = f"/admin/v1/keys/{key['id']}"
    changed = admin.patch(path, json={"requests_per_minute": 7, "tokens_per_minute": 1000})
    assert changed.status_code == 200, changed.text
    assert (changed.json()["requests_per_minute"], changed.json()["tokens_per_minute"],
            changed.json()["monthly_spend_budget_usd_micros"]) == (7, 1000, 2_000_000)
    # the change reaches the key's cached principal at once (no wait for the cache's TTL)
    assert admin.get("/v1/whoami", headers=bearer).json()["key_requests_per_minute"] == 7
    cleared = admin.patch(path, json={"requests_per_minute": None})
    assert cleared.json()["requests_per_minute"] is None
    assert admin.get("/v1/whoami", headers=bearer).json()["key_requests_per_minute"] is None

    for field, value in (("tokens_per_minute", -1), ("monthly_token_budget", "10"),
                         ("requests_per_minute", 1.5), ("monthly_spend_budget_usd_micros", True),
                         ("requests_per_minute", 2**31)):
        assert _error(admin.patch(path, json={field: value}), 400)["param"] == field
        refused = admin.post("/admin/v1/tenants/acme/keys", json={field: value})
        assert _error(refused, 400)["param"] == field
    assert _error(admin.patch(path, json={}), 400)["param"] == "body"
    assert admin.get(path).json()["tokens_per_minute"] == 1000  # the 400s changed nothing

    entries = admin.get("/admin/v1/audit", params={"target_type": "api_key"}).json()["data"]
    assert [e["action"] for e in entries] == ["api_key.update", "api_key.update", "api_key.create"]
    assert entries[1]["before"]["requests_per_minute"] == 5
    assert entries[1]["after"]["requests_per_minute"] == 7
    assert entries[1]["after"]["tokens_per_minute"] == 1000
    assert entries[0]["after"]["requests_per_minute"] is None


# --- audit log -------------------------------------------------------------------------------


def test_admin_actions_appear_in_the_audit_log(admin: TestClient) -> None:
    tenant = _create_tenant(admin)
    admin.patch("/admin/v1/tenants/acme", json={"quota": {"requests_per_minute": 5}})
    admin.post("/admin/v1/tenants/acme/disable")
    key = _create_key(admin)
    admin.delete(f"/admin/v1/keys/{key['id']}")

    entries = admin.get("/admin/v1/audit").json()["data"]
    assert [e["action"] for e in entries] == [
        "api_key.revoke",
        "api_key.create",
        "tenant.disable",
        "tenant.update",
        "tenant.create",
    ]
    assert {e["actor"] for e in entries} == {"admin-api:testclient"}
    update = entries[3]
    assert update["target_type"] == "tenant" and update["target_id"] == str(tenant["id"])
    assert update["before"]["quota"]["requests_per_minute"] is None
    assert update["after"]["quota"]["requests_per_minute"] == 5
    revoke = entries[0]
    assert revoke["before"]["revoked_at"] is None and revoke["after"]["revoked_at"]
    assert key["key"] not in admin.get("/admin/v1/audit").text


def test_reads_are_not_audited(admin: TestClient) -> None:
    _create_tenant(admin)
    admin.get("/admin/v1/tenants")
    admin.get("/admin/v1/tenants/acme")
    assert len(admin.get("/admin/v1/audit").json()["data"]) == 1


def test_audit_paging_and_filters(admin: TestClient) -> None:
    ids = [_create_tenant(admin, f"t{i}")["id"] for i in range(4)]
    first = admin.get("/admin/v1/audit", params={"limit": 3}).json()["data"]
    assert len(first) == 3
    rest = admin.get("/admin/v1/audit", params={"before": first[-1]["id"]}).json()["data"]
    assert len(rest) == 1
    only = admin.get(
        "/admin/v1/audit", params={"target_type": "tenant", "target_id": str(ids[0])}
    ).json()["data"]
    assert [e["target_id"] for e in only] == [str(ids[0])]
    for params, param in [
        ({"limit": "0"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"before": "-1"}, "before"),
    ]:
        assert _error(admin.get("/admin/v1/audit", params=params), 400)["param"] == param
    assert (
        _error(admin.get("/admin/v1/tenants", params={"status": "gone"}), 400)["param"] == "status"
    )


def test_no_plaintext_key_in_the_database_after_api_use(
    admin: TestClient, stored_values: Callable[[], list[tuple[str, str, str]]]
) -> None:
    _create_tenant(admin)
    keys = [_create_key(admin)["key"] for _ in range(3)]
    for key in keys:
        assert (
            admin.get("/v1/whoami", headers={"authorization": f"Bearer {key}"}).status_code == 200
        )
    values = stored_values()
    for key in keys:
        assert [(t, c) for t, c, v in values if key in v or key[PREFIX_LENGTH + 1 :] in v] == []


def test_known_tiers_are_configurable(
    harness_factory: Callable[..., GatewayHarness],
) -> None:
    harness = harness_factory(known_tiers=("gold",))
    with TestClient(harness.app, headers=harness.admin_headers) as client:
        assert (
            client.post("/admin/v1/tenants", json={"name": "a", "tier": "gold"}).status_code == 201
        )
        assert _error(client.post("/admin/v1/tenants", json={"name": "b"}), 400)["param"] == "tier"
