"""The admin console in headless Chromium against a real uvicorn server.

Console flows (sign-in, tenants, quotas, keys, audit, inline errors, keyboard, sorting, the
usage and live views, LoRA adapters) run against an app composed here: the real admin API
and console routes on a scratch SQLite database migrated with the real migrations, plus
/v1/whoami, which authenticates a tenant key exactly as the OpenAI routes do.
ContractEndpoints stands in for the live and billing endpoints, answering with the shapes the
lead fixed, so the charts and the SLO colouring are checked on known figures. The adapter
flows get the real adapter registry, checking uploads against a tiny random llama checkpoint
(ServedStandIn: the served model's name and config, no engine).
"""

from __future__ import annotations

import csv
import io
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect
from playwright.sync_api import Response as PlaywrightResponse
from sqlalchemy import Engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

import migrations
from engine import ModelConfig
from gateway.access.auth import TenantKeyResolver
from gateway.adapters import AdapterRegistry, AdapterStore, ModelTarget
from gateway.admin.api import admin_routes
from gateway.admin.auth import AdminGuard
from gateway.admin.console_routes import console_routes
from gateway.http.errors import exception_handlers
from tenants import (
    Batch,
    BatchLine,
    DatabaseSettings,
    StoredFile,
    create_admin_credential,
    create_db_engine,
    create_session_factory,
)
from tests.adapter_archive import adapter_tar_gz as tar_gz
from tests.e2e.conftest import ADMIN_TOKEN, ConsolePage, console_page, serve_in_thread
from tests.tenants.conftest import scratch_database

if TYPE_CHECKING:
    from gateway.server.served_model import ServedModel

ADMIN_HEADERS = {"x-admin-token": ADMIN_TOKEN}
SERVED_NAME = "tiny-llama"
ADAPTER_RANK = 4
# How long DELETE waits for an adapter's running requests before answering 202.
UNREGISTER_TIMEOUT_S = 0.5


class ContractEndpoints:
    """Test tool: /admin/v1/live, /billing/usage and /billing/export with the contract's
    shapes and fixed figures; each live call adds one running premium request."""

    def __init__(self) -> None:
        self.num_live_calls = 0
        self.export_queries: list[dict[str, str]] = []

    def routes(self) -> list[BaseRoute]:
        guard = AdminGuard(ADMIN_TOKEN)
        return [
            guard.route("/admin/v1/live", self.live, "GET"),
            guard.route("/admin/v1/billing/usage", self.usage, "GET"),
            guard.route("/admin/v1/billing/export", self.export, "GET"),
        ]

    async def live(self, _request: Request) -> Response:
        self.num_live_calls += 1
        tier = {"num_waiting": 0, "kv_blocks_reserved": 0, "estimated_wait_s": 0.0}
        return JSONResponse(
            {
                "time": datetime.now(UTC).timestamp(),
                "kv_blocks_total": 1000,
                "kv_blocks_used": 640,
                "prefix_cache_hit_ratio": 0.25,
                "models": [
                    {"model": "small", "num_running": 2, "num_waiting": 7,
                     "kv_blocks_total": 600, "kv_blocks_used": 500, "mean_step_time_s": 0.045},
                    {"model": "large", "num_running": 1, "num_waiting": 0,
                     "kv_blocks_total": 400, "kv_blocks_used": 140, "mean_step_time_s": None},
                ],
                "tiers": [
                    {
                        **tier,
                        "tier": "premium",
                        "priority": 0,
                        "num_running": self.num_live_calls,
                        "kv_blocks": 400,
                        "kv_blocks_reserved": 300,
                        "ttft_p99_s": 0.62,
                        "ttft_slo_s": 0.5,
                        "alert_threshold_s": 0.4,
                    },
                    {
                        **tier,
                        "tier": "standard",
                        "priority": 1,
                        "num_running": 3,
                        "num_waiting": 7,
                        "kv_blocks": 240,
                        "ttft_p99_s": 0.8,
                        "ttft_slo_s": 2.0,
                        "alert_threshold_s": 1.6,
                        "estimated_wait_s": 1.5,
                    },
                    {
                        **tier,
                        "tier": "batch",
                        "priority": 2,
                        "num_running": 0,
                        "kv_blocks": 0,
                        "ttft_p99_s": None,
                        "ttft_slo_s": None,
                        "alert_threshold_s": None,
                    },
                ],
                "alerts": [
                    {
                        "name": "StandardQueueDeep",
                        "tier": "standard",
                        "state": "inactive",
                        "since": None,
                        "value": 7.0,
                        "threshold": 50.0,
                    },
                    {
                        "name": "PremiumTTFTHigh",
                        "tier": "premium",
                        "state": "firing",
                        "since": datetime.now(UTC).timestamp() - 120,
                        "value": 0.62,
                        "threshold": 0.4,
                    },
                ],
            }
        )

    async def usage(self, request: Request) -> Response:
        start = datetime.fromisoformat(request.query_params["start"]).date()
        rows = []
        for offset, (tenant_id, name, tokens) in enumerate(
            [(1, "alpha", 1000), (2, "beta", 300), (1, "alpha", 500)]
        ):
            rows.append(
                {
                    "date": (start + timedelta(days=offset // 2)).isoformat(),
                    "tenant_id": tenant_id,
                    "tenant_name": name,
                    "num_requests": 2,
                    "num_prompt_tokens": tokens,
                    "num_cached_prompt_tokens": 16,
                    "num_completion_tokens": 10,
                    "gpu_seconds": tokens / 1000,
                    "recompute_gpu_seconds_charged": 0.0,
                    "amount_usd": tokens / 100_000,
                }
            )
        return JSONResponse({"rows": rows})

    async def export(self, request: Request) -> Response:
        self.export_queries.append(dict(request.query_params))
        period = request.query_params["period"]
        body = f"period,tenant_id,amount_usd\n{period},1,0.015\n"
        return Response(
            body,
            media_type="text/csv",
            headers={"content-disposition": f'attachment; filename="usage-{period}.csv"'},
        )


@dataclass(frozen=True)
class ServedStandIn:
    """What the adapter routes read of the served model: its name and its checkpoint's config."""

    name: str
    model_config: ModelConfig


@dataclass
class ConsoleServer:
    """The composed app, served; tenant keys are checked on /v1/whoami."""

    base_url: str
    # The adapter registry the admin API uses, when the app has one.
    adapters: AdapterRegistry | None = None

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=ADMIN_HEADERS, timeout=10)

    def whoami(self, key: str) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"}
        return httpx.get(f"{self.base_url}/v1/whoami", headers=headers, timeout=10)


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Engine]:
    with scratch_database("sqlite", tmp_path) as url:
        migrations.upgrade_head(url)
        engine = create_db_engine(DatabaseSettings(url=url))
        yield engine
        engine.dispose()


