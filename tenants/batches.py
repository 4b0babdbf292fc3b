"""Batches and their lines: the progress every replica shares through the database.

A replica claims lines for a lease (`claim_lines`: the oldest batch first, each batch's lines
in prefix order), renews the lease while they run, and stores each result only while the
claim is still its own (`finish_line`), so a line whose replica died is taken over by another
once its lease lapses, and each line has one result. On PostgreSQL claims skip rows another
replica has locked (FOR UPDATE SKIP LOCKED); SQLite serializes writers anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from tenants.models import Batch, BatchLine

# Statuses of a line.
PENDING, RUNNING, DONE, CANCELLED = "pending", "running", "done", "cancelled"
# Statuses of a batch whose lines may still run, and the final ones.
ACTIVE_BATCH_STATUSES = ("in_progress", "cancelling")
FINAL_BATCH_STATUSES = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True)
class ClaimedLine:
    batch_id: str
    line_index: int
    custom_id: str
    body: dict[str, Any]
    tenant_id: int
    api_key_id: int | None
    endpoint: str
    attempts: int


@dataclass(frozen=True)
class LineCounts:
    total: int
    completed: int
    failed: int
    cancelled: int

    @property
    def unfinished(self) -> int:
        return self.total - self.completed - self.failed - self.cancelled


def add_batch(session: Session, batch: Batch, lines: Sequence[BatchLine]) -> None:
    session.add(batch)
    session.flush()
    session.add_all(lines)


def find_batch(session: Session, tenant_id: int, batch_id: str) -> Batch | None:
    return session.scalar(select(Batch).where(Batch.id == batch_id,
                                              Batch.tenant_id == tenant_id))


def list_batches(session: Session, tenant_id: int | None, *, after: str | None,
                 limit: int, status: str | None = None) -> list[Batch]:
    """The tenant's batches (None: every tenant's), newest first, those after the batch
    `after` (a page's last); status: only those in it."""
    query = select(Batch)
    if tenant_id is not None:
        query = query.where(Batch.tenant_id == tenant_id)
    if status is not None:
        query = query.where(Batch.status == status)
    if after is not None:
        cursor = session.get(Batch, after)
        if cursor is not None and tenant_id not in (None, cursor.tenant_id):
            cursor = None
        if cursor is not None:
            query = query.where(or_(Batch.created_at < cursor.created_at, and_(
                Batch.created_at == cursor.created_at, Batch.id < cursor.id)))
    return list(session.scalars(
        query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)))


def line_counts(session: Session, batch_id: str) -> LineCounts:
    rows = session.execute(
        select(BatchLine.status, BatchLine.is_error, func.count())
        .where(BatchLine.batch_id == batch_id)
        .group_by(BatchLine.status, BatchLine.is_error)).all()
    total = completed = failed = cancelled = 0
    for status, is_error, count in rows:
        total += count
        if status == DONE:
            if is_error:
                failed += count
            else:
                completed += count
        elif status == CANCELLED:
            cancelled += count
    return LineCounts(total, completed, failed, cancelled)


def claim_lines(session: Session, replica: str, now: datetime, lease_until: datetime,
                limit: int) -> list[ClaimedLine]:
    """Claim up to limit lines of running batches: pending ones due now, and running ones
    whose lease lapsed (their replica died or stalled)."""
    claimable = or_(
        and_(BatchLine.status == PENDING,
             or_(BatchLine.not_before.is_(None), BatchLine.not_before <= now)),
        and_(BatchLine.status == RUNNING, BatchLine.claim_expires_at < now),
    )
    query = (
        select(BatchLine, Batch.tenant_id, Batch.api_key_id, Batch.endpoint)
        .join(Batch, Batch.id == BatchLine.batch_id)
        .where(Batch.status == "in_progress", claimable)
        .order_by(Batch.created_at, Batch.id, BatchLine.prefix_key, BatchLine.line_index)
        .limit(limit)
        .with_for_update(of=BatchLine, skip_locked=True)
    )
    claimed = []
    for line, tenant_id, api_key_id, endpoint in session.execute(query).all():
        line.status, line.claimed_by, line.claim_expires_at = RUNNING, replica, lease_until
        claimed.append(ClaimedLine(line.batch_id, line.line_index, line.custom_id, line.body,
                                   tenant_id, api_key_id, endpoint, line.attempts))
    return claimed


