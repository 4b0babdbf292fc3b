"""Tenants, their quotas and API keys, and the admin audit log: models and plain functions.

Imports nothing of the project; the schema itself lives in migrations/.
"""

from tenants.db import create_db_engine, create_session_factory, session_scope
from tenants.deadline_calls import CallTimedOut, DeadlineCall, DeadlineCalls
from tenants.errors import (
    ApiKeyNotFoundError,
    DuplicateError,
    InvalidFieldError,
    RowNotFoundError,
    TenantNotFoundError,
    TenantsError,
)
from tenants.keys import (
    GeneratedKey,
    generate_key,
    hash_key,
    looks_like_key,
    lookup_prefix,
    verify_key,
)
from tenants.models import ApiKey, AuditEntry, Base, Quota, Tenant, TenantStatus, UtcDateTime
from tenants.repository import (
    TENANT_UPDATE_FIELDS,
    CreatedApiKey,
    create_api_key,
    create_tenant,
    find_api_key,
    find_tenant,
    get_api_key,
    get_tenant,
    list_api_keys,
    list_audit_entries,
    list_tenants,
    mark_api_key_used,
    record_audit,
    revoke_api_key,
    set_tenant_status,
    update_tenant,
)
from tenants.settings import DATABASE_URL_ENV, DEFAULT_DATABASE_URL, DatabaseSettings
from tenants.snapshots import (
    api_key_snapshot,
    audit_entry_snapshot,
    quota_snapshot,
    tenant_snapshot,
)
from tenants.validation import DEFAULT_TIERS, MAX_ROW_ID, QUOTA_FIELDS, is_row_id, validate_row_id

__all__ = [
    "DATABASE_URL_ENV",
    "DEFAULT_DATABASE_URL",
    "DEFAULT_TIERS",
    "MAX_ROW_ID",
    "QUOTA_FIELDS",
    "TENANT_UPDATE_FIELDS",
    "ApiKey",
    "ApiKeyNotFoundError",
    "AuditEntry",
    "Base",
    "CallTimedOut",
    "CreatedApiKey",
    "DatabaseSettings",
    "DeadlineCall",
    "DeadlineCalls",
    "DuplicateError",
    "GeneratedKey",
    "InvalidFieldError",
    "Quota",
    "RowNotFoundError",
    "Tenant",
    "TenantNotFoundError",
    "TenantStatus",
    "TenantsError",
    "UtcDateTime",
    "api_key_snapshot",
    "audit_entry_snapshot",
    "create_api_key",
    "create_db_engine",
    "create_session_factory",
    "create_tenant",
    "find_api_key",
    "find_tenant",
    "generate_key",
    "get_api_key",
    "get_tenant",
    "hash_key",
    "is_row_id",
    "list_api_keys",
    "list_audit_entries",
    "list_tenants",
    "looks_like_key",
    "lookup_prefix",
    "mark_api_key_used",
    "quota_snapshot",
    "record_audit",
    "revoke_api_key",
    "session_scope",
    "set_tenant_status",
    "tenant_snapshot",
    "update_tenant",
    "validate_row_id",
    "verify_key",
]
