"""Tenant key resolution through a small app (tests/gateway/conftest.py): 401 for missing or
unknown keys, 403 for revoked keys and disabled tenants, the TTL cache and its invalidation,
the OpenAI error shape, and no key in the logs of a served request."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import anyio
import httpx
import httpx2
import pytest
import uvicorn
from sqlalchemy import Engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import Request
from starlette.testclient import TestClient

import tenants
from gateway.access.auth import (
    MAX_STUCK_LOOKUPS,
    InvalidApiKeyError,
    RevokedApiKeyError,
    TenantKeyResolver,
    bearer_token,
)
from gateway.http.errors import ServiceUnavailableError
from tenants import DatabaseSettings, create_db_engine, create_session_factory
from tenants.keys import PREFIX_LENGTH
from tests.manual_clock import ManualClock

if TYPE_CHECKING:
    from tests.gateway.conftest import GatewayHarness


def _tenant_key(session: Session, name: str = "acme") -> tuple[int, str]:
    tenant = tenants.create_tenant(
        session, name=name, tier="premium", actor="test", quota={"requests_per_minute": 60}
    )
    created = tenants.create_api_key(session, tenant, name="ci", actor="test")
    session.commit()
    return created.api_key.id, created.plaintext


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _request(key: str) -> Request:
    """A bare HTTP request presenting key."""
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {key}".encode())]})


def _held_lookups(
    release: threading.Event, wait_s: float
) -> tuple[list[str], Callable[[Session, str], object]]:
    """A stand-in for tenants.find_api_key that records each key looked up, then holds the
    lookup until release is set (wait_s at most) before the real lookup runs."""
    lookups: list[str] = []
    original = tenants.find_api_key

    def find(session: Session, plaintext: str) -> object:
        lookups.append(plaintext)
        release.wait(wait_s)
        return original(session, plaintext)

    return lookups, find


def _assert_error(response: httpx2.Response, status: int, code: str | None) -> None:
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["message"]


@contextmanager
def _count_queries(engine: Engine) -> Iterator[list[str]]:
    statements: list[str] = []

    def record(*args: object) -> None:
        statements.append(str(args[2]))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", record)


def test_valid_key_resolves_to_its_tenant(client: TestClient, session: Session) -> None:
    key_id, key = _tenant_key(session)
    response = client.get("/v1/whoami", headers=_bearer(key))
    assert response.status_code == 200
    assert response.json() == {
        "tenant_id": tenants.find_tenant(session, "acme").id,
        "tenant": "acme",
        "tier": "premium",
        "api_key_id": key_id,
        "requests_per_minute": 60,
        "key_requests_per_minute": None,  # the key has no limit of its own
    }


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        ({"authorization": ""}, "missing_api_key"),
        ({"authorization": "Basic dXNlcjpwYXNz"}, "missing_api_key"),
        ({"authorization": "Bearer "}, "missing_api_key"),
        ({"authorization": "Bearer sk-not-ours"}, "invalid_api_key"),
        ({"authorization": "Bearer tg-zzzzzzzz_" + "x" * 43}, "invalid_api_key"),
    ],
)
def test_missing_or_unknown_key_is_401(
    client: TestClient, session: Session, headers: dict[str, str], code: str
) -> None:
    _tenant_key(session)
    response = client.get("/v1/whoami", headers=headers)
    _assert_error(response, 401, code)
    assert response.json()["error"]["type"] == "authentication_error"


def test_right_prefix_wrong_secret_is_401(client: TestClient, session: Session) -> None:
    _, key = _tenant_key(session)
    forged = key[: PREFIX_LENGTH + 1] + "A" * (len(key) - PREFIX_LENGTH - 1)
    _assert_error(client.get("/v1/whoami", headers=_bearer(forged)), 401, "invalid_api_key")


def test_revoked_key_gets_403_on_its_next_request(
    client: TestClient, session: Session, harness: GatewayHarness
) -> None:
    key_id, key = _tenant_key(session)
    assert client.get("/v1/whoami", headers=_bearer(key)).status_code == 200  # now cached
    revoked = client.post(f"/admin/v1/keys/{key_id}/revoke", headers=harness.admin_headers)
    assert revoked.status_code == 200
    response = client.get("/v1/whoami", headers=_bearer(key))
    _assert_error(response, 403, "api_key_revoked")
    assert response.json()["error"]["type"] == "permission_error"


def test_revocation_elsewhere_takes_effect_within_the_ttl(
    client: TestClient, session: Session, harness: GatewayHarness
) -> None:
    key_id, key = _tenant_key(session)
    assert client.get("/v1/whoami", headers=_bearer(key)).status_code == 200
    # Another replica (or the CLI) revokes: this process only learns when its entry expires.
    tenants.revoke_api_key(session, tenants.get_api_key(session, key_id), actor="elsewhere")
    session.commit()
    harness.clock.advance(harness.resolver.ttl_s - 0.1)
    assert client.get("/v1/whoami", headers=_bearer(key)).status_code == 200
    harness.clock.advance(0.2)
    _assert_error(client.get("/v1/whoami", headers=_bearer(key)), 403, "api_key_revoked")


def test_disabled_tenant_gets_403_until_enabled(
    client: TestClient, session: Session, harness: GatewayHarness
) -> None:
    _, key = _tenant_key(session)
    assert client.get("/v1/whoami", headers=_bearer(key)).status_code == 200
    client.post("/admin/v1/tenants/acme/disable", headers=harness.admin_headers)
    _assert_error(client.get("/v1/whoami", headers=_bearer(key)), 403, "tenant_disabled")
    client.post("/admin/v1/tenants/acme/enable", headers=harness.admin_headers)
    assert client.get("/v1/whoami", headers=_bearer(key)).status_code == 200


def test_quota_change_through_admin_api_is_seen_at_once(
    client: TestClient, session: Session, harness: GatewayHarness
) -> None:
    _, key = _tenant_key(session)
    assert client.get("/v1/whoami", headers=_bearer(key)).json()["requests_per_minute"] == 60
    client.patch(
        "/admin/v1/tenants/acme",
        json={"quota": {"requests_per_minute": 5}},
        headers=harness.admin_headers,
    )
    assert client.get("/v1/whoami", headers=_bearer(key)).json()["requests_per_minute"] == 5


def test_cached_key_costs_no_query_and_marks_last_used_once(
    client: TestClient, session: Session, db: Engine, harness: GatewayHarness
) -> None:
    key_id, key = _tenant_key(session)
    with _count_queries(db) as statements:
        for _ in range(5):
            assert client.get("/v1/whoami", headers=_bearer(key)).status_code == 200
    # One lookup and one last_used_at update, on the first request only.
    assert len([s for s in statements if s.lstrip().upper().startswith("SELECT")]) == 1
    assert len([s for s in statements if s.lstrip().upper().startswith("UPDATE")]) == 1
    session.expire_all()
    assert tenants.get_api_key(session, key_id).last_used_at is not None

    harness.clock.advance(harness.resolver.ttl_s)
    with _count_queries(db) as statements:
        assert client.get("/v1/whoami", headers=_bearer(key)).status_code == 200
    assert statements, "an expired entry is loaded again"


def test_unknown_keys_cost_one_query_a_ttl_and_malformed_ones_none(
    harness: GatewayHarness, db: Engine
) -> None:
    unknown = "Bearer tg-zzzzzzzz_" + "x" * 43
    with _count_queries(db) as statements:
        for _ in range(3):
            with pytest.raises(InvalidApiKeyError):
                harness.resolver.resolve(unknown)
        for malformed in ("Bearer tg-zz", "Bearer sk-" + "x" * 48, "Bearer tg-ZZZZZZZZ_x"):
            with pytest.raises(InvalidApiKeyError):
                harness.resolver.resolve(malformed)
    assert len(statements) == 1
    assert not harness.resolver._entries  # never among the known keys
    harness.clock.advance(harness.resolver.ttl_s)
    with _count_queries(db) as statements, pytest.raises(InvalidApiKeyError):
        harness.resolver.resolve(unknown)
    assert len(statements) == 1  # asked again once its answer is ttl_s old


def test_keys_seen_for_the_first_time_wait_for_a_few_lookups(
    session_factory: sessionmaker[Session],
) -> None:
    """A flood of random well-formed keys holds first_sight_lookups database lookups; past
    first_sight_waiting requests waiting, the rest get 503 without touching the database."""
    resolver = TenantKeyResolver(session_factory, first_sight_lookups=1, first_sight_waiting=3)
    release = threading.Event()
    lookups, slow_find = _held_lookups(release, 10)

    async def flood() -> list[int]:
        statuses: list[int] = []

        async def one(index: int) -> None:
            try:
                await resolver.authenticate(_request(f"tg-{index:08d}_" + "x" * 43))
            except (InvalidApiKeyError, ServiceUnavailableError) as exc:
                statuses.append(exc.status_code)

        async with anyio.create_task_group() as group:
            for index in range(10):
                group.start_soon(one, index)
            await anyio.sleep(0.5)
            assert len(lookups) == 1  # one at a time
            release.set()
        return statuses

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("gateway.access.auth.find_api_key", slow_find)
        statuses = anyio.run(flood)
    assert sorted(statuses) == [401] * 3 + [503] * 7
    assert len(lookups) == 3
    resolver.close()


def test_invalidate_during_a_load_keeps_the_stale_result_out(
    session: Session, session_factory: sessionmaker[Session]
) -> None:
    key_id, key = _tenant_key(session)
    resolver = TenantKeyResolver(session_factory)
    # A revoke that lands while a lookup is in flight: the lookup must not refill the cache.
    loaded = threading.Event()
    original = tenants.find_api_key

    def slow_find(*args: object, **kwargs: object) -> object:
        found = original(*args, **kwargs)  # type: ignore[arg-type]
        resolver.invalidate(api_key_id=key_id)
        loaded.set()
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("gateway.access.auth.find_api_key", slow_find)
        resolver.resolve(f"Bearer {key}")
    assert loaded.is_set()
    tenants.revoke_api_key(session, tenants.get_api_key(session, key_id), actor="test")
    session.commit()
    with pytest.raises(RevokedApiKeyError):
        resolver.resolve(f"Bearer {key}")


def test_database_outage_is_503_not_500(session_factory: sessionmaker[Session]) -> None:
    unreachable = create_db_engine(
        DatabaseSettings(url="postgresql+psycopg://postgres@127.0.0.1:1/test?connect_timeout=2"),
        pooled=False,
    )
    resolver = TenantKeyResolver(create_session_factory(unreachable))
    with pytest.raises(ServiceUnavailableError) as caught:
        resolver.resolve("Bearer tg-abcdefgh_" + "x" * 43)
    assert caught.value.to_response().status_code == 503
    unreachable.dispose()


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Token abc") is None
    assert bearer_token(None) is None


def test_unknown_route_and_crash_keep_the_openai_shape(client: TestClient) -> None:
    missing = client.get("/nowhere")
    _assert_error(missing, 404, None)
    assert missing.json()["error"]["type"] == "not_found_error"
    crash = client.get("/boom")
    _assert_error(crash, 500, None)
    assert crash.json()["error"]["type"] == "server_error"
    assert "internal detail" not in crash.text


def test_no_key_in_the_logs_of_served_requests(
    harness: GatewayHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """A real uvicorn server, every logger at DEBUG (SQL statements and their parameters too)."""
    admin_token = harness.admin_headers["x-admin-token"]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        harness.app, log_config=None, log_level="debug", lifespan="off", ws="none"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    caplog.set_level(logging.DEBUG)
    # SQLAlchemy pins its own logger to WARNING; INFO logs every statement and its parameters.
    caplog.set_level(logging.INFO, logger="sqlalchemy.engine")
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=10) as http:
            for _ in range(100):
                if server.started:
                    break
                threading.Event().wait(0.05)
            created = http.post(
                "/admin/v1/tenants", json={"name": "acme"}, headers=harness.admin_headers
            )
            assert created.status_code == 201
            key_response = http.post(
                "/admin/v1/tenants/acme/keys", json={}, headers=harness.admin_headers
            )
            key = key_response.json()["key"]
            assert http.get("/v1/whoami", headers=_bearer(key)).status_code == 200
            http.post(
                f"/admin/v1/keys/{key_response.json()['id']}/revoke",
                headers=harness.admin_headers,
            )
            assert http.get("/v1/whoami", headers=_bearer(key)).status_code == 403
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
    logged = caplog.text
    assert "SELECT" in logged and '"GET /v1/whoami HTTP/1.1" 200' in logged  # logs were on
    assert key[:PREFIX_LENGTH] in logged  # the public prefix is a query parameter
    assert key not in logged
    assert key[PREFIX_LENGTH + 1 :] not in logged
    assert admin_token not in logged


def _database_down(*_args: object, **_kwargs: object) -> None:
    raise OperationalError("SELECT", {}, ConnectionRefusedError("connection refused"))


def _resolver_on_a_clock(
    session_factory: sessionmaker[Session],
) -> tuple[ManualClock, TenantKeyResolver]:
    """A resolver (TTL 5 s, answers kept 60 s through an outage) on a clock the test sets,
    starting at 0."""
    clock = ManualClock(0.0)
    resolver = TenantKeyResolver(session_factory, ttl_s=5.0, max_stale_s=60.0, clock=clock)
    return clock, resolver


def test_a_known_key_keeps_its_answer_through_a_database_outage(
    session: Session, session_factory: sessionmaker[Session]
) -> None:
    _, key = _tenant_key(session)
    clock, resolver = _resolver_on_a_clock(session_factory)
    principal = resolver.resolve(f"Bearer {key}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("gateway.access.auth.find_api_key", _database_down)
        clock.now_s = 6.0
        assert resolver.resolve(f"Bearer {key}") == principal
        clock.now_s = 61.0
        with pytest.raises(ServiceUnavailableError):
            resolver.resolve(f"Bearer {key}")
        with pytest.raises(ServiceUnavailableError):
            resolver.resolve("Bearer tg-abcdefgh_" + "x" * 43)
    assert resolver.resolve(f"Bearer {key}") == principal


def test_last_used_that_cannot_be_written_does_not_fail_authentication(
    session: Session, session_factory: sessionmaker[Session]
) -> None:
    _, key = _tenant_key(session)
    resolver = TenantKeyResolver(session_factory)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("gateway.access.auth.mark_api_key_used", _database_down)
        assert resolver.resolve(f"Bearer {key}").tenant_name == "acme"


def test_a_key_in_use_is_reloaded_in_the_background_before_it_expires(
    session: Session, session_factory: sessionmaker[Session]
) -> None:
    key_id, key = _tenant_key(session)
    clock, resolver = _resolver_on_a_clock(session_factory)
    principal = resolver.resolve(f"Bearer {key}")
    tenants.revoke_api_key(session, tenants.get_api_key(session, key_id), actor="elsewhere")
    session.commit()
    started, release = threading.Event(), threading.Event()
    lookups: list[float] = []
    original = tenants.find_api_key

    def held_find(*args: object, **kwargs: object) -> object:
        lookups.append(clock.now_s)
        started.set()
        assert release.wait(10), "the test never released the lookup"
        return original(*args, **kwargs)  # type: ignore[arg-type]

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("gateway.access.auth.find_api_key", held_find)
            clock.now_s = 3.9  # before the last fifth of the entry's life: no reload
            assert resolver.resolve(f"Bearer {key}") == principal
            resolver.wait_for_refreshes()
            assert lookups == []
            clock.now_s = 4.5  # in it: answered from the entry, the reload runs in the background
            assert resolver.resolve(f"Bearer {key}") == principal
            assert started.wait(10)
            assert not release.is_set()  # the request above did not wait for the database
            assert resolver.resolve(f"Bearer {key}") == principal  # one reload at a time
            release.set()
            resolver.wait_for_refreshes(timeout_s=10)
        assert lookups == [4.5]
        # The reload's answer is used before the old entry would have expired.
        with pytest.raises(RevokedApiKeyError):
            resolver.resolve(f"Bearer {key}")
    finally:
        release.set()
        resolver.close()


def test_a_background_reload_during_an_outage_keeps_the_entry(
    session: Session, session_factory: sessionmaker[Session]
) -> None:
    _, key = _tenant_key(session)
    clock, resolver = _resolver_on_a_clock(session_factory)
    try:
        principal = resolver.resolve(f"Bearer {key}")
        tries: list[float] = []

        def database_down(*args: object, **kwargs: object) -> None:
            tries.append(clock.now_s)
            _database_down(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("gateway.access.auth.find_api_key", database_down)
            # Each request near its entry's end tries the database in the background; the
            # failed try keeps the entry and gives it another ttl_s (up to max_stale_s).
            for at_s in (4.5, 9.0, 13.6):
                clock.now_s = at_s
                assert resolver.resolve(f"Bearer {key}") == principal
                resolver.wait_for_refreshes(timeout_s=10)
            assert tries == [4.5, 9.0, 13.6]  # each before its entry expired: in the background
            clock.now_s = 61.0  # past max_stale_s since the last answer: the outage shows
            with pytest.raises(ServiceUnavailableError):
                resolver.resolve(f"Bearer {key}")
    finally:
        resolver.close()


def test_a_database_that_never_answers_is_waited_for_at_most_the_lookup_timeout(
    session: Session, session_factory: sessionmaker[Session]
) -> None:
    """Lookups that hang (a SIGSTOPped or partitioned database: no error, no answer): a
    request waits lookup_timeout_s, then a known key keeps its last answer and an unseen one
    gets 503; past MAX_STUCK_LOOKUPS hung lookups no new one starts."""
    _, key = _tenant_key(session)
    clock = ManualClock(0.0)
    resolver = TenantKeyResolver(session_factory, ttl_s=5.0, clock=clock,
                                 lookup_timeout_s=0.2)
    principal = resolver.resolve(f"Bearer {key}")
    release = threading.Event()
    lookups, hung_find = _held_lookups(release, 30)

    async def scenario() -> list[float]:
        waits = []
        for _ in range(6):  # the known key: its answer from before, after the timeout
            started = time.monotonic()
            assert (await resolver.authenticate(_request(key))) == principal
            waits.append(time.monotonic() - started)
            clock.advance(5.0)  # expired again: the next request looks it up
        started = time.monotonic()
        with pytest.raises(ServiceUnavailableError):
            await resolver.authenticate(_request("tg-abcdefgh_" + "x" * 43))
        waits.append(time.monotonic() - started)
        return waits

    clock.now_s = 6.0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("gateway.access.auth.find_api_key", hung_find)
        try:
            waits = anyio.run(scenario)
            assert len(lookups) == MAX_STUCK_LOOKUPS  # the rest did not start a lookup
        finally:
            release.set()
            deadline_s = time.monotonic() + 30
            while resolver.num_lookups_stuck:  # they end, closing their connections
                assert time.monotonic() < deadline_s, "the hung lookups did not end"
                time.sleep(0.01)
    assert all(w < 0.2 + 0.5 for w in waits[:MAX_STUCK_LOOKUPS]), waits
    assert all(w < 0.2 for w in waits[MAX_STUCK_LOOKUPS:]), waits  # no lookup waited for
    resolver.close()
