"""Policies: tier table, fair-share ordering, admission and shedding decisions.

Plain objects over plain inputs; they import only the engine's public types.
"""

from policies.errors import PolicyError, TierTableError, UnknownTierError
from policies.fair_queue import TieredFairQueue
from policies.tiers import DEFAULT_TIERS, Tier, TierTable

__all__ = [
    "DEFAULT_TIERS",
    "PolicyError",
    "Tier",
    "TierTable",
    "TierTableError",
    "TieredFairQueue",
    "UnknownTierError",
]
