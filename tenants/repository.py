"""Plain functions over a Session: every read and write of tenants, keys and the audit log.

Functions flush but never commit; the caller owns the transaction. Every write records an
audit entry in the same transaction, so an admin change and its audit row land together.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, joinedload

from tenants.errors import (
    ApiKeyNotFoundError,
    DuplicateError,
    InvalidFieldError,
    TenantNotFoundError,
)
from tenants.keys import GeneratedKey, generate_key, lookup_prefix, verify_key
from tenants.models import ApiKey, AuditEntry, LoraAdapter, Quota, Tenant, TenantStatus, utc_now
from tenants.snapshots import adapter_snapshot, api_key_snapshot, tenant_snapshot
from tenants.validation import (
    DEFAULT_TIERS,
    is_row_id,
    validate_allowed_models,
    validate_cache_salt,
    validate_expiry,
    validate_key_limits,
    validate_name,
    validate_quota,
    validate_row_id,
    validate_tier,
    validate_weight,
)

# Fields update_tenant accepts; "quota" holds a mapping of quota fields.
TENANT_UPDATE_FIELDS: tuple[str, ...] = (
    "name", "tier", "weight", "cache_salt", "allowed_models", "quota",
)
_MAX_KEY_ATTEMPTS = 5


@dataclass(frozen=True)
class CreatedApiKey:
    """A new key row and its plaintext, which exists only here and is never stored."""

    api_key: ApiKey
    plaintext: str


# --- tenants -------------------------------------------------------------------------------


def create_tenant(
    session: Session,
    *,
    name: object,
    tier: object,
    actor: str,
    weight: object = 1.0,
    quota: Mapping[str, object] | None = None,
    cache_salt: object = None,
    allowed_models: object = None,
    known_tiers: Collection[str] = DEFAULT_TIERS,
) -> Tenant:
    """A new active tenant; a random cache salt unless one is given (sharing one is opt-in);
    allowed_models None: every model."""
    clean_name = validate_name(name)
    _ensure_name_free(session, clean_name)
    tenant = Tenant(
        name=clean_name,
        tier=validate_tier(tier, known_tiers),
        weight=validate_weight(weight),
        status=TenantStatus.ACTIVE,
        cache_salt=secrets.token_hex(16) if cache_salt is None else validate_cache_salt(cache_salt),
        allowed_models=validate_allowed_models(allowed_models),
        quota=Quota(**validate_quota(quota or {})),
    )
    session.add(tenant)
    _flush(session, f"a tenant named {clean_name!r} already exists")
    record_audit(session, actor=actor, action="tenant.create", tenant=tenant, before=None)
    return tenant


def get_tenant(session: Session, tenant_id: int) -> Tenant:
    tenant = session.get(Tenant, validate_row_id(tenant_id, "tenant_id"))
    if tenant is None:
        raise TenantNotFoundError(f"no tenant with id {tenant_id}")
    return tenant


def find_tenant(session: Session, ref: str | int) -> Tenant:
    """A tenant by id (an int or ASCII digits) or by name; names never start with a digit."""
    if isinstance(ref, int) or is_row_id(ref):
        return get_tenant(session, validate_row_id(ref, "tenant"))
    tenant = session.scalars(select(Tenant).where(Tenant.name == ref)).one_or_none()
    if tenant is None:
        raise TenantNotFoundError(f"no tenant named {ref!r}")
    return tenant


def list_tenants(session: Session, *, status: TenantStatus | None = None) -> list[Tenant]:
    query = select(Tenant).order_by(Tenant.id)
    if status is not None:
        query = query.where(Tenant.status == status)
    return list(session.scalars(query).unique())


def update_tenant(
    session: Session,
    tenant: Tenant,
    changes: Mapping[str, object],
    *,
    actor: str,
    known_tiers: Collection[str] = DEFAULT_TIERS,
) -> Tenant:
    """Apply a partial update (fields of TENANT_UPDATE_FIELDS); quota fields merge one by one."""
    for field in changes:
        if field not in TENANT_UPDATE_FIELDS:
            raise InvalidFieldError(
                f"cannot update {field!r}; expected some of: {', '.join(TENANT_UPDATE_FIELDS)}",
                field,
            )
    before = tenant_snapshot(tenant)
    if "name" in changes:
        name = validate_name(changes["name"])
        if name != tenant.name:
            _ensure_name_free(session, name)
        tenant.name = name
    if "tier" in changes:
        tenant.tier = validate_tier(changes["tier"], known_tiers)
    if "weight" in changes:
        tenant.weight = validate_weight(changes["weight"])
    if "cache_salt" in changes:
        tenant.cache_salt = validate_cache_salt(changes["cache_salt"])
    if "allowed_models" in changes:
        tenant.allowed_models = validate_allowed_models(changes["allowed_models"])
    if "quota" in changes:
        quota_changes = changes["quota"]
        if not isinstance(quota_changes, Mapping):
            raise InvalidFieldError("quota must be an object", "quota")
        for field, value in validate_quota(quota_changes).items():
            setattr(tenant.quota, field, value)
    tenant.updated_at = utc_now()
    _flush(session, f"a tenant named {tenant.name!r} already exists")
    record_audit(session, actor=actor, action="tenant.update", tenant=tenant, before=before)
    return tenant


def set_tenant_status(
    session: Session, tenant: Tenant, status: TenantStatus, *, actor: str
) -> Tenant:
    """Disable or re-enable a tenant; a disabled tenant's keys get 403 until it is enabled."""
    before = tenant_snapshot(tenant)
    tenant.status = status
    tenant.updated_at = utc_now()
    session.flush()
    action = "tenant.enable" if status is TenantStatus.ACTIVE else "tenant.disable"
    record_audit(session, actor=actor, action=action, tenant=tenant, before=before)
    return tenant


