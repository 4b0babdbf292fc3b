"""An API key's own limits, applied inside its tenant's.

A key may carry its own requests and tokens per minute and its own monthly token and spend
budgets. A request must pass both the key's limits and its tenant's: the key's are checked
first, so a key capped at 5 RPM under a tenant allowed 100 is refused at its sixth request
while the tenant's other keys still pass. The per-minute buckets are charged in the same
atomic step as the tenant's (admit.lua, or one call on the memory limiter): a request refused
by either costs neither. The key's buckets hold one minute's worth (no burst of their own).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

from policies.errors import AdmissionConfigError
from policies.rate_limits import BucketSpec


@dataclass(frozen=True)
class KeyLimits:
    """One API key's limits in plain form (the gateway builds it from tenants.models.ApiKey)."""

    api_key_id: str  # names the key's buckets and budget counts
    requests_per_minute: int | None = None  # None: only the tenant's limit applies
    tokens_per_minute: int | None = None  # prompt + max_tokens reserved, as the tenant's
    monthly_token_budget: int | None = None
    monthly_spend_budget_usd_micros: int | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int) and value < 0:
                raise AdmissionConfigError(f"key {field.name} must not be negative, got {value}")

    @cached_property
    def requests_bucket(self) -> BucketSpec | None:
        return BucketSpec.of(self.requests_per_minute, None)

    @cached_property
    def tokens_bucket(self) -> BucketSpec | None:
        return BucketSpec.of(self.tokens_per_minute, None)

    @property
    def has_rate_limits(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    @property
    def has_budget(self) -> bool:
        return (
            self.monthly_token_budget is not None
            or self.monthly_spend_budget_usd_micros is not None
        )

    def divided(self, num_replicas: int) -> KeyLimits:
        """Each replica's share of the per-minute limits (fail-open fallback), as the
        tenant's: rounded down, never to zero; budgets unchanged."""

        def share(value: int | None) -> int | None:
            if value is None or value == 0:
                return value
            return max(1, value // num_replicas)

        return KeyLimits(
            api_key_id=self.api_key_id,
            requests_per_minute=share(self.requests_per_minute),
            tokens_per_minute=share(self.tokens_per_minute),
            monthly_token_budget=self.monthly_token_budget,
            monthly_spend_budget_usd_micros=self.monthly_spend_budget_usd_micros,
        )
