"""Idempotent inserts of usage records: ``ON CONFLICT (request_id) DO NOTHING``.

Both the ledger's group commits and spool replays go through here, so a record that is
already stored (replayed twice, or committed just before a crash that left it in the spool
too) is skipped, never duplicated and never an error.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from billing.models import USAGE_RECORDS, record_values
from billing.records import UsageRecord


def insert_records(session: Session, records: Sequence[UsageRecord]) -> set[str]:
    """Insert records not yet stored; return the request ids that were new.

    Runs in the caller's transaction. SQLite and PostgreSQL only: the two backends tiergate
    supports, each with its own spelling of the upsert.
    """
    if not records:
        return set()
    result = session.execute(
        _insert_ignoring_duplicates(session.get_bind().dialect.name).returning(
            USAGE_RECORDS.c.request_id
        ),
        [record_values(record) for record in records],
    )
    return set(result.scalars())


def _insert_ignoring_duplicates(dialect_name: str) -> Insert:
    if dialect_name == "postgresql":
        return postgresql.insert(USAGE_RECORDS).on_conflict_do_nothing(
            index_elements=[USAGE_RECORDS.c.request_id]
        )
    if dialect_name == "sqlite":
        return sqlite.insert(USAGE_RECORDS).on_conflict_do_nothing(
            index_elements=[USAGE_RECORDS.c.request_id]
        )
    raise NotImplementedError(
        f"the usage ledger supports SQLite and PostgreSQL, not {dialect_name}"
    )
