"""The billing package's exception tree; the gateway translates these to OpenAI error bodies.

BillingError
├── InvalidSettingError      a price or ledger setting from configuration is not acceptable
├── InvalidPeriodError       a month or day range a caller gave that is malformed or out of range
├── InvalidRecordError       a usage record that breaks its own invariants (negative counts, ...)
├── UnknownTierPriceError    no price is configured for a tier
└── LedgerError
    ├── LedgerClosedError        the ledger is not started, or already closed
    ├── LedgerWriteError         a record reached neither the database nor the spool
    └── LedgerUnavailableError   the database is needed (monthly totals, replay) but down
"""

from __future__ import annotations


class BillingError(Exception):
    """Base class of every error the billing package raises on purpose."""


class InvalidSettingError(BillingError):
    """A configured price or ledger setting is missing, of the wrong type or out of range."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class InvalidPeriodError(BillingError):
    """A billing month (YYYY-MM) or a day range (YYYY-MM-DD) that is malformed or out of range."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class InvalidRecordError(BillingError):
    """A usage record that cannot be stored as given (a bug in the caller)."""


class UnknownTierPriceError(BillingError):
    """The pricing table has no entry for this tier."""


class LedgerError(BillingError):
    """Base class of the ledger's errors."""


class LedgerClosedError(LedgerError):
    """record() or monthly_usage() on a ledger that is not running."""


class LedgerWriteError(LedgerError):
    """The database was down and the spool file could not be written either: not durable."""


class LedgerUnavailableError(LedgerError):
    """The database could not be reached for an operation that needs it."""
