"""Concurrent requests against a monthly token budget: each admitted request holds the tokens
it may use (prompt + max_tokens) until its usage is recorded, so requests arriving together
cannot spend past the budget; those that do not fit are told to retry (429, the budget held
by requests in flight) or, larger than what is left, to lower max_tokens.

The replica runs in this process (tests/gateway/app_harness.py) with its engine slowed, so
the requests overlap; clients use the openai SDK.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
from sqlalchemy import func, select

from billing import RecordStatus, UsageRecordRow
from gateway.server.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import InProcessGateway, start_gateway

NUM_REQUESTS = 24
MAX_TOKENS = 100
BUDGET = 2000


def _billed_tokens(gateway: InProcessGateway, tenant_id: int) -> int:
    with gateway.runtime.session_factory() as session:
        return int(session.scalar(
            select(func.sum(UsageRecordRow.num_prompt_tokens
                            + UsageRecordRow.num_completion_tokens)).where(
                UsageRecordRow.tenant_id == tenant_id,
                UsageRecordRow.status != RecordStatus.REFUSED,
            )
        ) or 0)


def test_requests_arriving_together_do_not_spend_past_the_budget(tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path)
    try:
        tenant_id, key = gateway.create_tenant(
            "budgeted", "standard", {"monthly_token_budget": BUDGET}
        )
        client = gateway.openai_client(key, timeout=60)
        gateway.runner.extra_delay_s = 0.02

        def send(index: int) -> int | str:
            try:
                response = client.chat.completions.create(
                    model=DEMO_MODEL_NAME, max_tokens=MAX_TOKENS,
                    messages=[{"role": "user", "content": f"request {index}"}],
                    extra_body={"ignore_eos": True},
                )
            except openai.RateLimitError as exc:
                return str(exc.code)
            assert response.usage is not None
            return response.usage.total_tokens

        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            answers = list(pool.map(send, range(NUM_REQUESTS)))
        billed = _billed_tokens(gateway, tenant_id)
    finally:
        gateway.stop()
    served = [a for a in answers if isinstance(a, int)]
    refused = [a for a in answers if isinstance(a, str)]
    print(f"\n{NUM_REQUESTS} requests of up to {MAX_TOKENS} tokens at once against a budget of "
          f"{BUDGET}: {len(served)} served ({billed} tokens billed), {len(refused)} refused")
    assert served and refused  # some fit, the rest did not
    assert billed == sum(served) <= BUDGET
    assert set(refused) <= {"rate_limit_exceeded", "insufficient_quota"}


def test_two_hundred_requests_at_budget_minus_one_spend_nothing(tmp_path: Path) -> None:
    """Issue 36's row: a tenant one token short of its budget sends 200 requests at once.
    Each may use at least 2 tokens (a prompt token and max_tokens 1), more than the 1 left:
    every one is refused to lower max_tokens, and the bill does not move."""
    gateway = start_gateway(tmp_path)
    try:
        tenant_id, key = gateway.create_tenant("nearly-spent", "standard",
                                               {"monthly_token_budget": 10_000})
        first = gateway.openai_client(key, timeout=60).chat.completions.create(
            model=DEMO_MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
        )
        assert first.usage is not None
        used = first.usage.total_tokens
        with gateway.admin() as admin:  # the budget is now one more than what was used
            edited = admin.patch(f"/admin/v1/tenants/{tenant_id}",
                                 json={"quota": {"monthly_token_budget": used + 1}})
            assert edited.status_code == 200, edited.text

        async def send_all() -> list[httpx.Response]:
            async with httpx.AsyncClient(
                base_url=gateway.base_url, timeout=60,
                headers={"authorization": f"Bearer {key}"},
                limits=httpx.Limits(max_connections=200),
            ) as client:
                return await asyncio.gather(*(
                    client.post("/v1/chat/completions", json={
                        "model": DEMO_MODEL_NAME, "max_tokens": 1,
                        "messages": [{"role": "user", "content": f"r{i}"}],
                    })
                    for i in range(200)
                ))

        answers = asyncio.run(send_all())
        billed = _billed_tokens(gateway, tenant_id)
    finally:
        gateway.stop()
    codes = {(a.status_code, a.json()["error"]["code"]) for a in answers if a.status_code != 200}
    print(f"\n200 requests at once, 1 token of the budget left: "
          f"{sum(a.status_code == 200 for a in answers)} served, {billed - used} tokens billed "
          f"beyond the {used} used before, refusals {sorted(codes)}")
    assert codes == {(429, "insufficient_quota")}
    assert all(a.status_code == 429 for a in answers)
    assert billed == used  # 0 tokens over the budget
