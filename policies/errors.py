"""Exceptions of the policies package."""

from __future__ import annotations


class PolicyError(Exception):
    """Base of the policies errors."""


class UnknownTierError(PolicyError):
    """A tier name that is not in the tier table."""


class TierTableError(PolicyError):
    """A tier table file that does not validate."""
