"""Monthly token budgets end to end: a tenant is admitted while the tokens a request may use
(prompt + max_tokens) fit in what the ledger says is left, then gets 429 insufficient_quota
with `x-should-retry: false`, which the openai SDK does not retry; the usage never passes
the budget; the ledger's totals survive a restart, and a larger budget lets the tenant in
again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from tests.gateway.serve_harness import (
    MODEL,
    admin_client,
    billing_periods,
    detail_export,
    start_replica,
)
from tests.serve_process import ServeProcess

BUDGET_TOKENS = 120
MAX_TOKENS = 16
MESSAGES = [{"role": "user", "content": "How much is left in my budget?"}]


class CountingClient:
    """The openai SDK (which retries twice by default) over a client counting HTTP attempts."""

    def __init__(self, server: ServeProcess, api_key: str) -> None:
        self.num_attempts = 0
        http_client = openai.DefaultHttpxClient(event_hooks={"request": [self._count]})
        self.sdk = openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=2,
            http_client=http_client,
        )  # fmt: skip

    def close(self) -> None:
        self.sdk.close()

    def _count(self, _request: httpx2.Request) -> None:
        self.num_attempts += 1

    def chat(self) -> int:
        """One chat completion; the tokens it used."""
        response = self.sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert response.usage is not None
        return response.usage.total_tokens

    def refused(self, *, stream: bool = False) -> openai.RateLimitError:
        """The refusal of one more request, after checking the SDK sent it only once."""
        num_before = self.num_attempts
        with pytest.raises(openai.RateLimitError) as caught:
            if stream:
                self.sdk.completions.create(
                    model=MODEL, prompt="more", max_tokens=BUDGET_TOKENS, stream=True
                )
            else:
                self.chat()
        assert self.num_attempts == num_before + 1  # no retry
        return caught.value


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tiergate.db'}"


@pytest.fixture
def server(sqlite_url: str, tmp_path: Path) -> Iterator[ServeProcess]:
    with start_replica(sqlite_url, tmp_path / "data") as process:
        yield process


def _tenant_records(
    server: ServeProcess, tenant_id: int, since: datetime, *, num_refused: int
) -> list[dict[str, Any]]:
    """The tenant's records once its refusals are in (they are folded and written a second
    at a time, after the 429s)."""
    deadline = time.monotonic() + 10.0
    while True:
        records = [
            r for r in detail_export(server, billing_periods(since)) if r["tenant_id"] == tenant_id
        ]
        if sum(r["num_requests"] for r in records if r["status"] == "refused") >= num_refused:
            return records
        assert time.monotonic() < deadline, records
        time.sleep(0.1)


def _assert_budget_refusal(error: openai.RateLimitError, used: int) -> None:
    assert error.status_code == 429
    assert error.code == "insufficient_quota"
    assert error.response.headers["x-should-retry"] == "false"
    assert f"{BUDGET_TOKENS - used} of the monthly token budget" in error.message
    assert "lower max_tokens" in error.message


def test_budget_exhausted_from_the_ledger_is_429_without_retry(
    server: ServeProcess, sqlite_url: str, tmp_path: Path
) -> None:
    since = datetime.now(UTC)
    with admin_client(server) as admin:
        created = admin.post(
            "/admin/v1/tenants",
            json={"name": "capped", "quota": {"monthly_token_budget": BUDGET_TOKENS}},
        )
        assert created.status_code == 201, created.text
        tenant_id = created.json()["id"]
        api_key = admin.post("/admin/v1/tenants/capped/keys", json={"name": "sdk"}).json()["key"]
    # Admitted while a request's tokens fit in what is left; never over the budget.
    used = 0
    with closing(CountingClient(server, api_key)) as client:
        while True:
            try:
                used += client.chat()
            except openai.RateLimitError as first:
                _assert_budget_refusal(first, used)
                break
        assert used <= BUDGET_TOKENS
        num_admitted = client.num_attempts - 1
        # A refusal uses nothing: the second sees the same usage as the first.
        _assert_budget_refusal(client.refused(), used)
        _assert_budget_refusal(client.refused(stream=True), used)

    records = _tenant_records(server, tenant_id, since, num_refused=3)
    billed = [r for r in records if r["status"] == "completed"]
    assert len(billed) == num_admitted
    assert sum(r["num_prompt_tokens"] + r["num_completion_tokens"] for r in billed) == used
    refused = [r for r in records if r["status"] == "refused"]
    assert all(r["num_prompt_tokens"] == r["amount_usd_micros"] == 0 for r in refused)
    print(f"\n{num_admitted} requests admitted for {used} tokens of {BUDGET_TOKENS}, then 429")

    # A new process reads the month's usage back from the ledger.
    assert server.stop() == 0, server.output()
    with (
        start_replica(sqlite_url, tmp_path / "data") as restarted,
        closing(CountingClient(restarted, api_key)) as client,
    ):
        _assert_budget_refusal(client.refused(), used)
        with admin_client(restarted) as admin:
            patched = admin.patch(
                f"/admin/v1/tenants/{tenant_id}",
                json={"quota": {"monthly_token_budget": used + 1000}},
            )
            assert patched.status_code == 200, patched.text
        assert client.chat() > 0
