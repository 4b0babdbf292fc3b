"""Exceptions of the policies package.

Admission refusals carry what the gateway needs for the response: the reason (metrics label),
whether a retry can help (`x-should-retry`), the retry delay and, where the rate limiter was
consulted, the rate-limit snapshot for the `x-ratelimit-*` headers. Their message is meant for
the client.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies.rate_limits import RateLimitSnapshot


class PolicyError(Exception):
    """Base of the policies errors."""


class UnknownTierError(PolicyError):
    """A tier name that is not in the tier table."""


class TierTableError(PolicyError):
    """A tier table file that does not validate."""


class AdmissionConfigError(PolicyError):
    """Limits or admission settings that do not validate (negative rates, bad fractions)."""


class RefusalReason(StrEnum):
    """Why a request was refused; the `reason` label of tiergate_rejections_total."""

    REQUESTS = "rate_limit_requests"
    TOKENS = "rate_limit_tokens"
    CONCURRENCY = "concurrency"
    BUDGET = "budget"
    SHED = "slo_shed"
    QUEUE_FULL = "queue_full"
    LIMITER_UNAVAILABLE = "limiter_unavailable"
    PARSE_TIME = "parse_time"
    KEY_RATE_LIMIT = "key_rate_limit"  # the API key's own requests or tokens per minute
    KEY_BUDGET = "key_budget"  # the API key's own monthly token or spend budget


class AdmissionRefused(PolicyError):
    """A request the admission layer turned away."""

    reason: RefusalReason
    should_retry = True  # False: retrying the same request cannot succeed (x-should-retry)
    # The OpenAI error code; None: the gateway's for the status (rate_limit_exceeded, ...).
    code: str | None = None

    def __init__(
        self,
        message: str,
        retry_after_s: float | None,
        snapshot: RateLimitSnapshot | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s  # None: no retry time to offer
        self.snapshot = snapshot  # the tenant's rate limits when refused, if consulted


class LimitName(StrEnum):
    """The rate limit that refused a request."""

    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENT_REQUESTS = "concurrent_requests"


class RateLimited(AdmissionRefused):
    """A request, token or concurrency limit is spent (429 rate_limit_exceeded)."""

    def __init__(
        self,
        message: str,
        limit_name: LimitName,
        limit: int,
        remaining: int,
        reset_s: float | None,
        retry_after_s: float | None,
        snapshot: RateLimitSnapshot,
        should_retry: bool = True,
    ) -> None:
        super().__init__(message, retry_after_s, snapshot)
        self.limit_name = limit_name
        self.limit = limit  # bucket capacity, or the concurrency limit
        self.remaining = remaining
        self.reset_s = reset_s  # until the bucket is full again; None for concurrency
        self.should_retry = should_retry  # False: the request is larger than the bucket
        self.reason = {
            LimitName.REQUESTS: RefusalReason.REQUESTS,
            LimitName.TOKENS: RefusalReason.TOKENS,
            LimitName.CONCURRENT_REQUESTS: RefusalReason.CONCURRENCY,
        }[limit_name]


class KeyRateLimited(RateLimited):
    """The API key's own requests or tokens per minute are spent (429
    key_rate_limit_exceeded); its tenant's may still have room for its other keys."""

    code = "key_rate_limit_exceeded"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reason = RefusalReason.KEY_RATE_LIMIT


class ParseTimeSpent(AdmissionRefused):
    """The tenant's large bodies took its share of this replica's event loop (429, retry
    once the share has refilled)."""

    reason = RefusalReason.PARSE_TIME


class BudgetExhausted(AdmissionRefused):
    """A monthly token or spend budget is used up (429 insufficient_quota, no retry)."""

    reason = RefusalReason.BUDGET
    should_retry = False

    def __init__(self, message: str, budget_name: str, used: int, budget: int) -> None:
        super().__init__(message, retry_after_s=None)
        self.budget_name = budget_name  # "tokens" or "spend_usd_micros"
        self.used = used
        self.budget = budget


class BudgetHeld(AdmissionRefused):
    """The monthly token budget left is held by the tenant's requests in flight (on this
    replica; with Redis, on every replica) (429, retry when they end)."""

    reason = RefusalReason.BUDGET

    def __init__(self, message: str, num_tokens_held: int) -> None:
        super().__init__(message, retry_after_s=1.0)
        self.num_tokens_held = num_tokens_held


class KeyBudgetExhausted(BudgetExhausted):
    """The API key's own monthly token or spend budget is used up (429 key_budget_exceeded,
    no retry); its tenant's other keys are not concerned."""

    reason = RefusalReason.KEY_BUDGET
    code = "key_budget_exceeded"


class KeyBudgetHeld(BudgetHeld):
    """The API key's own monthly token budget left is held by its requests in flight (429
    key_budget_exceeded, retry when they end)."""

    reason = RefusalReason.KEY_BUDGET
    code = "key_budget_exceeded"


class Shed(AdmissionRefused):
    """The tier's estimated queue wait is over its threshold (429, retry later)."""

    reason = RefusalReason.SHED

    def __init__(
        self, message: str, retry_after_s: float, estimated_wait_s: float, threshold_s: float
    ) -> None:
        super().__init__(message, retry_after_s)
        self.estimated_wait_s = estimated_wait_s
        self.threshold_s = threshold_s


class QueueFull(AdmissionRefused):
    """The tenant already has max_queued_requests waiting for the engine on this replica
    (429, retry once its tier's queue has moved)."""

    reason = RefusalReason.QUEUE_FULL

    def __init__(self, message: str, retry_after_s: float, num_queued: int) -> None:
        super().__init__(message, retry_after_s)
        self.num_queued = num_queued


class LimiterUnavailable(AdmissionRefused):
    """The shared rate limiter cannot be reached and the policy is fail_closed (503)."""

    reason = RefusalReason.LIMITER_UNAVAILABLE
