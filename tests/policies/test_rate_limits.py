"""Bucket math, refusal choice and messages, duration strings and headers."""

from __future__ import annotations

import math

import pytest

from policies import (
    AdmissionConfigError,
    BucketSnapshot,
    LimitName,
    RateLimitSnapshot,
    RefusalReason,
    TenantLimits,
    format_duration,
    rate_limit_headers,
)
from policies.rate_limits import BucketSpec, LimitLevels, TokenBucket, check_limits


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-3, "0s"),
        (0.0004, "1ms"),
        (0.02, "20ms"),
        (0.9994, "1s"),
        (1, "1s"),
        (1.1, "1.1s"),
        (17.28, "17.28s"),
        (60, "1m0s"),
        (90.5, "1m30.5s"),
        (360, "6m0s"),
        (3661.25, "1h1m1.25s"),
    ],
)
def test_duration_strings_as_openai_writes_them(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_bucket_capacity_defaults_to_one_minute_of_the_rate() -> None:
    assert TenantLimits(requests_per_minute=120).requests_bucket == BucketSpec(120, 2.0)
    assert TenantLimits(tokens_per_minute=600, burst_tokens=50).tokens_bucket == BucketSpec(50, 10)
    assert TenantLimits(burst_requests=5).requests_bucket is None  # no rate: no limit
    assert TenantLimits(requests_per_minute=0, burst_requests=5).requests_bucket == BucketSpec(0, 0)


def test_negative_limits_do_not_validate() -> None:
    with pytest.raises(AdmissionConfigError, match="tokens_per_minute"):
        TenantLimits(tokens_per_minute=-1)


def test_divided_limits_keep_something_and_budgets() -> None:
    limits = TenantLimits(10, 1000, None, 300, 1, 5000, 7)
    share = limits.divided(3)
    assert share == TenantLimits(3, 333, None, 100, 1, 5000, 7)
    assert TenantLimits(requests_per_minute=0).divided(4).requests_per_minute == 0


def test_token_bucket_refills_caps_and_refunds() -> None:
    spec = BucketSpec(capacity=10, rate_per_s=2.0)
    bucket = TokenBucket(spec, now_s=0.0)
    bucket.take(10)
    assert bucket.refill(spec, now_s=1.5) == 3.0
    assert spec.seconds_until(3.0, 4) == 0.5
    assert spec.seconds_until(3.0, 11) == math.inf
    bucket.give_back(100)
    assert bucket.level == 10  # never above capacity
    assert bucket.refill(BucketSpec(4, 1.0), now_s=2.0) == 4  # a smaller quota clamps


def test_refusal_names_the_limit_that_keeps_the_request_out_longest() -> None:
    limits = TenantLimits(requests_per_minute=60, tokens_per_minute=600, max_concurrent_requests=2)
    # requests: 0.5 left -> 0.5 s; tokens: 40 left, 100 asked at 10/s -> 6 s
    levels = LimitLevels(requests=0.5, tokens=40.0, num_concurrent=0)
    refusal = check_limits(limits, levels, 100, concurrency_retry_after_s=1.0)
    assert refusal is not None
    assert refusal.limit_name is LimitName.TOKENS
    assert refusal.reason is RefusalReason.TOKENS
    assert refusal.retry_after_s == pytest.approx(6.0)
    assert (refusal.limit, refusal.remaining) == (600, 40)
    assert refusal.reset_s == pytest.approx(56.0)
    assert refusal.should_retry
    assert refusal.message == (
        "Rate limit reached for tokens per minute (TPM): limit 600, remaining 40, requested "
        "100 (prompt + max_tokens); resets in 56s. Please retry after 6s."
    )
    assert refusal.snapshot is not None
    tokens = refusal.snapshot.tokens
    assert tokens is not None and (tokens.limit, tokens.remaining) == (600, 40)
    assert tokens.reset_s == pytest.approx(56.0)

    full_slots = LimitLevels(requests=60.0, tokens=600.0, num_concurrent=2)
    refusal = check_limits(limits, full_slots, 100, concurrency_retry_after_s=1.5)
    assert refusal is not None and refusal.limit_name is LimitName.CONCURRENT_REQUESTS
    assert refusal.retry_after_s == 1.5
    assert "limit 2 concurrent requests" in refusal.message

    assert check_limits(limits, LimitLevels(1.0, 100.0, 1), 100, 1.0) is None


def test_a_request_larger_than_the_bucket_is_told_not_to_retry() -> None:
    limits = TenantLimits(tokens_per_minute=1000)
    refusal = check_limits(limits, LimitLevels(None, 1000.0, 0), 1500, 1.0)
    assert refusal is not None
    assert not refusal.should_retry and refusal.retry_after_s is None
    assert refusal.message.startswith("Request too large for tokens per minute (TPM): limit 1000")
    assert rate_limit_headers(refusal.snapshot, refusal.retry_after_s) == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "1000",
        "x-ratelimit-reset-tokens": "0s",
    }


def test_headers_for_the_limits_that_exist_and_the_retry_delay() -> None:
    snapshot = RateLimitSnapshot(
        requests=BucketSnapshot(limit=60, remaining=59, reset_s=1.0),
        tokens=BucketSnapshot(limit=150_000, remaining=149_984, reset_s=360.0),
        num_concurrent=1,
        max_concurrent=None,
    )
    assert rate_limit_headers(snapshot) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-tokens": "149984",
        "x-ratelimit-reset-tokens": "6m0s",
    }
    tokens_only = RateLimitSnapshot(None, BucketSnapshot(100, 0, 0.02), 0, None)
    assert rate_limit_headers(tokens_only, retry_after_s=1.2) == {
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "20ms",
        "retry-after": "2",
        "retry-after-ms": "1200",
    }
    assert rate_limit_headers(None, retry_after_s=0.0004) == {
        "retry-after": "1",
        "retry-after-ms": "1",
    }
    assert rate_limit_headers(None, retry_after_s=3.0) == {
        "retry-after": "3",
        "retry-after-ms": "3000",
    }
