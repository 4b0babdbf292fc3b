"""Admission through one real `tiergate serve` process on the memory limiter: exact rate
limits, x-ratelimit-* headers on every response (streams and refusals included), the openai
SDK's RateLimitError and its use of retry-after-ms, and exhausted budgets. SLO shedding is in
test_admission_shedding.py.

The tenants here are of the batch tier, which is never shed, so only their limits decide.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.gateway.admission_support import (
    MODEL,
    RATE_LIMIT_HEADERS,
    REQUEST_LIMIT_HEADERS,
    SERVER_START_TIMEOUT_S,
    admit_n_of_3n,
    assert_openai_error,
    check_token_limit_under_concurrency,
    completion_body,
    create_tenant,
    post_completion,
    report,
)
from tests.serve_process import ServeProcess

N = 100


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    directory = tmp_path_factory.mktemp("admission-single")
    with ServeProcess(f"sqlite:///{directory / 'tiergate.db'}").start(
        SERVER_START_TIMEOUT_S
    ) as process:
        yield process


# -- exact limits --------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", ["requests", "tokens"])
def test_one_replica_admits_exactly_n_of_3n(server: ServeProcess, limit: str) -> None:
    # The refill over the test is below one unit: exactly the burst.
    assert admit_n_of_3n([server], limit, N, tier="batch") == [N]


def test_concurrent_requests_never_overshoot_a_token_limit(server: ServeProcess) -> None:
    check_token_limit_under_concurrency(
        [server], capacity=3000, concurrency_per_server=32, tier="batch"
    )


# -- headers, error bodies, the SDK ----------------------------------------------------------------


def test_rate_limit_headers_on_plain_and_streamed_answers_and_on_429(server: ServeProcess) -> None:
    quota = {"requests_per_minute": 2, "tokens_per_minute": 1000}
    key = create_tenant(server, quota, tier="batch")
    plain = post_completion(server, key, completion_body(10, 4))
    assert plain.status_code == 200, plain.payload
    assert set(plain.headers) >= RATE_LIMIT_HEADERS, plain.headers
    assert plain.headers["x-ratelimit-limit-requests"] == "2"
    assert plain.headers["x-ratelimit-remaining-requests"] == "1"
    assert plain.headers["x-ratelimit-limit-tokens"] == "1000"
    assert plain.headers["x-ratelimit-remaining-tokens"] == "986"  # 10 + 4 reserved

    lines = []
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        json=completion_body(10, 4, stream=True),
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    ) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert set(streamed.headers) >= RATE_LIMIT_HEADERS, streamed.headers
        assert streamed.headers["x-ratelimit-remaining-requests"] == "0"
        lines = [line for line in streamed.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"

    refused = post_completion(server, key, completion_body(10, 4))
    error = assert_openai_error(refused, 429, "rate_limit_exceeded")
    assert error["type"] == "rate_limit_error"
    assert set(refused.headers) >= RATE_LIMIT_HEADERS, refused.headers
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # the body names the limit, what remains and when it resets
    message = error["message"]
    assert "requests per minute (RPM): limit 2, remaining 0" in message, message
    assert "resets in" in message and "retry after" in message, message
    retry_after_ms = int(refused.headers["retry-after-ms"])
    assert 0 < retry_after_ms <= 30_000  # one request refills in 30 s at 2 a minute
    assert int(refused.headers["retry-after"]) == -(-retry_after_ms // 1000)


@dataclass
class _Attempt:
    sent_at_s: float
    status_code: int = 0
    answered_at_s: float = 0.0
    retry_after_ms: int | None = None


@contextmanager
def _recording_client(
    server: ServeProcess, key: str, max_retries: int
) -> Iterator[tuple[openai.OpenAI, list[_Attempt]]]:
    """An SDK client whose every HTTP attempt (retries included) is recorded."""
    attempts: list[_Attempt] = []

    def on_request(_request: object) -> None:
        attempts.append(_Attempt(sent_at_s=time.monotonic()))

    def on_response(response: httpx.Response) -> None:
        attempt = attempts[-1]
        attempt.answered_at_s = time.monotonic()
        attempt.status_code = response.status_code
        if "retry-after-ms" in response.headers:
            attempt.retry_after_ms = int(response.headers["retry-after-ms"])

    http_client = openai.DefaultHttpxClient(
        event_hooks={"request": [on_request], "response": [on_response]}
    )
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key=key,
        max_retries=max_retries,
        http_client=http_client,
    ) as client:
        yield client, attempts


def test_sdk_raises_rate_limit_error_and_waits_retry_after_ms(server: ServeProcess) -> None:
    # One request every 5 s, one at a time: long enough that each refusal below holds even
    # when this shared machine stalls between two requests for a second or two.
    key = create_tenant(server, {"requests_per_minute": 12, "burst_requests": 1}, tier="batch")
    with _recording_client(server, key, max_retries=0) as (client, _):
        client.completions.create(model=MODEL, prompt="a", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    assert refused.value.status_code == 429 and refused.value.code == "rate_limit_exceeded"
    assert "limit 1, remaining 0" in refused.value.message
    assert set(refused.value.response.headers) >= REQUEST_LIMIT_HEADERS

    with _recording_client(server, key, max_retries=1) as (client, attempts):
        completion = client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    assert completion.choices[0].text is not None
    assert [a.status_code for a in attempts] == [429, 200], attempts
    first, second = attempts
    assert first.retry_after_ms is not None and 0 < first.retry_after_ms <= 5000
    waited_ms = (second.sent_at_s - first.answered_at_s) * 1000
    report(
        f"SDK retry: retry-after-ms {first.retry_after_ms}, second attempt sent "
        f"{waited_ms:.0f} ms after the 429 and admitted"
    )
    # It waited what the server said, not its own backoff (0.5-1 s for a first retry), and
    # that was enough.
    assert waited_ms >= first.retry_after_ms


def test_exhausted_budget_is_insufficient_quota_and_not_retried(server: ServeProcess) -> None:
    quota = {"monthly_token_budget": 20, "requests_per_minute": 1, "burst_requests": 100}
    key = create_tenant(server, quota, tier="batch")
    first = post_completion(server, key, completion_body(15, 5))  # uses the whole budget
    assert first.status_code == 200, first.payload
    # The ledger's monthly total counts the first request before its answer was sent.
    refused = post_completion(server, key, completion_body(15, 5))
    error = assert_openai_error(refused, 429, "insufficient_quota")
    assert error["type"] == "insufficient_quota", error
    assert "used 20 of 20 tokens" in error["message"], error
    assert refused.headers["x-should-retry"] == "false"
    assert "retry-after" not in refused.headers
    # refused before the limiter was asked, yet the limits are in the headers (nothing charged)
    assert refused.headers["x-ratelimit-remaining-requests"] == "99"

    with (
        _recording_client(server, key, max_retries=2) as (client, attempts),
        pytest.raises(openai.RateLimitError) as sdk_refused,
    ):
        client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    assert sdk_refused.value.code == "insufficient_quota"
    assert [a.status_code for a in attempts] == [429]  # x-should-retry: false is obeyed