def _serve(
    database: Engine,
    contract: ContractEndpoints | None,
    adapters_dir: Path | None = None,
    served: ServedStandIn | None = None,
) -> Iterator[ConsoleServer]:
    session_factory = create_session_factory(database)
    adapters = None
    if adapters_dir is not None:
        adapters = AdapterRegistry(
            session_factory,
            AdapterStore(adapters_dir),
            max_rank=64,
            max_bytes=64 << 20,
            max_pinned=4,
            cache_ttl_s=0.05,
        )
    resolver = TenantKeyResolver(session_factory)

    async def whoami(request: Request) -> Response:
        principal = await resolver.authenticate(request)
        return JSONResponse({"tenant": principal.tenant_name, "tier": principal.tier})

    routes: list[BaseRoute] = [
        *console_routes(),
        *(contract.routes() if contract else []),
        *admin_routes(
            session_factory=session_factory,
            admin_token=ADMIN_TOKEN,
            key_resolver=resolver,
            adapters=adapters,
            served_models=lambda: {SERVED_NAME: cast("ServedModel | None", served)},
            unregister_timeout_s=UNREGISTER_TIMEOUT_S,
        ),
        Route("/v1/whoami", whoami),
    ]
    app = Starlette(routes=routes, exception_handlers=exception_handlers())
    with serve_in_thread(app) as base_url:
        yield ConsoleServer(base_url, adapters)


@pytest.fixture
def server(database: Engine) -> Iterator[ConsoleServer]:
    """Admin API and console only: no live or billing endpoints."""
    yield from _serve(database, None)


@pytest.fixture
def contract() -> ContractEndpoints:
    return ContractEndpoints()


@pytest.fixture
def contract_server(database: Engine, contract: ContractEndpoints) -> Iterator[ConsoleServer]:
    """The same app with the live and billing endpoints of ContractEndpoints."""
    yield from _serve(database, contract)


@dataclass(frozen=True)
class TinyLlama:
    """A tiny random llama checkpoint's config and archives of adapters for it."""

    config: ModelConfig
    # A PEFT adapter of rank ADAPTER_RANK on q_proj and v_proj, as a tar.gz.
    adapter_tar_gz: bytes
    # The same adapter's files plus one a PEFT adapter never has.
    stray_tar_gz: bytes


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyLlama:
    # Imported here: torch, transformers and peft load only for the adapter tests.
    from tests.engine.models.helpers import make_checkpoint
    from tests.engine.models.lora_adapters import make_adapter

    root = tmp_path_factory.mktemp("tiny-llama")
    make_checkpoint(root / "model", "llama")
    make_adapter(
        root / "model", root / "adapter", ADAPTER_RANK, seed=0, targets=("q_proj", "v_proj")
    )
    return TinyLlama(
        config=ModelConfig.from_file(root / "model"),
        adapter_tar_gz=tar_gz(root / "adapter"),
        stray_tar_gz=tar_gz(root / "adapter", {"notes.txt": b"not part of an adapter"}),
    )


@pytest.fixture
def adapter_server(
    database: Engine, tiny_llama: TinyLlama, tmp_path: Path
) -> Iterator[ConsoleServer]:
    """Admin API and console with the adapter registry, serving the tiny llama."""
    served = ServedStandIn(SERVED_NAME, tiny_llama.config)
    yield from _serve(database, None, adapters_dir=tmp_path / "adapters", served=served)


