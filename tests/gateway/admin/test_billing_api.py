"""The billing admin routes on SQLite and PostgreSQL: the admin token guard, daily usage JSON,
streamed exports (CSV, JSON Lines, detail), OpenAI-shaped errors."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.testclient import TestClient

from billing import (
    DAILY_COLUMNS,
    ExportFormat,
    ExportRequest,
    Period,
    UsageRecord,
    export_lines,
)
from gateway.admin.auth import AdminGuard
from gateway.admin.billing_api import billing_routes
from gateway.http.errors import exception_handlers
from tenants import DatabaseSettings, create_db_engine, create_session_factory
from tests.billing.factories import SeededMonth, bulk_insert, make_record, seed_month
from tests.gateway.conftest import ADMIN_TOKEN

USAGE_KEYS = {
    "date",
    "tenant_id",
    "tenant_name",
    "num_requests",
    "num_prompt_tokens",
    "num_cached_prompt_tokens",
    "num_completion_tokens",
    "gpu_seconds",
    "recompute_gpu_seconds_charged",
    "amount_usd",
}


def _client(session_factory: sessionmaker[Session], admin_token: str | None) -> TestClient:
    app = Starlette(
        routes=billing_routes(session_factory,
                              AdminGuard.for_deployment(admin_token, session_factory)),
        exception_handlers=exception_handlers(),
    )
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture
def admin(session_factory: sessionmaker[Session]) -> Iterator[TestClient]:
    with _client(session_factory, ADMIN_TOKEN) as client:
        client.headers["x-admin-token"] = ADMIN_TOKEN
        yield client


@pytest.fixture
def month(session: Session) -> SeededMonth:
    seeded = seed_month(session)
    session.commit()
    return seeded


def _error(response: httpx2.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# --- admin token ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/admin/v1/billing/usage", "/admin/v1/billing/export"])
def test_routes_need_the_admin_token(session_factory: sessionmaker[Session], path: str) -> None:
    with _client(session_factory, ADMIN_TOKEN) as client:
        assert _error(client.get(path), 401)["code"] == "missing_admin_token"
        wrong = client.get(path, headers={"authorization": "Bearer not-the-admin-token"})
        assert _error(wrong, 401)["code"] == "invalid_admin_token"
        tenant_key = client.get(path, headers={"x-admin-token": "tg-abcdefgh" + "x" * 40})
        assert _error(tenant_key, 403)["code"] == "tenant_key_not_allowed"
        bearer = client.get(
            path + "?period=2026-11&start=2026-11-01&end=2026-11-01",
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        assert bearer.status_code == 200, bearer.text


def test_without_an_admin_token_the_routes_are_disabled(
    session_factory: sessionmaker[Session],
) -> None:
    with _client(session_factory, None) as client:
        response = client.get("/admin/v1/billing/usage", headers={"x-admin-token": ADMIN_TOKEN})
        assert _error(response, 404)["code"] == "admin_api_disabled"


# --- usage ---------------------------------------------------------------------------------------


def test_usage_returns_daily_rows(admin: TestClient, month: SeededMonth) -> None:
    response = admin.get("/admin/v1/billing/usage?start=2026-11-01&end=2026-11-02")
    assert response.status_code == 200, response.text
    rows = response.json()["rows"]
    assert all(set(row) == USAGE_KEYS for row in rows)
    assert [(r["date"], r["tenant_name"], r["num_requests"]) for r in rows] == [
        ("2026-11-01", "acme", 2),
        ("2026-11-01", "globex", 1),
        ("2026-11-02", "globex", 4),  # g2, and g3 folding three refusals
    ]
    assert rows[0]["amount_usd"] == pytest.approx(0.0016)
    assert rows[0]["recompute_gpu_seconds_charged"] == 0.25

    only = admin.get(
        f"/admin/v1/billing/usage?start=2026-11-03&end=2026-11-30&tenant_id={month.globex_id}"
    ).json()["rows"]
    assert [(r["date"], r["num_requests"], r["amount_usd"]) for r in only] == [
        ("2026-11-03", 0, pytest.approx(0.0006))
    ]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("end=2026-11-02", "start"),
        ("start=2026-11-01", "end"),
        ("start=2026-11-31&end=2026-12-01", "start"),
        ("start=2026-11-05&end=2026-11-01", "end"),
        ("start=2024-01-01&end=2026-01-01", "end"),
        ("start=2026-11-01&end=2026-11-02&tenant_id=acme", "tenant_id"),
        ("start=2026-11-01&end=2026-11-02&tenant_id=0", "tenant_id"),
        # isdigit() takes a superscript two, which int() refuses: a 500 before
        ("start=2026-11-01&end=2026-11-02&tenant_id=%C2%B2", "tenant_id"),
        # past the database's INTEGER: an overflow inside the query before
        ("start=2026-11-01&end=2026-11-02&tenant_id=12345678901234567890123", "tenant_id"),
        ("start=2026-11-01&end=2026-11-02&tenant_id=2147483648", "tenant_id"),
    ],
)
def test_bad_usage_queries_are_400(admin: TestClient, query: str, param: str) -> None:
    error = _error(admin.get(f"/admin/v1/billing/usage?{query}"), 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


# --- export --------------------------------------------------------------------------------------


def test_export_daily_csv_download(admin: TestClient, month: SeededMonth, session: Session) -> None:
    response = admin.get("/admin/v1/billing/export?period=2026-11&format=csv")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/csv")
    assert response.headers["content-disposition"] == (
        'attachment; filename="tiergate-usage-2026-11-daily.csv"'
    )
    expected = "".join(export_lines(session, ExportRequest(Period(2026, 11), ExportFormat.CSV)))
    assert response.text == expected
    assert response.text.splitlines()[0] == ",".join(DAILY_COLUMNS)
    assert len(list(csv.DictReader(io.StringIO(response.text)))) == 6


def test_export_detail_jsonl_of_one_tenant(admin: TestClient, month: SeededMonth) -> None:
    response = admin.get(
        f"/admin/v1/billing/export?period=2026-11&format=jsonl&detail=true"
        f"&tenant_id={month.acme_id}"
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    assert f"tenant-{month.acme_id}-records.jsonl" in response.headers["content-disposition"]
    records = [UsageRecord.from_json(json.loads(line)) for line in response.text.splitlines()]
    assert sorted(r.request_id for r in records) == ["a1", "a2", "a3", "g1"]


def test_a_large_export_streams_in_chunks(admin: TestClient, session: Session) -> None:
    records = [make_record(f"big-{i}") for i in range(3000)]
    bulk_insert(session, records)
    session.commit()
    with admin.stream(
        "GET", "/admin/v1/billing/export?period=2026-11&format=csv&detail=1"
    ) as response:
        assert response.status_code == 200
        chunks = list(response.iter_text())
    assert len(chunks) > 1
    lines = "".join(chunks).splitlines()
    assert len(lines) == 1 + 3000
    assert sorted(line.split(",")[0] for line in lines[1:]) == sorted(r.request_id for r in records)


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("format=csv", "period"),
        ("period=2026-13", "period"),
        ("period=2026-11&format=xlsx", "format"),
        ("period=2026-11&detail=maybe", "detail"),
        ("period=2026-11&tenant_id=-1", "tenant_id"),
    ],
)
def test_bad_export_queries_are_400(admin: TestClient, query: str, param: str) -> None:
    assert _error(admin.get(f"/admin/v1/billing/export?{query}"), 400)["param"] == param


def test_a_database_that_is_down_is_503(tmp_path: Path) -> None:
    engine = create_db_engine(DatabaseSettings(url=f"sqlite:///{tmp_path}/missing/x.db"))
    try:
        with _client(create_session_factory(engine), ADMIN_TOKEN) as client:
            client.headers["x-admin-token"] = ADMIN_TOKEN
            for path in (
                "/admin/v1/billing/export?period=2026-11",
                "/admin/v1/billing/usage?start=2026-11-01&end=2026-11-01",
            ):
                assert _error(client.get(path), 503)["code"] == "database_unavailable"
    finally:
        engine.dispose()
