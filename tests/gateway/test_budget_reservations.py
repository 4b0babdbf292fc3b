"""Concurrent requests against a monthly token budget: each admitted request holds the tokens
it may use (prompt + max_tokens) until its usage is recorded, so requests arriving together
cannot spend past the budget; those that do not fit are told to retry (429, the budget held
by requests in flight) or, larger than what is left, to lower max_tokens.

The replica runs in this process (tests/gateway/app_harness.py) with its engine slowed, so
the requests overlap; clients use the openai SDK.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from sqlalchemy import func, select

from billing import RecordStatus, UsageRecordRow
from gateway.server.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import start_gateway

NUM_REQUESTS = 24
MAX_TOKENS = 100
BUDGET = 2000


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
        with gateway.runtime.session_factory() as session:
            billed = session.scalar(
                select(func.sum(UsageRecordRow.num_prompt_tokens
                                + UsageRecordRow.num_completion_tokens)).where(
                    UsageRecordRow.tenant_id == tenant_id,
                    UsageRecordRow.status != RecordStatus.REFUSED,
                )
            )
    finally:
        gateway.stop()
    served = [a for a in answers if isinstance(a, int)]
    refused = [a for a in answers if isinstance(a, str)]
    print(f"\n{NUM_REQUESTS} requests of up to {MAX_TOKENS} tokens at once against a budget of "
          f"{BUDGET}: {len(served)} served ({billed} tokens billed), {len(refused)} refused")
    assert served and refused  # some fit, the rest did not
    assert billed == sum(served) <= BUDGET
    assert set(refused) <= {"rate_limit_exceeded", "insufficient_quota"}