@pytest.fixture
def console(browser: Browser, server: ConsoleServer, artifacts_dir: Path) -> Iterator[ConsolePage]:
    with console_page(browser, server.base_url, artifacts_dir) as page:
        yield page


def _admin_requests(page: Page) -> list[tuple[str, int]]:
    """Records (url, status) of every admin API answer the page receives."""
    seen: list[tuple[str, int]] = []

    def record(response: PlaywrightResponse) -> None:
        if "/admin/v1/" in response.url:
            seen.append((response.url, response.status))

    page.on("response", record)
    return seen


def _create_tenants(server: ConsoleServer, *specs: dict[str, Any]) -> None:
    with server.admin() as admin:
        for spec in specs:
            assert admin.post("/admin/v1/tenants", json=spec).status_code == 201


# --- sign-in -----------------------------------------------------------------------------------


def test_a_wrong_admin_token_shows_an_error_and_reaches_no_data(
    console: ConsolePage, server: ConsoleServer
) -> None:
    _create_tenants(server, {"name": "hidden-tenant", "tier": "premium"})
    answers = _admin_requests(console.page)
    console.open("#tenants")
    console.sign_in("not-the-admin-token-000000")
    alert = console.page.locator("#signin-error")
    expect(alert).to_have_text("invalid admin token (invalid_admin_token)")
    expect(console.page.get_by_label("Admin token")).to_be_focused()
    expect(console.page.get_by_role("navigation", name="Views")).to_be_hidden()
    expect(console.page.locator("#view-tenants")).to_be_hidden()
    console.screenshot("signin-wrong-token")
    assert "hidden-tenant" not in console.page.content()
    assert console.page.evaluate("sessionStorage.length") == 0
    assert answers and all(status == 401 for _url, status in answers), answers


def test_sign_in_keeps_the_token_in_session_storage_and_sign_out_drops_everything(
    console: ConsolePage, server: ConsoleServer
) -> None:
    _create_tenants(server, {"name": "visible-tenant"})
    console.open()
    console.sign_in()
    expect(console.page.get_by_role("heading", name="Tenants", level=2)).to_be_focused()
    expect(console.page.locator("#tenants-table")).to_contain_text("visible-tenant")
    assert console.page.evaluate("sessionStorage.getItem('tiergate.adminToken')") == ADMIN_TOKEN
    assert console.page.context.cookies() == []
    console.page.get_by_role("button", name="Sign out").click()
    expect(console.page.get_by_label("Admin token")).to_be_visible()
    assert "visible-tenant" not in console.page.content()
    assert console.page.evaluate("sessionStorage.length") == 0


def test_a_token_refused_later_signs_the_page_out(
    console: ConsolePage, server: ConsoleServer
) -> None:
    _create_tenants(server, {"name": "visible-tenant"})
    console.open()
    console.sign_in()
    expect(console.page.locator("#tenants-table")).to_contain_text("visible-tenant")
    # As if the server's token had been rotated since sign-in.
    console.page.evaluate("sessionStorage.setItem('tiergate.adminToken', 'rotated-away-0000000')")
    console.go("Audit log")
    expect(console.page.locator("#signin-error")).to_have_text("Signed out: invalid admin token")
    expect(console.page.get_by_role("navigation", name="Views")).to_be_hidden()
    assert "visible-tenant" not in console.page.content()
    assert console.page.evaluate("sessionStorage.getItem('tiergate.adminToken')") is None


# --- tenants, quotas, keys, audit --------------------------------------------------------------


