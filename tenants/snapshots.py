"""JSON-ready views of rows: the audit log's before/after, admin API bodies, CLI --json.

One function per model, so the three never drift apart. Key hashes are left out: they are
useless to a reader and need not travel.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tenants.models import ApiKey, AuditEntry, LoraAdapter, Quota, Tenant
from tenants.validation import KEY_LIMIT_FIELDS, QUOTA_FIELDS


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def quota_snapshot(quota: Quota) -> dict[str, Any]:
    return {field: getattr(quota, field) for field in QUOTA_FIELDS}


def tenant_snapshot(tenant: Tenant) -> dict[str, Any]:
    return {
        "id": tenant.id,
        "name": tenant.name,
        "tier": tenant.tier,
        "weight": tenant.weight,
        "status": tenant.status.value,
        "cache_salt": tenant.cache_salt,
        "allowed_models": None if tenant.allowed_models is None else list(tenant.allowed_models),
        "quota": quota_snapshot(tenant.quota),
        "created_at": _iso(tenant.created_at),
        "updated_at": _iso(tenant.updated_at),
    }


def api_key_snapshot(api_key: ApiKey) -> dict[str, Any]:
    return {
        "id": api_key.id,
        "tenant_id": api_key.tenant_id,
        "name": api_key.name,
        "prefix": api_key.prefix,
        "created_at": _iso(api_key.created_at),
        "last_used_at": _iso(api_key.last_used_at),
        "revoked_at": _iso(api_key.revoked_at),
        "expires_at": _iso(api_key.expires_at),
        # The secret before the last rotation works until then (null: none does).
        "previous_expires_at": _iso(api_key.previous_expires_at),
        # Within the tenant's allowed models; null: the tenant's.
        "allowed_models": (None if api_key.allowed_models is None
                           else list(api_key.allowed_models)),
        # Its own limits inside its tenant's; null: only the tenant's applies.
        **{field: getattr(api_key, field) for field in KEY_LIMIT_FIELDS},
    }


def adapter_snapshot(adapter: LoraAdapter) -> dict[str, Any]:
    return {
        "id": adapter.id,
        "name": adapter.name,
        "base_model": adapter.base_model,
        "owner_tenant_id": adapter.owner_tenant_id,
        "shared_with": adapter.shared_with,
        "content_hash": adapter.content_hash,
        "rank": adapter.rank,
        "targets": list(adapter.targets),
        "size_bytes": adapter.size_bytes,
        "pinned": adapter.pinned,
        "created_at": _iso(adapter.created_at),
        "deleted_at": _iso(adapter.deleted_at),
    }


def audit_entry_snapshot(entry: AuditEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "occurred_at": _iso(entry.occurred_at),
        "actor": entry.actor,
        "action": entry.action,
        "target_type": entry.target_type,
        "target_id": entry.target_id,
        "before": entry.before,
        "after": entry.after,
    }
