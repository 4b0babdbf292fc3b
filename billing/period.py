"""Billing months and day ranges: half-open UTC intervals [start, end)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from billing.errors import InvalidPeriodError

_PERIOD = re.compile(r"(\d{4})-(\d{2})")


@dataclass(frozen=True, order=True)
class Period:
    """One calendar month in UTC, the unit of invoices and of monthly budgets."""

    year: int  # four-digit year
    month: int  # 1..12

    def __post_init__(self) -> None:
        if not 1 <= self.year <= 9999 or not 1 <= self.month <= 12:
            raise InvalidPeriodError(f"no such month: {self.year}-{self.month}", "period")

    @classmethod
    def parse(cls, text: str, param: str = "period") -> Period:
        """A period from "YYYY-MM"."""
        match = _PERIOD.fullmatch(text.strip())
        if match is None:
            raise InvalidPeriodError(f"period must look like YYYY-MM, not {text!r}", param)
        year, month = int(match[1]), int(match[2])
        if not 1 <= month <= 12:
            raise InvalidPeriodError(f"period {text!r} has no month {month}", param)
        if not 1 <= year < 9999:  # the month after must exist too (Period.end)
            raise InvalidPeriodError(f"period {text!r} is out of range", param)
        return cls(year, month)

    @classmethod
    def containing(cls, moment: datetime) -> Period:
        """The month moment falls in, in UTC."""
        utc = moment.astimezone(UTC)
        return cls(utc.year, utc.month)

    @property
    def start(self) -> datetime:
        """First instant of the month (inclusive)."""
        return datetime(self.year, self.month, 1, tzinfo=UTC)

    @property
    def end(self) -> datetime:
        """First instant of the next month (exclusive)."""
        return self.next().start

    def next(self) -> Period:
        return Period(self.year + 1, 1) if self.month == 12 else Period(self.year, self.month + 1)

    def __str__(self) -> str:
        return f"{self.year:04d}-{self.month:02d}"


def parse_day(text: str, param: str) -> date:
    """A calendar day from "YYYY-MM-DD"."""
    try:
        return date.fromisoformat(text.strip())
    except ValueError:
        raise InvalidPeriodError(
            f"{param} must look like YYYY-MM-DD, not {text!r}", param
        ) from None


def day_range(first: date, last: date, *, max_days: int) -> tuple[datetime, datetime]:
    """[first 00:00 UTC, the day after last 00:00 UTC): both days included."""
    if last < first:
        raise InvalidPeriodError("end must not be before start", "end")
    if (last - first).days + 1 > max_days:
        raise InvalidPeriodError(f"a range spans at most {max_days} days", "end")
    start = datetime.combine(first, time(), tzinfo=UTC)
    return start, datetime.combine(last + timedelta(days=1), time(), tzinfo=UTC)