def test_create_tenant_set_rpm_issue_key_once_and_revoke(
    console: ConsolePage, server: ConsoleServer
) -> None:
    page = console.page
    console.open()
    console.sign_in()
    page.get_by_label("Name", exact=True).fill("acme")
    page.get_by_label("Tier", exact=True).select_option("premium")
    page.get_by_role("button", name="Create tenant").click()
    expect(page.get_by_role("heading", name="Tenant acme")).to_be_focused()

    page.get_by_label("Requests per minute").fill("120")
    page.get_by_label("Monthly spend budget (USD)").fill("25")
    expect(page.get_by_label("Allowed models")).to_have_value("")  # every model
    page.get_by_label("Allowed models").fill("tiny-llama, other-model")
    page.get_by_role("button", name="Save changes").click()
    expect(page.locator("#tenant-status")).to_have_text("Saved.")
    with server.admin() as admin:
        shown = admin.get("/admin/v1/tenants/acme").json()
    quota = shown["quota"]
    assert quota["requests_per_minute"] == 120
    assert quota["monthly_spend_budget_usd_micros"] == 25_000_000
    assert shown["allowed_models"] == ["tiny-llama", "other-model"]
    expect(page.get_by_label("Allowed models")).to_have_value("tiny-llama, other-model")
    page.get_by_label("Allowed models").fill("")
    page.get_by_role("button", name="Save changes").click()
    expect(page.locator("#tenant-status")).to_have_text("Saved.")
    with server.admin() as admin:
        assert admin.get("/admin/v1/tenants/acme").json()["allowed_models"] is None

    page.get_by_label("Key name").fill("ci")
    page.get_by_role("button", name="Issue key").click()
    key_field = page.get_by_label("API key", exact=True)
    expect(key_field).to_be_focused()
    key = key_field.input_value()
    assert key.startswith("tg-")
    page.get_by_role("button", name="Copy", exact=True).click()
    expect(page.locator("#new-key")).to_contain_text("Copied.")
    assert page.evaluate("navigator.clipboard.readText()") == key
    console.screenshot("tenant-key-issued")
    assert server.whoami(key).json() == {"tenant": "acme", "tier": "premium"}

    key_row = page.locator("#keys-table tbody tr")
    expect(key_row).to_have_count(1)
    prefix = key_row.get_attribute("data-prefix")
    assert prefix and key.startswith(prefix) and len(prefix) < len(key)
    page.get_by_role("button", name="Done").click()
    assert key not in page.content()
    page.reload()  # shown once: not after a reload either, while the session stays signed in
    expect(page.get_by_role("heading", name="Tenant acme")).to_be_visible()
    expect(key_row).to_have_count(1)
    assert key not in page.content()

    page.get_by_label("Filter by prefix").fill("tg-nope")
    expect(page.locator("#keys-table tbody")).to_have_text("No key starts with that prefix.")
    page.get_by_label("Filter by prefix").fill(prefix)
    page.get_by_role("button", name=f"Revoke key {prefix}").click()
    page.get_by_role("button", name=f"Confirm: revoke key {prefix}").click()
    expect(key_row).to_contain_text("revoked")
    assert server.whoami(key).status_code == 403

    console.go("Tenants")
    row = page.locator("#tenants-table tbody tr[data-tenant=acme]")
    expect(row).to_contain_text("premium")
    expect(row.locator("td").nth(3)).to_have_text("120")  # Name is th; Requests/min is 4th td
    console.screenshot("tenants")

    console.go("Audit log")
    audit = page.locator("#audit-table tbody tr")
    expect(audit).to_have_count(5)
    actions = [audit.nth(i).get_attribute("data-action") for i in range(5)]
    assert actions == ["api_key.revoke", "api_key.create", "tenant.update", "tenant.update",
                       "tenant.create"]
    expect(page.locator("#audit-table tr[data-action='tenant.update']").last).to_contain_text(
        "quota.requests_per_minute: ∅ → 120"
    )
    console.screenshot("audit")


def test_rotate_a_key_keeps_the_old_secret_for_its_grace(
    console: ConsolePage, server: ConsoleServer
) -> None:
    _create_tenants(server, {"name": "rotating"})
    with server.admin() as admin:
        old = admin.post("/admin/v1/tenants/rotating/keys", json={
            "name": "ci", "requests_per_minute": 5, "monthly_spend_budget_usd_micros": 20_000_000,
        }).json()
    console.open("#tenant/rotating")
    console.sign_in()
    page = console.page
    page.get_by_role("button", name=f"Rotate key {old['prefix']}").click()
    grace = page.get_by_label("Old secret works for (s)")
    expect(grace).to_be_focused()
    grace.fill("600")
    page.get_by_role("button", name=f"Confirm: rotate key {old['prefix']}").click()
    key_field = page.get_by_label("API key", exact=True)
    expect(key_field).to_be_focused()
    new = key_field.input_value()
    assert new.startswith("tg-") and new != old["key"]
    row = page.locator("#keys-table tbody tr")
    expect(row).to_have_count(1)
    expect(row).to_have_attribute("data-prefix", new[:len(old["prefix"])])
    expect(row).to_contain_text("old secret until")
    expect(row).to_contain_text("limits: 5 RPM, $20.00/month")  # the key's own, kept
    assert server.whoami(new).json()["tenant"] == "rotating"
    assert server.whoami(old["key"]).json()["tenant"] == "rotating"  # its grace
    with server.admin() as admin:
        shown = admin.get(f"/admin/v1/keys/{old['id']}").json()
    assert shown["id"] == old["id"] and shown["previous_expires_at"] is not None


def test_disable_and_enable_a_tenant(console: ConsolePage, server: ConsoleServer) -> None:
    _create_tenants(server, {"name": "pausable"})
    with server.admin() as admin:
        key = admin.post("/admin/v1/tenants/pausable/keys", json={}).json()["key"]
    console.open("#tenant/pausable")
    console.sign_in()
    page = console.page
    page.get_by_role("button", name="Disable tenant").click()
    expect(page.locator("#tenant-status")).to_have_text("Tenant disabled.")
    expect(page.locator(".summary")).to_contain_text("disabled")
    assert server.whoami(key).status_code == 403
    page.get_by_role("button", name="Enable tenant").click()
    expect(page.locator("#tenant-status")).to_have_text("Tenant enabled.")
    assert server.whoami(key).status_code == 200