def _ensure_name_free(session: Session, name: str) -> None:
    if session.scalars(select(Tenant.id).where(Tenant.name == name)).first() is not None:
        raise DuplicateError(f"a tenant named {name!r} already exists", "name")


def _flush(session: Session, conflict_message: str) -> None:
    # The name check above can lose a race with another writer; the unique index cannot.
    try:
        session.flush()
    except IntegrityError as exc:
        raise DuplicateError(conflict_message, "name") from exc


# --- API keys ------------------------------------------------------------------------------


def create_api_key(session: Session, tenant: Tenant, *, name: object, actor: str,
                   expires_at: object = None, allowed_models: object = None,
                   limits: Mapping[str, object] | None = None) -> CreatedApiKey:
    """A new key for tenant, valid until expires_at (None: until revoked), for the models in
    allowed_models within the tenant's (None: the tenant's), under its own limits (fields of
    KEY_LIMIT_FIELDS; absent or None: only the tenant's); the caller shows
    CreatedApiKey.plaintext once and drops it."""
    if not isinstance(name, str) or not 1 <= len(name) <= 128:
        raise InvalidFieldError("name must be a string of 1-128 characters", "name")
    expiry = validate_expiry(expires_at, utc_now())
    models = validate_allowed_models(allowed_models)
    own_limits = validate_key_limits(limits or {})
    generated = _free_key(session)
    api_key = ApiKey(
        tenant_id=tenant.id, name=name, prefix=generated.prefix, key_hash=generated.key_hash,
        expires_at=expiry, allowed_models=models, **own_limits,
    )
    session.add(api_key)
    session.flush()
    record_audit(session, actor=actor, action="api_key.create", api_key=api_key, before=None)
    return CreatedApiKey(api_key=api_key, plaintext=generated.plaintext)


def _free_key(session: Session) -> GeneratedKey:
    """A new secret whose prefix no key uses, now or as its previous secret."""
    for _ in range(_MAX_KEY_ATTEMPTS):
        generated = generate_key()
        taken = session.scalars(select(ApiKey.id).where(or_(
            ApiKey.prefix == generated.prefix, ApiKey.previous_prefix == generated.prefix)))
        if taken.first() is None:
            return generated
    # 36**8 prefixes: reaching this means the random source is broken.
    raise AssertionError("could not find a free API key prefix")


MAX_ROTATION_GRACE_S = 30 * 24 * 3600


def rotate_api_key(session: Session, api_key: ApiKey, *, grace_s: object,
                   actor: str) -> CreatedApiKey:
    """A new secret for the key (same id, name, tenant and expiry); the current one keeps
    working for grace_s seconds (0: stops now), and a secret from an earlier rotation stops
    now. The caller shows CreatedApiKey.plaintext once."""
    if isinstance(grace_s, bool) or not isinstance(grace_s, int) or not (
            0 <= grace_s <= MAX_ROTATION_GRACE_S):
        raise InvalidFieldError(
            f"grace_seconds must be an integer in 0..{MAX_ROTATION_GRACE_S}", "grace_seconds")
    if api_key.is_revoked:
        raise InvalidFieldError("a revoked key cannot be rotated", "key_id")
    before = api_key_snapshot(api_key)
    generated = _free_key(session)
    if grace_s > 0:
        api_key.previous_prefix, api_key.previous_key_hash = api_key.prefix, api_key.key_hash
        api_key.previous_expires_at = utc_now() + timedelta(seconds=grace_s)
    else:
        api_key.previous_prefix = api_key.previous_key_hash = None
        api_key.previous_expires_at = None
    session.flush()  # the old prefix moves out of `prefix` before the new one takes it
    api_key.prefix, api_key.key_hash = generated.prefix, generated.key_hash
    session.flush()
    record_audit(session, actor=actor, action="api_key.rotate", api_key=api_key, before=before)
    return CreatedApiKey(api_key=api_key, plaintext=generated.plaintext)


def set_api_key_models(session: Session, api_key: ApiKey, *, allowed_models: object,
                       actor: str) -> ApiKey:
    """The models the key may use from now on, within its tenant's (None: the tenant's);
    audited. Replicas see it when their cached copy of the key expires."""
    models = validate_allowed_models(allowed_models)
    before = api_key_snapshot(api_key)
    api_key.allowed_models = models
    session.flush()
    record_audit(session, actor=actor, action="api_key.update", api_key=api_key, before=before)
    return api_key


