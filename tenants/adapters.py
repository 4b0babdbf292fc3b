"""Plain functions over a Session: the LoRA adapter registry (who owns an adapter, who else
may use it, its files once per content). Like tenants.repository: they flush, never commit,
and every write records an audit entry in the same transaction.
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tenants.errors import AdapterNotFoundError, DuplicateError
from tenants.models import LoraAdapter, LoraAdapterBlob, LoraAdapterGrant, Tenant, utc_now
from tenants.repository import record_audit
from tenants.snapshots import adapter_snapshot
from tenants.validation import validate_name


def register_adapter(
    session: Session,
    *,
    name: object,
    base_model: str,
    owner: Tenant,
    shared_with: Collection[Tenant],
    content_hash: str,
    config_json: bytes,
    weights: bytes,
    rank: int,
    targets: list[str],
    actor: str,
) -> LoraAdapter:
    """A new adapter (its files stored once per content hash); the caller has checked them."""
    clean_name = validate_name(name)
    if session.scalars(select(LoraAdapter.id).where(LoraAdapter.name == clean_name)).first():
        raise DuplicateError(f"an adapter named {clean_name!r} already exists", "name")
    if session.get(LoraAdapterBlob, content_hash) is None:
        session.add(LoraAdapterBlob(content_hash=content_hash, config_json=config_json,
                                    weights=weights))
        session.flush()  # before the row that refers to it
    adapter = LoraAdapter(
        name=clean_name, base_model=base_model, owner_tenant_id=owner.id,
        content_hash=content_hash, rank=rank, targets=targets,
        size_bytes=len(config_json) + len(weights),
        grants=[LoraAdapterGrant(tenant_id=t.id) for t in shared_with if t.id != owner.id],
    )
    session.add(adapter)
    try:
        session.flush()
    except IntegrityError as exc:  # lost a race for the name
        raise DuplicateError(f"an adapter named {clean_name!r} already exists", "name") from exc
    record_audit(session, actor=actor, action="lora_adapter.create", adapter=adapter,
                 before=None)
    return adapter


def find_adapter(session: Session, name: str, *, include_deleting: bool = False) -> LoraAdapter:
    """A registered adapter by name (one being unregistered only if include_deleting)."""
    adapter = session.scalars(select(LoraAdapter).where(LoraAdapter.name == name)).one_or_none()
    if adapter is None or (adapter.deleted_at is not None and not include_deleting):
        raise AdapterNotFoundError(f"no adapter named {name!r}")
    return adapter


def list_adapters(session: Session, *, tenant_id: int | None = None) -> list[LoraAdapter]:
    """Live adapters; with tenant_id, those the tenant owns or is granted."""
    query = select(LoraAdapter).where(LoraAdapter.deleted_at.is_(None))
    if tenant_id is not None:
        granted = select(LoraAdapterGrant.adapter_id).where(
            LoraAdapterGrant.tenant_id == tenant_id)
        query = query.where(or_(LoraAdapter.owner_tenant_id == tenant_id,
                                LoraAdapter.id.in_(granted)))
    return list(session.scalars(query.order_by(LoraAdapter.id)).unique())


def share_adapter(session: Session, adapter: LoraAdapter, shared_with: Collection[Tenant], *,
                  actor: str) -> LoraAdapter:
    """Replace the tenants besides the owner that may use the adapter."""
    before = adapter_snapshot(adapter)
    wanted = {t.id for t in shared_with if t.id != adapter.owner_tenant_id}
    adapter.grants = [g for g in adapter.grants if g.tenant_id in wanted]
    held = {g.tenant_id for g in adapter.grants}
    adapter.grants += [LoraAdapterGrant(tenant_id=t) for t in sorted(wanted - held)]
    session.flush()
    record_audit(session, actor=actor, action="lora_adapter.share", adapter=adapter,
                 before=before)
    return adapter


def pin_adapter(session: Session, adapter: LoraAdapter, pinned: bool, *,
                actor: str) -> LoraAdapter:
    """Keep the adapter in the engines' host caches once loaded (pinned), or leave it to their
    LRU."""
    before = adapter_snapshot(adapter)
    if adapter.pinned != pinned:
        adapter.pinned = pinned
        session.flush()
        record_audit(session, actor=actor, action="lora_adapter.pin" if pinned
                     else "lora_adapter.unpin", adapter=adapter, before=before)
    return adapter


def count_pinned(session: Session, base_model: str) -> int:
    """The adapters of base_model pinned now (unregistering ones aside)."""
    query = select(func.count()).select_from(LoraAdapter).where(
        LoraAdapter.base_model == base_model, LoraAdapter.pinned.is_(True),
        LoraAdapter.deleted_at.is_(None))
    return int(session.scalar(query) or 0)


def begin_unregister(session: Session, adapter: LoraAdapter, *, actor: str) -> LoraAdapter:
    """No new request may use the adapter from now on (every replica, within its cache's
    lifetime); remove_adapter follows once the running ones have ended."""
    before = adapter_snapshot(adapter)
    if adapter.deleted_at is None:
        adapter.deleted_at = utc_now()
        session.flush()
        record_audit(session, actor=actor, action="lora_adapter.unregister", adapter=adapter,
                     before=before)
    return adapter


def remove_adapter(session: Session, adapter: LoraAdapter, *, actor: str) -> bool:
    """Delete the adapter's row, and its files when no other adapter has the same content;
    True when they went too."""
    before = adapter_snapshot(adapter)
    record_audit(session, actor=actor, action="lora_adapter.delete", adapter=adapter,
                 before=before, after={})
    content_hash = adapter.content_hash
    session.delete(adapter)
    session.flush()
    if session.scalars(select(LoraAdapter.id).where(
            LoraAdapter.content_hash == content_hash)).first() is None:
        blob = session.get(LoraAdapterBlob, content_hash)
        if blob is not None:
            session.delete(blob)
            session.flush()
        return True
    return False


def adapter_files(session: Session, content_hash: str) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) bytes of a stored content."""
    blob = session.get(LoraAdapterBlob, content_hash)
    if blob is None:
        raise AdapterNotFoundError(f"no adapter content {content_hash}")
    return blob.config_json, blob.weights
