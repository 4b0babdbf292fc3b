"""Stored Responses API responses: kept per tenant until their retention ends, found only by
their own tenant (another tenant's id reads as missing)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from tenants.models import StoredResponse

# Rows one purge deletes at most: a purge never holds a long transaction.
MAX_PURGED_PER_CALL = 1000


def save_response(session: Session, response: StoredResponse) -> None:
    """Keep the response; one of the same id is replaced (a batch line run again on another
    replica stores its response under the line's own id)."""
    session.merge(response)


def find_response(
    session: Session, tenant_id: int, response_id: str, now: datetime
) -> StoredResponse | None:
    """The tenant's response of that id while its retention lasts, or None."""
    return session.scalar(
        select(StoredResponse).where(
            StoredResponse.id == response_id,
            StoredResponse.tenant_id == tenant_id,
            StoredResponse.expires_at > now,
        )
    )


def delete_response(session: Session, tenant_id: int, response_id: str) -> bool:
    """Delete the tenant's response of that id; False when it has none."""
    result = session.execute(
        delete(StoredResponse).where(
            StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id
        )
    )
    return bool(getattr(result, "rowcount", 0))


def purge_expired_responses(session: Session, now: datetime) -> int:
    """Delete up to MAX_PURGED_PER_CALL responses past their retention; how many went."""
    expired = select(StoredResponse.id).where(StoredResponse.expires_at <= now).limit(
        MAX_PURGED_PER_CALL)
    ids = list(session.scalars(expired))
    if ids:
        session.execute(delete(StoredResponse).where(StoredResponse.id.in_(ids)))
    return len(ids)