def renew_claims(session: Session, replica: str, keys: Sequence[tuple[str, int]],
                 lease_until: datetime) -> None:
    for batch_id, line_index in keys:
        session.execute(update(BatchLine).where(
            BatchLine.batch_id == batch_id, BatchLine.line_index == line_index,
            BatchLine.status == RUNNING, BatchLine.claimed_by == replica,
        ).values(claim_expires_at=lease_until))


def finish_line(session: Session, replica: str, batch_id: str, line_index: int,
                result: dict[str, Any], is_error: bool) -> bool:
    """Store the line's result if its claim is still this replica's; False otherwise (another
    replica took it over, or the batch ended it)."""
    done = session.execute(update(BatchLine).where(
        BatchLine.batch_id == batch_id, BatchLine.line_index == line_index,
        BatchLine.status == RUNNING, BatchLine.claimed_by == replica,
    ).values(status=DONE, result=result, is_error=is_error, claimed_by=None,
             claim_expires_at=None))
    return bool(getattr(done, "rowcount", 0))


def release_line(session: Session, replica: str, batch_id: str, line_index: int,
                 not_before: datetime, *, failed_attempt: bool) -> None:
    """Give the line back, to be claimed again from not_before."""
    values: dict[str, Any] = {"status": PENDING, "claimed_by": None,
                              "claim_expires_at": None, "not_before": not_before}
    if failed_attempt:
        values["attempts"] = BatchLine.attempts + 1
    session.execute(update(BatchLine).where(
        BatchLine.batch_id == batch_id, BatchLine.line_index == line_index,
        BatchLine.status == RUNNING, BatchLine.claimed_by == replica,
    ).values(**values))


def end_pending_lines(session: Session, batch_id: str, *, status: str,
                      error: dict[str, str] | None = None, id_prefix: str = "") -> int:
    """End every line not run yet: cancelled, or done with the same error (its error line
    made from the line's custom_id, its id id_prefix + its index); how many."""
    lines = list(session.scalars(select(BatchLine).where(
        BatchLine.batch_id == batch_id, BatchLine.status == PENDING)))
    for line in lines:
        line.status = status
        if error is not None:
            line.is_error = True
            line.result = {"id": f"{id_prefix}{line.line_index}", "custom_id": line.custom_id,
                           "response": None, "error": error}
    return len(lines)


def result_lines(session: Session, batch_id: str, *, errors: bool) -> list[dict[str, Any]]:
    """The results of a batch's done lines in file order: its outputs or its errors."""
    return list(session.scalars(
        select(BatchLine.result).where(
            BatchLine.batch_id == batch_id, BatchLine.status == DONE,
            BatchLine.is_error == errors)
        .order_by(BatchLine.line_index)))


def set_batch_status(session: Session, batch_id: str, expected: Sequence[str], status: str,
                     now: datetime, **values: Any) -> bool:
    """Move the batch from one of expected to status (stamping its <status>_at); False when
    it was not in one of them (another replica moved it first)."""
    stamp = {f"{status}_at": now} if hasattr(Batch, f"{status}_at") else {}
    moved = session.execute(update(Batch).where(
        Batch.id == batch_id, Batch.status.in_(expected),
    ).values(status=status, **stamp, **values))
    return bool(getattr(moved, "rowcount", 0))


def start_finalizing(session: Session, batch_id: str, now: datetime,
                     stale_before: datetime) -> bool:
    """Make this replica the batch's finalizer: from a running or cancelling status, or from
    finalizing whose finalizer started before stale_before (it died); False when another
    replica is, or was first."""
    moved = session.execute(update(Batch).where(
        Batch.id == batch_id,
        or_(Batch.status.in_(ACTIVE_BATCH_STATUSES),
            and_(Batch.status == "finalizing", Batch.finalizing_at < stale_before)),
    ).values(status="finalizing", finalizing_at=now))
    return bool(getattr(moved, "rowcount", 0))


def batches_in(session: Session, statuses: Sequence[str]) -> list[Batch]:
    return list(session.scalars(select(Batch).where(Batch.status.in_(statuses))))


def has_unfinished_lines(session: Session, batch_id: str) -> bool:
    return session.scalar(select(func.count()).select_from(BatchLine).where(
        BatchLine.batch_id == batch_id, BatchLine.status.in_((PENDING, RUNNING)))) != 0
