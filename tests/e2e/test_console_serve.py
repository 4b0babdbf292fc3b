"""The whole path through a real `tiergate serve` (demo model on CPU, scratch SQLite): sign in
to the console, create a tenant, set its RPM, issue a key and see it once, call
/v1/chat/completions with that key through the openai client, find the request in the usage
view, revoke the key and get 403."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from playwright.sync_api import Browser, expect

from tests.e2e.conftest import ConsolePage, console_page
from tests.serve_process import ADMIN_TOKEN, ServeProcess

# The demo model is loaded on CPU: slow on a busy CI box.
READY_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tiergate serve` in a subprocess on a free port and a scratch SQLite file, ready."""
    database_url = f"sqlite:///{tmp_path_factory.mktemp('serve') / 'tiergate.db'}"
    with ServeProcess(database_url).start(timeout_s=READY_TIMEOUT_S) as server:
        yield server.base_url


@pytest.fixture
def console(browser: Browser, serve_url: str, artifacts_dir: Path) -> Iterator[ConsolePage]:
    with console_page(browser, serve_url, artifacts_dir) as page:
        yield page


def test_tenant_key_chat_usage_revoke_through_tiergate_serve(
    console: ConsolePage, serve_url: str
) -> None:
    page = console.page
    console.open()
    console.sign_in(ADMIN_TOKEN)
    page.get_by_label("Name", exact=True).fill("console-e2e")
    page.get_by_role("button", name="Create tenant").click()
    expect(page.get_by_role("heading", name="Tenant console-e2e")).to_be_focused()

    page.get_by_label("Requests per minute").fill("60")
    page.get_by_role("button", name="Save changes").click()
    expect(page.locator("#tenant-status")).to_have_text("Saved.")
    admin = {"x-admin-token": ADMIN_TOKEN}
    tenant = httpx.get(f"{serve_url}/admin/v1/tenants/console-e2e", headers=admin).json()
    assert tenant["quota"]["requests_per_minute"] == 60

    page.get_by_label("Key name").fill("e2e")
    page.get_by_role("button", name="Issue key").click()
    key = page.get_by_label("API key", exact=True).input_value()
    assert key.startswith("tg-")
    console.screenshot("serve-key-issued")
    page.get_by_role("button", name="Done").click()
    assert key not in page.content()

    with openai.OpenAI(
        base_url=f"{serve_url}/v1", api_key=key, max_retries=0, timeout=60
    ) as client:
        model = client.models.list().data[0].id
        completion = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=4
        )
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    num_tokens = completion.usage.prompt_tokens + completion.usage.completion_tokens

    console.go("Usage")
    page.get_by_role("button", name="Show usage").click()
    row = page.locator("#usage-table tbody tr[data-tenant='console-e2e']")
    expect(row).to_have_count(1)
    cells = row.locator("td")
    expect(cells.nth(2)).to_have_text("1")  # requests
    expect(cells.nth(3)).to_have_text(f"{completion.usage.prompt_tokens:,}")
    expect(cells.nth(5)).to_have_text(f"{completion.usage.completion_tokens:,}")
    expect(page.locator("#usage-charts figure")).to_have_count(2)
    console.screenshot("serve-usage")
    page.get_by_label("Format", exact=True).select_option("jsonl")
    with page.expect_download() as download_info:
        page.get_by_role("button", name="Download").click()
    lines = Path(download_info.value.path()).read_text().splitlines()
    exported = [json.loads(line) for line in lines]
    mine = [line for line in exported if line["tenant_name"] == "console-e2e"]
    assert [line["num_requests"] for line in mine] == [1]

    console.go("Tenants")
    tenant_row = page.locator("#tenants-table tbody tr[data-tenant='console-e2e']")
    expect(tenant_row.locator("td").nth(6)).to_have_text(f"{num_tokens:,}")  # tokens today
    console.screenshot("serve-tenants")

    console.go("Live")
    expect(page.locator("#live-tiers tbody tr")).to_have_count(3)
    console.screenshot("serve-live")

    console.open("#tenant/console-e2e")
    key_row = page.locator("#keys-table tbody tr")
    expect(key_row).to_have_count(1)
    prefix = key_row.get_attribute("data-prefix")
    assert prefix and key.startswith(prefix)
    page.get_by_role("button", name=f"Revoke key {prefix}").click()
    page.get_by_role("button", name=f"Confirm: revoke key {prefix}").click()
    expect(key_row).to_contain_text("revoked")
    with (
        pytest.raises(openai.PermissionDeniedError) as denied,
        openai.OpenAI(
            base_url=f"{serve_url}/v1", api_key=key, max_retries=0, timeout=60
        ) as revoked,
    ):
        revoked.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello?"}], max_tokens=4
        )
    assert denied.value.status_code == 403

    console.go("Audit log")
    expect(page.locator("#audit-table tbody tr").first).to_have_attribute(
        "data-action", "api_key.revoke"
    )
