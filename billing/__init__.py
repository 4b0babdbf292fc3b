"""Billing: usage records, the ledger that writes them (group commit, spool), prices,
monthly totals for budgets, daily rollups and exports.

Imports only tenants (its metadata and models); the schema lives in migrations/.
"""

from billing.errors import (
    BillingError,
    InvalidPeriodError,
    InvalidRecordError,
    InvalidSettingError,
    LedgerClosedError,
    LedgerError,
    LedgerUnavailableError,
    LedgerWriteError,
    UnknownTierPriceError,
)
from billing.export import (
    DAILY_COLUMNS,
    DETAIL_COLUMNS,
    ExportFormat,
    ExportRequest,
    count_records,
    daily_row_json,
    export_lines,
)
from billing.ledger import ReplayReport, UsageLedger
from billing.models import UsageRecordRow
from billing.monthly import MonthlyUsage
from billing.period import Period, day_range, parse_day
from billing.pricing import (
    DEFAULT_TIER_PRICES,
    MICROS_PER_USD,
    PRICE_KEYS,
    Pricing,
    TierPrice,
    format_usd,
)
from billing.records import Endpoint, RecordStatus, UsageRecord
from billing.refusal_tally import RefusalTally
from billing.rollups import DailyUsage, UsageTotals, daily_usage, interval_totals
from billing.store import insert_records

__all__ = [
    "DAILY_COLUMNS",
    "DEFAULT_TIER_PRICES",
    "DETAIL_COLUMNS",
    "MICROS_PER_USD",
    "PRICE_KEYS",
    "BillingError",
    "DailyUsage",
    "Endpoint",
    "ExportFormat",
    "ExportRequest",
    "InvalidPeriodError",
    "InvalidRecordError",
    "InvalidSettingError",
    "LedgerClosedError",
    "LedgerError",
    "LedgerUnavailableError",
    "LedgerWriteError",
    "MonthlyUsage",
    "Period",
    "Pricing",
    "RecordStatus",
    "RefusalTally",
    "ReplayReport",
    "TierPrice",
    "UnknownTierPriceError",
    "UsageLedger",
    "UsageRecord",
    "UsageRecordRow",
    "UsageTotals",
    "count_records",
    "daily_row_json",
    "daily_usage",
    "day_range",
    "export_lines",
    "format_usd",
    "insert_records",
    "interval_totals",
    "parse_day",
]
