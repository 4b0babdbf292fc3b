"""What the replica depends on besides its engine, as the metrics and alert rules see it: the
ledger's database (and the spool that takes its records meanwhile) and the shared rate
limiter's Redis."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DependencyHealth:
    database_up: bool  # the ledger's last commit (or replay, or probe) worked
    spool_bytes: int  # records spooled while the database was away, not yet replayed
    redis_up: bool | None  # the rate limiter reaches Redis; None: no Redis configured
