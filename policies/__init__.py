"""Policies: tier table, tiered fair-share scheduling, admission and shedding decisions.

Plain objects over plain inputs; they import only the engine's public types.
"""

from policies.admission import AdmissionController, AdmissionRequest, AdmissionTicket
from policies.alerts import (
    AlertEvaluator,
    AlertEvent,
    AlertEventKind,
    AlertRuleError,
    AlertState,
    AlertStatus,
    TtftAlertRule,
    rules_from_tiers,
)
from policies.budget_hold import BudgetHold
from policies.budgets import MonthlyUsage, MonthlyUsageSource, check_budgets
from policies.errors import (
    AdmissionConfigError,
    AdmissionRefused,
    BudgetExhausted,
    BudgetHeld,
    KeyBudgetExhausted,
    KeyBudgetHeld,
    KeyRateLimited,
    LimiterUnavailable,
    LimitName,
    ParseTimeSpent,
    PolicyError,
    QueueFull,
    RateLimited,
    RefusalReason,
    Shed,
    TierTableError,
    UnknownTierError,
)
from policies.fair_queue import TieredFairQueue
from policies.key_limits import KeyLimits
from policies.parse_time import ParseTimeBudget, ParseTimeConfig
from policies.queue_wait import TenantShare, estimate_queue_wait_s
from policies.rate_limiter_memory import MemoryRateLimiter
from policies.rate_limiter_redis import FailurePolicy, RedisLimiterConfig, RedisRateLimiter
from policies.rate_limits import (
    BucketSnapshot,
    LimiterBackend,
    RateLimiter,
    RateLimitLease,
    RateLimitSnapshot,
    TenantLimits,
    format_duration,
    rate_limit_headers,
)
from policies.service_tiers import (
    REQUEST_SERVICE_TIERS,
    AbovePlan,
    ServiceTierError,
    served_tier,
)
from policies.shedding import ShedConfig, SloShedder
from policies.tenant_demand import TenantDemand
from policies.tiered_policy import TieredPolicy, TieredPolicyConfig
from policies.tiers import DEFAULT_TIERS, SERVICE_TIER_NAMES, Tier, TierTable

__all__ = [
    "DEFAULT_TIERS",
    "REQUEST_SERVICE_TIERS",
    "SERVICE_TIER_NAMES",
    "AbovePlan",
    "AdmissionConfigError",
    "AdmissionController",
    "AdmissionRefused",
    "AdmissionRequest",
    "AdmissionTicket",
    "AlertEvaluator",
    "AlertEvent",
    "AlertEventKind",
    "AlertRuleError",
    "AlertState",
    "AlertStatus",
    "BucketSnapshot",
    "BudgetExhausted",
    "BudgetHeld",
    "BudgetHold",
    "FailurePolicy",
    "KeyBudgetExhausted",
    "KeyBudgetHeld",
    "KeyLimits",
    "KeyRateLimited",
    "LimitName",
    "LimiterBackend",
    "LimiterUnavailable",
    "MemoryRateLimiter",
    "MonthlyUsage",
    "MonthlyUsageSource",
    "ParseTimeBudget",
    "ParseTimeConfig",
    "ParseTimeSpent",
    "PolicyError",
    "QueueFull",
    "RateLimitLease",
    "RateLimitSnapshot",
    "RateLimited",
    "RateLimiter",
    "RedisLimiterConfig",
    "RedisRateLimiter",
    "RefusalReason",
    "ServiceTierError",
    "Shed",
    "ShedConfig",
    "SloShedder",
    "TenantDemand",
    "TenantLimits",
    "TenantShare",
    "Tier",
    "TierTable",
    "TierTableError",
    "TieredFairQueue",
    "TieredPolicy",
    "TieredPolicyConfig",
    "TtftAlertRule",
    "UnknownTierError",
    "check_budgets",
    "estimate_queue_wait_s",
    "format_duration",
    "rate_limit_headers",
    "rules_from_tiers",
    "served_tier",
]