def set_api_key_limits(session: Session, api_key: ApiKey, *, limits: Mapping[str, object],
                       actor: str) -> ApiKey:
    """Set the key's own limits named in limits (fields of KEY_LIMIT_FIELDS; None: only the
    tenant's applies), the others kept; audited. Replicas see it when their cached copy of
    the key expires."""
    clean = validate_key_limits(limits)
    before = api_key_snapshot(api_key)
    for field, value in clean.items():
        setattr(api_key, field, value)
    session.flush()
    record_audit(session, actor=actor, action="api_key.update", api_key=api_key, before=before)
    return api_key


def get_api_key(session: Session, api_key_id: int) -> ApiKey:
    api_key = session.get(ApiKey, validate_row_id(api_key_id, "key_id"))
    if api_key is None:
        raise ApiKeyNotFoundError(f"no API key with id {api_key_id}")
    return api_key


def list_api_keys(session: Session, *, tenant_id: int | None = None) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.id)
    if tenant_id is not None:
        query = query.where(ApiKey.tenant_id == tenant_id)
    return list(session.scalars(query))


def revoke_api_key(session: Session, api_key: ApiKey, *, actor: str) -> ApiKey:
    """Revoke a key; revoking a revoked key changes nothing and records nothing."""
    if api_key.is_revoked:
        return api_key
    before = api_key_snapshot(api_key)
    api_key.revoked_at = utc_now()
    session.flush()
    record_audit(session, actor=actor, action="api_key.revoke", api_key=api_key, before=before)
    return api_key


@dataclass(frozen=True)
class KeyMatch:
    """A presented secret's key, and until when that secret works (None: until revoked)."""

    api_key: ApiKey
    expires_at: datetime | None
    is_previous: bool  # the secret from before the last rotation, in its grace


def find_api_key(session: Session, plaintext: str) -> KeyMatch | None:
    """The key matching a presented secret (its current one, or the one before its last
    rotation), with its tenant and quota loaded, or None.

    Looks up by the public prefix, then compares hashes in constant time; the plaintext
    itself never reaches the database, not even as a query parameter.
    """
    prefix = lookup_prefix(plaintext)
    if prefix is None:
        return None
    query = select(ApiKey).where(
        or_(ApiKey.prefix == prefix, ApiKey.previous_prefix == prefix)
    ).options(joinedload(ApiKey.tenant))
    api_key = session.scalars(query).unique().one_or_none()
    if api_key is None:
        return None
    if api_key.prefix == prefix and verify_key(plaintext, api_key.key_hash):
        return KeyMatch(api_key, api_key.expires_at, is_previous=False)
    previous_hash = api_key.previous_key_hash
    if api_key.previous_prefix == prefix and previous_hash and verify_key(plaintext,
                                                                        previous_hash):
        ends = [t for t in (api_key.previous_expires_at, api_key.expires_at) if t is not None]
        return KeyMatch(api_key, min(ends) if ends else None, is_previous=True)
    return None


def mark_api_key_used(session: Session, api_key: ApiKey) -> None:
    api_key.last_used_at = utc_now()
    session.flush()


# --- audit log -----------------------------------------------------------------------------


def record_audit(
    session: Session,
    *,
    actor: str,
    action: str,
    before: dict[str, Any] | None,
    tenant: Tenant | None = None,
    api_key: ApiKey | None = None,
    adapter: LoraAdapter | None = None,
    after: dict[str, Any] | None = None,
) -> AuditEntry:
    """Record an action on tenant, api_key or adapter (exactly one); after is the row as it
    is now, unless given (None for a row the action removes: pass {} then)."""
    assert sum(t is not None for t in (tenant, api_key, adapter)) == 1, "audit one target"
    target_type: str
    target_id: int
    now: dict[str, Any] | None
    if tenant is not None:
        target_type, target_id, now = "tenant", tenant.id, tenant_snapshot(tenant)
    elif api_key is not None:
        target_type, target_id, now = "api_key", api_key.id, api_key_snapshot(api_key)
    else:
        assert adapter is not None
        target_type, target_id, now = "lora_adapter", adapter.id, adapter_snapshot(adapter)
    if after is not None:
        now = after or None
    entry = AuditEntry(
        actor=actor,
        action=action,
        target_type=target_type,
        target_id=str(target_id),
        before=before,
        after=now,
    )
    session.add(entry)
    session.flush()
    return entry


def list_audit_entries(
    session: Session,
    *,
    limit: int = 100,
    before_id: int | None = None,
    target_type: str | None = None,
    target_id: str | None = None,
) -> list[AuditEntry]:
    """Newest first; pass the last id seen as before_id for the next page."""
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    if target_type is not None:
        query = query.where(AuditEntry.target_type == target_type)
    if target_id is not None:
        query = query.where(AuditEntry.target_id == target_id)
    return list(session.scalars(query))
