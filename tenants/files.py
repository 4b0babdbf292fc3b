"""Files uploaded through the Files API: their rows, found only by their own tenant, and the
tenant's storage quota, checked and taken in the transaction that adds a file (the quota row
locked, so two uploads at once cannot both fit in the room for one)."""

from __future__ import annotations

from sqlalchemy import ColumnElement, delete, func, select
from sqlalchemy.orm import Session

from tenants.errors import TenantsError
from tenants.models import Quota, StoredFile


class StorageQuotaExceeded(TenantsError):
    """The file does not fit in its tenant's file_storage_bytes."""

    def __init__(self, used: int, limit: int, size: int) -> None:
        super().__init__(
            f"this file ({size} bytes) does not fit in the tenant's file storage quota: "
            f"{used} of {limit} bytes are used; delete files to make room")
        self.used, self.limit, self.size = used, limit, size


def add_file(session: Session, file: StoredFile) -> None:
    """Add the file's row, or raise StorageQuotaExceeded (nothing added)."""
    check_file_room(session, file.tenant_id, file.bytes, lock=True)
    session.add(file)


def check_file_room(session: Session, tenant_id: int, size: int, *, lock: bool = False) -> None:
    """Raise StorageQuotaExceeded unless size more bytes fit in the tenant's quota. lock: the
    quota row stays locked until the transaction ends (the check that adds a file)."""
    query = select(Quota.file_storage_bytes).where(Quota.tenant_id == tenant_id)
    limit = session.scalar(query.with_for_update() if lock else query)
    if limit is not None:
        used = used_file_bytes(session, tenant_id)
        if used + size > limit:
            raise StorageQuotaExceeded(used, limit, size)


def used_file_bytes(session: Session, tenant_id: int) -> int:
    return int(session.scalar(
        select(func.coalesce(func.sum(StoredFile.bytes), 0))
        .where(StoredFile.tenant_id == tenant_id)) or 0)


def find_file(session: Session, tenant_id: int, file_id: str) -> StoredFile | None:
    return session.scalar(select(StoredFile).where(
        StoredFile.id == file_id, StoredFile.tenant_id == tenant_id))


def list_files(session: Session, tenant_id: int | None, *, purpose: str | None,
               after: str | None, limit: int, newest_first: bool) -> list[StoredFile]:
    """Up to limit of the tenant's files (None: every tenant's) in creation order (newest
    first, or oldest), those after the file `after` in that order (a page's last id)."""
    query = select(StoredFile)
    if tenant_id is not None:
        query = query.where(StoredFile.tenant_id == tenant_id)
    if purpose is not None:
        query = query.where(StoredFile.purpose == purpose)
    order = (StoredFile.created_at.desc(), StoredFile.id.desc()) if newest_first else (
        StoredFile.created_at.asc(), StoredFile.id.asc())
    if after is not None:
        cursor = session.get(StoredFile, after)
        if cursor is not None and tenant_id not in (None, cursor.tenant_id):
            cursor = None
        if cursor is not None:
            query = query.where(_before(cursor) if newest_first else _after(cursor))
    return list(session.scalars(query.order_by(*order).limit(limit)))


def _before(cursor: StoredFile) -> ColumnElement[bool]:
    return (StoredFile.created_at < cursor.created_at) | (
        (StoredFile.created_at == cursor.created_at) & (StoredFile.id < cursor.id))


def _after(cursor: StoredFile) -> ColumnElement[bool]:
    return (StoredFile.created_at > cursor.created_at) | (
        (StoredFile.created_at == cursor.created_at) & (StoredFile.id > cursor.id))


def delete_file(session: Session, tenant_id: int, file_id: str) -> bool:
    """Delete the tenant's file row; False when it has none."""
    result = session.execute(delete(StoredFile).where(
        StoredFile.id == file_id, StoredFile.tenant_id == tenant_id))
    return bool(getattr(result, "rowcount", 0))