def test_a_tenants_batches_and_files_are_listed(
    console: ConsolePage, server: ConsoleServer, database: Engine
) -> None:
    _create_tenants(server, {"name": "nightly"})
    with server.admin() as admin:
        created = admin.get("/admin/v1/tenants/nightly").json()
    now = datetime.now(UTC)
    with create_session_factory(database).begin() as session:
        session.add(StoredFile(id="file-" + "a" * 24, tenant_id=created["id"],
                               filename="requests.jsonl", purpose="batch", bytes=2048,
                               num_lines=2, created_at=now))
        session.add(Batch(id="batch_" + "b" * 32, tenant_id=created["id"], api_key_id=None,
                          endpoint="/v1/chat/completions", input_file_id="file-" + "a" * 24,
                          completion_window="24h", status="in_progress", total=2,
                          created_at=now, in_progress_at=now, expires_at=now + timedelta(1)))
        session.flush()
        session.add_all([
            BatchLine(batch_id="batch_" + "b" * 32, line_index=i, custom_id=f"c{i}", body={},
                      prefix_key="", status="done" if i == 0 else "pending", attempts=0,
                      is_error=False, result={"id": "x"} if i == 0 else None)
            for i in range(2)])
    console.open("#tenant/nightly")
    console.sign_in()
    page = console.page
    batches = page.locator("#batches-table")
    expect(batches).to_contain_text("batch_" + "b" * 32)
    expect(batches).to_contain_text("in_progress")
    expect(batches).to_contain_text("1 / 2")
    expect(page.locator("#files-table")).to_contain_text("requests.jsonl")
    console.screenshot("tenant-batches")


def _mint_credential(database: Engine, name: str, role: str) -> str:
    with create_session_factory(database).begin() as session:
        return create_admin_credential(session, name=name, role=role, actor="test").plaintext


def test_a_read_only_credential_sees_the_data_and_no_change_control(
    console: ConsolePage, server: ConsoleServer, database: Engine
) -> None:
    _create_tenants(server, {"name": "acme"})
    with server.admin() as admin:
        admin.post("/admin/v1/tenants/acme/keys", json={"name": "ci"})
    answers = _admin_requests(console.page)
    console.open("#tenants")
    console.sign_in(_mint_credential(database, "auditor", "read-only"))
    page = console.page
    expect(page.locator("#whoami")).to_have_text("auditor (read-only)")
    expect(page.locator("#tenants-table")).to_contain_text("acme")
    expect(page.locator("#create-tenant-form")).to_be_hidden()

    console.open("#tenant/acme")  # a reload: the role is asked for again before the view
    expect(page.locator("#keys-table")).to_contain_text("ci")
    expect(page.get_by_label("Fair-share weight")).to_be_disabled()
    for control in ("#edit-tenant-form button[type=submit]", "#status-toggle",
                    "#issue-key-form", "#keys-table button"):
        expect(page.locator(control).first).to_be_attached()  # in the page, not shown
        expect(page.locator(control).first).to_be_hidden()
    expect(page.get_by_role("button", name=re.compile("Save|Disable|Issue|Rotate|Revoke"))
           ).to_have_count(0)
    console.go("Adapters")
    expect(page.locator("#register-adapter-form")).to_be_hidden()
    console.go("Usage")
    expect(page.locator("#export-form")).to_be_hidden()
    console.screenshot("read-only-credential")
    assert all(status != 403 for _url, status in answers), answers

    console.page.get_by_role("button", name="Sign out").click()
    console.sign_in(_mint_credential(database, "ops", "operator"))
    expect(page.locator("#whoami")).to_have_text("ops (operator)")
    expect(page.locator("#create-tenant-form")).to_be_visible()
    console.go("Usage")
    expect(page.locator("#export-form")).to_be_hidden()  # exports are billing's


def test_admin_api_errors_are_shown_inline_on_the_field_they_name(
    console: ConsolePage, server: ConsoleServer
) -> None:
    _create_tenants(server, {"name": "taken"})
    page = console.page
    console.open()
    console.sign_in()
    name = page.get_by_label("Name", exact=True)
    name.fill("Not A Name")
    page.get_by_role("button", name="Create tenant").click()
    expect(page.locator("#create-tenant-error")).to_contain_text("name must be 1-64 characters")
    expect(name).to_have_attribute("aria-invalid", "true")
    expect(name).to_be_focused()
    name.fill("taken")
    page.get_by_role("button", name="Create tenant").click()
    expect(page.locator("#create-tenant-error")).to_contain_text("(conflict)")

    console.open("#tenant/taken")
    share = page.get_by_label("KV cache cap (share of blocks, 0–1]")
    share.fill("5")
    page.get_by_role("button", name="Save changes").click()
    expect(page.locator("#edit-error")).to_contain_text("kv_cap_share must be in (0, 1]")
    expect(share).to_have_attribute("aria-invalid", "true")
    expect(share).to_be_focused()
    console.screenshot("tenant-inline-error")
    console.open("#tenant/nobody")
    expect(page.locator("#tenant-error")).to_contain_text("(not_found)")


def test_the_console_works_from_the_keyboard(console: ConsolePage, server: ConsoleServer) -> None:
    _create_tenants(
        server,
        {"name": "slow", "quota": {"requests_per_minute": 10}},
        {"name": "open"},
        {"name": "fast", "quota": {"requests_per_minute": 50}},
    )
    page = console.page
    console.open()
    expect(page.get_by_label("Admin token")).to_be_focused()
    page.keyboard.type(ADMIN_TOKEN)
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", name="Tenants", level=2)).to_be_focused()

    rpm_header = page.locator("#tenants-table th[data-key=rpm]")
    _tab_to(page, "#tenants-table th[data-key=rpm] button")
    page.keyboard.press("Enter")
    expect(rpm_header).to_have_attribute("aria-sort", "ascending")
    assert _tenant_rows(page) == ["slow", "fast", "open"]  # unlimited sorts above any number
    expect(rpm_header.get_by_role("button")).to_be_focused()
    page.keyboard.press("Enter")
    expect(rpm_header).to_have_attribute("aria-sort", "descending")
    assert _tenant_rows(page) == ["open", "fast", "slow"]

    _tab_to(page, "#create-name")
    page.keyboard.type("typed")
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", name="Tenant typed")).to_be_focused()


def _tenant_rows(page: Page) -> list[str]:
    rows = page.locator("#tenants-table tbody tr")
    names: list[str] = rows.evaluate_all("rows => rows.map(row => row.dataset.tenant)")
    return names


def _tab_to(page: Page, selector: str, *, max_presses: int = 80) -> None:
    target = page.locator(selector)
    for _ in range(max_presses):
        if target.evaluate("element => element === document.activeElement"):
            return
        page.keyboard.press("Tab")
    raise AssertionError(f"{selector} is not reachable with Tab")


# --- usage and live ----------------------------------------------------------------------------


def test_usage_and_live_say_so_when_the_gateway_lacks_their_endpoints(
    console: ConsolePage, server: ConsoleServer
) -> None:
    _create_tenants(server, {"name": "solo"})
    page = console.page
    console.open()
    console.sign_in()
    expect(page.locator("#tenants-usage-note")).to_have_text(
        "Usage and spend columns are empty: this gateway has no billing usage endpoint."
    )
    expect(page.locator("#tenants-table tbody tr[data-tenant=solo]")).to_be_visible()
    console.go("Usage")
    expect(page.locator("#usage-error")).to_contain_text("no billing usage endpoint yet")
    page.get_by_role("button", name="Download").click()
    expect(page.locator("#export-error")).to_contain_text("no billing export endpoint yet")
    console.screenshot("usage-unavailable")
    console.go("Live")
    expect(page.locator("#live-error")).to_contain_text("no live endpoint yet")
    console.screenshot("live-unavailable")
    console.go("Adapters")
    expect(page.locator("#adapters-error")).to_contain_text("no adapter registry")
    expect(page.locator("#register-adapter-form")).to_be_hidden()
    console.open("#tenant/solo")
    expect(page.locator("#tenant-adapters-panel")).to_contain_text("no adapter registry")
    expect(page.locator("#keys-table")).to_be_visible()  # the rest of the tenant is there


def test_live_view_refreshes_in_place_and_flags_the_slo(
    browser: Browser,
    contract_server: ConsoleServer,
    contract: ContractEndpoints,
    artifacts_dir: Path,
) -> None:
    with console_page(browser, contract_server.base_url, artifacts_dir) as console:
        page = console.page
        console.open("#live")
        console.sign_in()
        premium = page.locator("#live-tiers tr[data-tier=premium]")
        expect(premium.locator("td.ttft")).to_have_attribute("data-state", "bad")
        expect(premium).to_contain_text("0.62 s of 0.50 s SLO")
        expect(page.locator("#live-tiers tr[data-tier=standard] td.ttft")).to_have_attribute(
            "data-state", "ok"
        )
        expect(page.locator("#live-tiers tr[data-tier=batch]")).to_contain_text("(no SLO)")
        expect(page.locator("#live-body")).to_contain_text("640 of 1,000 blocks used (64.0 %)")
        small = page.locator("#live-models tr[data-model=small]")
        expect(small.locator("td")).to_have_text(["2", "7", "500 of 600", "45 ms"])
        expect(page.locator("#live-models tr[data-model=large] td").nth(3)).to_have_text("—")
        alerts = page.locator("#live-alerts li")
        expect(alerts.first).to_have_attribute("data-state", "firing")
        expect(alerts.first).to_contain_text("PremiumTTFTHigh")
        expect(page.locator("#alerts-title")).to_have_text("Alerts: 1 firing")

        page.evaluate("window.loadedOnce = true")
        running = premium.locator("td").nth(1)
        first = int(running.inner_text())
        expect(running).not_to_have_text(str(first))  # polled again, no reload
        assert page.evaluate("window.loadedOnce") is True
        console.screenshot("live")
        refresh_ms = page.evaluate("import('/admin/assets/live.js').then(m => m.REFRESH_MS)")
        console.go("Tenants")  # leaving the view stops the polling
        # A poll already in flight may still land (late, if this machine stalls): the count
        # must come to rest, and still polling it never would.
        deadline_s = time.monotonic() + 15
        num_calls = contract.num_live_calls
        while True:
            page.wait_for_timeout(refresh_ms + 1000)
            if contract.num_live_calls == num_calls:
                break
            assert time.monotonic() < deadline_s, "the live view kept polling after it was left"
            num_calls = contract.num_live_calls


def test_usage_view_charts_per_tenant_per_day_and_downloads_the_export(
    browser: Browser,
    contract_server: ConsoleServer,
    contract: ContractEndpoints,
    artifacts_dir: Path,
) -> None:
    with console_page(browser, contract_server.base_url, artifacts_dir) as console:
        page = console.page
        console.open("#usage")
        console.sign_in()
        page.get_by_label("From (UTC)").fill("2026-11-01")
        page.get_by_label("To (UTC, inclusive)").fill("2026-11-03")
        page.get_by_role("button", name="Show usage").click()
        charts = page.locator("#usage-charts figure")
        expect(charts).to_have_count(2)
        expect(charts.first.locator("text.day")).to_have_text(["11-01", "11-02", "11-03"])
        # alpha on day 1 and 2, beta on day 1: three bar segments per chart.
        expect(charts.first.locator("rect[class^=series-]")).to_have_count(3)
        expect(charts.first.locator("rect title")).to_have_text(
            ["alpha, 2026-11-01: 1,010", "beta, 2026-11-01: 310", "alpha, 2026-11-02: 510"]
        )
        expect(charts.first.locator(".legend li")).to_have_text(["alpha", "beta"])
        expect(page.locator("#usage-table tfoot")).to_contain_text("1,800")  # prompt tokens
        console.screenshot("usage")

        page.get_by_label("Month", exact=True).fill("2026-11")
        page.get_by_label("Format", exact=True).select_option("csv")
        with page.expect_download() as download_info:
            page.get_by_role("button", name="Download").click()
        download = download_info.value
        assert download.suggested_filename == "usage-2026-11.csv"
        rows = list(csv.DictReader(io.StringIO(Path(download.path()).read_text())))
        assert rows == [{"period": "2026-11", "tenant_id": "1", "amount_usd": "0.015"}]
        assert contract.export_queries == [{"period": "2026-11", "format": "csv"}]
        expect(page.locator("#export-status")).to_contain_text("usage-2026-11.csv")


# --- LoRA adapters -----------------------------------------------------------------------------


def _upload(page: Page, name: str, archive: bytes) -> None:
    page.get_by_label("Archive").set_input_files(
        files=[{"name": name, "mimeType": "application/gzip", "buffer": archive}]
    )


def test_register_share_and_remove_an_adapter(
    browser: Browser, adapter_server: ConsoleServer, tiny_llama: TinyLlama, artifacts_dir: Path
) -> None:
    server = adapter_server
    assert server.adapters is not None
    _create_tenants(server, {"name": "owner-co"}, {"name": "friend"}, {"name": "stranger"})
    with console_page(browser, server.base_url, artifacts_dir) as console:
        page = console.page
        console.open("#adapters")
        console.sign_in()
        expect(page.get_by_role("heading", name="Adapters", level=2)).to_be_focused()
        expect(page.locator("#adapters-table tbody")).to_have_text(
            "No adapters yet: register one below."
        )
        form = page.locator("#register-adapter-form")
        name = form.get_by_label("Adapter name")
        archive = form.get_by_label("Archive")

        # Refusals show the server's message, on the field it names, as text.
        name.fill("support-bot")
        form.get_by_label("Owner", exact=True).select_option("owner-co")
        expect(form.get_by_label("owner-co", exact=True)).to_have_count(0)  # not the owner
        form.get_by_label("friend", exact=True).check()
        _upload(page, "stray.tar.gz", tiny_llama.stray_tar_gz)
        form.get_by_role("button", name="Register adapter").click()
        error = page.locator("#register-adapter-error")
        expect(error).to_have_text(
            "adapter refused: archive member 'adapter/notes.txt' is not part of a PEFT LoRA "
            "adapter (adapter_config.json and adapter_model.safetensors) (invalid_adapter)"
        )
        expect(archive).to_have_attribute("aria-invalid", "true")
        expect(archive).to_be_focused()
        name.fill("<b>bold</b>:x")
        _upload(page, "adapter.tar.gz", tiny_llama.adapter_tar_gz)
        form.get_by_role("button", name="Register adapter").click()
        expect(error).to_have_text(
            "adapter refused: an adapter may not be named '<b>bold</b>:x' (invalid_adapter)"
        )
        expect(error.locator("b")).to_have_count(0)

        name.fill("support-bot")
        _upload(page, "adapter.tar.gz", tiny_llama.adapter_tar_gz)
        form.get_by_role("button", name="Register adapter").click()
        status = page.locator("#adapters-status")
        expect(status).to_have_text(
            re.compile(rf"Adapter support-bot registered: rank {ADAPTER_RANK} on .*q_proj")
        )
        expect(error).to_be_empty()
        with server.admin() as admin:
            snapshot = admin.get("/admin/v1/adapters/support-bot").json()
            tenant_ids = {t["name"]: t["id"] for t in admin.get("/admin/v1/tenants").json()["data"]}
        assert snapshot["base_model"] == SERVED_NAME
        assert snapshot["owner_tenant_id"] == tenant_ids["owner-co"]
        assert snapshot["shared_with"] == [tenant_ids["friend"]]
        assert snapshot["rank"] == ADAPTER_RANK
        assert sorted(snapshot["targets"]) == ["q_proj", "v_proj"]
        row = page.locator("#adapters-table tbody tr[data-adapter=support-bot]")
        cells = row.locator("td")
        expect(row.locator("th")).to_have_text("support-bot")
        expect(cells.nth(0)).to_have_text(SERVED_NAME)
        expect(cells.nth(1)).to_have_text("owner-co")
        expect(cells.nth(2)).to_have_text("friend")
        expect(cells.nth(3)).to_have_text(str(ADAPTER_RANK))
        expect(cells.nth(4)).to_have_text(", ".join(snapshot["targets"]))
        expect(cells.nth(5)).to_have_text(re.compile(r"^\d+\.\d KiB$"))
        expect(cells.nth(6)).to_have_text("")  # not pinned
        expect(cells.nth(7)).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$"))
        expect(name).to_have_value("")  # ready for the next one, of the same owner
        expect(form.get_by_label("Owner", exact=True)).to_have_value("owner-co")

        # A taken name: 409, on the name field.
        name.fill("support-bot")
        _upload(page, "adapter.tar.gz", tiny_llama.adapter_tar_gz)
        form.get_by_role("button", name="Register adapter").click()
        expect(error).to_have_text("an adapter named 'support-bot' already exists (conflict)")
        expect(name).to_have_attribute("aria-invalid", "true")
        console.screenshot("adapters")

        # Sharing: from friend to stranger.
        page.get_by_role("button", name="Edit sharing of adapter support-bot").click()
        sharing = page.locator("#share-adapter-form")
        expect(sharing.get_by_label("friend", exact=True)).to_be_checked()
        expect(sharing.get_by_label("friend", exact=True)).to_be_focused()
        sharing.get_by_label("friend", exact=True).uncheck()
        sharing.get_by_label("stranger", exact=True).check()
        sharing.get_by_role("button", name="Save sharing").click()
        expect(status).to_have_text("Sharing of adapter support-bot saved.")
        expect(sharing).to_have_count(0)
        expect(cells.nth(2)).to_have_text("stranger")
        with server.admin() as admin:
            shared = admin.get("/admin/v1/adapters/support-bot").json()["shared_with"]
        assert shared == [tenant_ids["stranger"]]

        # Pinning keeps it in the engines' host caches; a second click unpins it.
        page.get_by_role("button", name="Pin adapter support-bot").click()
        expect(status).to_have_text("Adapter support-bot pinned.")
        expect(cells.nth(6)).to_have_text("pinned")
        with server.admin() as admin:
            assert admin.get("/admin/v1/adapters/support-bot").json()["pinned"] is True
        page.get_by_role("button", name="Unpin adapter support-bot").click()
        expect(status).to_have_text("Adapter support-bot unpinned.")
        expect(cells.nth(6)).to_have_text("")

        # Each tenant's view lists the adapters it owns or was granted.
        console.open("#tenant/stranger")
        granted = page.locator("#tenant-adapters-table tbody tr[data-adapter=support-bot]")
        expect(granted).to_contain_text("shared by owner-co")
        console.open("#tenant/owner-co")
        expect(granted).to_contain_text("owner")
        console.screenshot("tenant-adapters")
        console.open("#tenant/friend")
        expect(page.locator("#tenant-adapters-table tbody")).to_have_text(
            "No adapters owned or shared."
        )

        # Removing while a request runs on it: 202, it takes no new requests, and a later
        # removal finishes it once the request has ended.
        running = ModelTarget("support-bot", SERVED_NAME, "support-bot")
        server.adapters.started(running)
        console.go("Adapters")
        expect(error).to_be_empty()  # the conflict shown before is gone with the view
        page.get_by_role("button", name="Remove adapter support-bot").click()
        page.get_by_role("button", name="Confirm: remove adapter support-bot").click()
        expect(status).to_contain_text("still running, takes no new requests")
        expect(status).to_contain_text("1 request on it here")
        removing = page.locator("#adapters-table tbody tr[data-state=removing]")
        expect(removing).to_contain_text("removing")
        expect(removing).to_contain_text("1 request running here")
        console.screenshot("adapters-removing")
        with server.admin() as admin:
            assert admin.get("/admin/v1/adapters").json()["data"] == []
        server.adapters.ended(running)
        page.get_by_role("button", name="Finish removing adapter support-bot").click()
        expect(status).to_have_text("Adapter support-bot removed.")
        expect(page.locator("#adapters-table tbody")).to_have_text(
            "No adapters yet: register one below."
        )
        with server.admin() as admin:
            assert admin.get("/admin/v1/adapters/support-bot").status_code == 404
