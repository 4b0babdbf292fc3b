"""Repository functions against the migrated SQLite and PostgreSQL databases."""

from __future__ import annotations

from datetime import UTC

import pytest
from sqlalchemy import Engine, delete, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

import tenants
from tenants import (
    ApiKey,
    AuditEntry,
    DuplicateError,
    InvalidFieldError,
    Quota,
    Tenant,
    TenantNotFoundError,
    TenantStatus,
)

ACTOR = "test"


def _tenant(
    session: Session,
    name: str = "acme",
    *,
    weight: float = 1.0,
    quota: dict[str, object] | None = None,
    cache_salt: str | None = None,
) -> Tenant:
    tenant = tenants.create_tenant(
        session,
        name=name,
        tier="standard",
        actor=ACTOR,
        weight=weight,
        quota=quota,
        cache_salt=cache_salt,
    )
    session.commit()
    return tenant


def test_create_tenant_defaults(session: Session, session_factory: sessionmaker[Session]) -> None:
    tenant = _tenant(session)
    with session_factory() as other:
        stored = tenants.get_tenant(other, tenant.id)
        assert (stored.name, stored.tier, stored.weight) == ("acme", "standard", 1.0)
        assert stored.status is TenantStatus.ACTIVE
        assert len(stored.cache_salt) == 32
        assert tenants.quota_snapshot(stored.quota) == dict.fromkeys(tenants.QUOTA_FIELDS)
        # Timestamps come back timezone-aware UTC from both backends.
        assert stored.created_at.tzinfo is not None
        assert stored.created_at.utcoffset() == UTC.utcoffset(None)
        assert stored.created_at == tenant.created_at


def test_each_tenant_gets_its_own_cache_salt(session: Session) -> None:
    salts = {_tenant(session, f"t{i}").cache_salt for i in range(5)}
    assert len(salts) == 5
    assert _tenant(session, "shared", cache_salt="group-a").cache_salt == "group-a"


def test_create_tenant_with_quota(session: Session) -> None:
    tenant = _tenant(session, quota={"requests_per_minute": 60, "kv_cap_share": 0.25}, weight=3)
    assert tenant.weight == 3.0
    assert tenant.quota.requests_per_minute == 60
    assert tenant.quota.kv_cap_share == 0.25
    assert tenant.quota.tokens_per_minute is None


def test_tenant_names_are_unique(session: Session) -> None:
    _tenant(session)
    with pytest.raises(DuplicateError) as caught:
        _tenant(session)
    assert caught.value.param == "name"


def test_tier_is_checked_against_the_known_tiers(session: Session) -> None:
    with pytest.raises(InvalidFieldError) as caught:
        tenants.create_tenant(session, name="acme", tier="gold", actor=ACTOR)
    assert caught.value.param == "tier"
    tenant = tenants.create_tenant(
        session, name="acme", tier="gold", actor=ACTOR, known_tiers=("gold", "silver")
    )
    assert tenant.tier == "gold"


def test_find_tenant_by_id_or_name(session: Session) -> None:
    tenant = _tenant(session)
    assert tenants.find_tenant(session, "acme") is tenant
    assert tenants.find_tenant(session, str(tenant.id)) is tenant
    assert tenants.find_tenant(session, tenant.id) is tenant
    with pytest.raises(TenantNotFoundError):
        tenants.find_tenant(session, "nobody")
    with pytest.raises(TenantNotFoundError):
        tenants.find_tenant(session, 999_999)


def test_list_tenants_by_status(session: Session) -> None:
    active, disabled = _tenant(session, "a"), _tenant(session, "b")
    tenants.set_tenant_status(session, disabled, TenantStatus.DISABLED, actor=ACTOR)
    session.commit()
    assert [t.name for t in tenants.list_tenants(session)] == ["a", "b"]
    assert tenants.list_tenants(session, status=TenantStatus.ACTIVE) == [active]
    assert tenants.list_tenants(session, status=TenantStatus.DISABLED) == [disabled]


def test_update_merges_quota_fields_and_null_means_unlimited(session: Session) -> None:
    tenant = _tenant(session, quota={"requests_per_minute": 60, "tokens_per_minute": 1000})
    tenants.update_tenant(
        session,
        tenant,
        {"tier": "premium", "quota": {"tokens_per_minute": None, "max_queued_requests": 5}},
        actor=ACTOR,
    )
    session.commit()
    session.expire_all()
    assert tenant.tier == "premium"
    assert tenant.quota.requests_per_minute == 60
    assert tenant.quota.tokens_per_minute is None
    assert tenant.quota.max_queued_requests == 5


def test_update_rejects_unknown_and_invalid_fields(session: Session) -> None:
    tenant = _tenant(session)
    cases: list[tuple[dict[str, object], str]] = [
        ({"status": "disabled"}, "status"),
        ({"weight": 0}, "weight"),
        ({"quota": {"kv_cap_share": 2}}, "quota.kv_cap_share"),
        ({"quota": [1]}, "quota"),
    ]
    for changes, param in cases:
        with pytest.raises(InvalidFieldError) as caught:
            tenants.update_tenant(session, tenant, changes, actor=ACTOR)
        assert caught.value.param == param


def test_rename_to_a_taken_name_conflicts(session: Session) -> None:
    _tenant(session, "a")
    b = _tenant(session, "b")
    with pytest.raises(DuplicateError):
        tenants.update_tenant(session, b, {"name": "a"}, actor=ACTOR)


def test_every_write_is_audited_with_before_and_after(session: Session) -> None:
    tenant = _tenant(session)
    tenants.update_tenant(session, tenant, {"weight": 2}, actor="alice")
    tenants.set_tenant_status(session, tenant, TenantStatus.DISABLED, actor="bob")
    created = tenants.create_api_key(session, tenant, name="ci", actor="carol")
    tenants.revoke_api_key(session, created.api_key, actor="dave")
    tenants.revoke_api_key(session, created.api_key, actor="dave")  # no-op, not audited
    session.commit()

    entries = tenants.list_audit_entries(session)
    assert [(e.action, e.actor) for e in entries] == [
        ("api_key.revoke", "dave"),
        ("api_key.create", "carol"),
        ("tenant.disable", "bob"),
        ("tenant.update", "alice"),
        ("tenant.create", ACTOR),
    ]
    revoke, _, disable, update, create = entries
    assert create.before is None and create.after is not None
    assert create.after["name"] == "acme"
    assert update.before is not None and update.after is not None
    assert (update.before["weight"], update.after["weight"]) == (1.0, 2.0)
    assert disable.before is not None and disable.after is not None
    assert (disable.before["status"], disable.after["status"]) == ("active", "disabled")
    assert revoke.before is not None and revoke.after is not None
    assert revoke.before["revoked_at"] is None and revoke.after["revoked_at"] is not None
    assert (revoke.target_type, revoke.target_id) == ("api_key", str(created.api_key.id))
    assert all(e.occurred_at.tzinfo is not None for e in entries)


def test_audit_paging_and_filters(session: Session) -> None:
    a, b = _tenant(session, "a"), _tenant(session, "b")
    for weight in (2, 3, 4):
        tenants.update_tenant(session, a, {"weight": weight}, actor=ACTOR)
    session.commit()
    page = tenants.list_audit_entries(session, limit=2)
    assert len(page) == 2 and page[0].id > page[1].id
    rest = tenants.list_audit_entries(session, before_id=page[-1].id)
    assert len(page) + len(rest) == 5  # 2 creates, 3 updates
    only_b = tenants.list_audit_entries(session, target_type="tenant", target_id=str(b.id))
    assert [e.action for e in only_b] == ["tenant.create"]


def test_api_key_is_found_by_plaintext_only(session: Session) -> None:
    tenant = _tenant(session)
    created = tenants.create_api_key(session, tenant, name="ci", actor=ACTOR)
    session.commit()
    key = created.plaintext
    found = tenants.find_api_key(session, key)
    assert found is not None and found.api_key.id == created.api_key.id
    assert found.api_key.tenant.name == "acme" and not found.is_previous
    assert tenants.find_api_key(session, key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    assert tenants.find_api_key(session, "tg-zzzzzzzz_" + "x" * 43) is None
    assert tenants.find_api_key(session, "nonsense") is None
    stored = session.scalars(select(ApiKey)).one()
    assert stored.key_hash == tenants.hash_key(key)
    assert stored.prefix == key[:11]


def test_revoked_key_is_still_found_and_reports_revoked(session: Session) -> None:
    tenant = _tenant(session)
    created = tenants.create_api_key(session, tenant, name="ci", actor=ACTOR)
    tenants.revoke_api_key(session, created.api_key, actor=ACTOR)
    session.commit()
    found = tenants.find_api_key(session, created.plaintext)
    assert found is not None and found.api_key.is_revoked
    with pytest.raises(InvalidFieldError, match="a revoked key cannot be rotated"):
        tenants.rotate_api_key(session, created.api_key, grace_s=60, actor=ACTOR)


def test_a_rotated_key_keeps_its_id_and_its_old_secret_for_the_grace(session: Session) -> None:
    tenant = _tenant(session)
    first = tenants.create_api_key(session, tenant, name="ci", actor=ACTOR)
    second = tenants.rotate_api_key(session, first.api_key, grace_s=60, actor=ACTOR)
    session.commit()
    assert second.api_key.id == first.api_key.id and second.plaintext != first.plaintext
    new = tenants.find_api_key(session, second.plaintext)
    old = tenants.find_api_key(session, first.plaintext)
    assert new is not None and not new.is_previous and new.expires_at is None
    assert old is not None and old.is_previous and old.api_key.id == first.api_key.id
    assert old.expires_at == second.api_key.previous_expires_at
    # Rotating again ends the first secret at once; grace 0 ends the one it replaces too.
    third = tenants.rotate_api_key(session, second.api_key, grace_s=0, actor=ACTOR)
    session.commit()
    assert tenants.find_api_key(session, first.plaintext) is None
    assert tenants.find_api_key(session, second.plaintext) is None
    assert tenants.find_api_key(session, third.plaintext) is not None
    for grace in (-1, 1.5, True, tenants.MAX_ROTATION_GRACE_S + 1):
        with pytest.raises(InvalidFieldError):
            tenants.rotate_api_key(session, third.api_key, grace_s=grace, actor=ACTOR)


def test_key_name_is_checked(session: Session) -> None:
    tenant = _tenant(session)
    for name in ["", "x" * 129, None]:
        with pytest.raises(InvalidFieldError) as caught:
            tenants.create_api_key(session, tenant, name=name, actor=ACTOR)
        assert caught.value.param == "name"


def test_mark_used_sets_last_used_at(session: Session) -> None:
    tenant = _tenant(session)
    api_key = tenants.create_api_key(session, tenant, name="ci", actor=ACTOR).api_key
    assert api_key.last_used_at is None
    tenants.mark_api_key_used(session, api_key)
    session.commit()
    session.expire_all()
    assert api_key.last_used_at is not None and api_key.last_used_at.tzinfo is not None


def test_list_api_keys_per_tenant(session: Session) -> None:
    a, b = _tenant(session, "a"), _tenant(session, "b")
    for tenant, name in [(a, "one"), (a, "two"), (b, "three")]:
        tenants.create_api_key(session, tenant, name=name, actor=ACTOR)
    session.commit()
    assert [k.name for k in tenants.list_api_keys(session, tenant_id=a.id)] == ["one", "two"]
    assert len(tenants.list_api_keys(session)) == 3


def test_deleting_a_tenant_cascades_in_the_database(session: Session) -> None:
    tenant = _tenant(session)
    tenants.create_api_key(session, tenant, name="ci", actor=ACTOR)
    session.commit()
    # Core-level delete: the database's ON DELETE CASCADE (SQLite: foreign_keys pragma) acts.
    session.execute(delete(Tenant))
    session.commit()
    assert session.scalar(select(func.count()).select_from(ApiKey)) == 0
    assert session.scalar(select(func.count()).select_from(Quota)) == 0
    assert session.scalar(select(func.count()).select_from(AuditEntry)) == 2


@pytest.mark.parametrize(
    ("tenant_values", "quota_values"),
    [
        ({"weight": 0.0}, None),
        ({}, {"kv_cap_share": 1.5}),
        ({}, {"requests_per_minute": -1}),
    ],
)
def test_schema_enforces_ranges_without_the_python_checks(
    db: Engine, tenant_values: dict[str, object], quota_values: dict[str, object] | None
) -> None:
    row = {"name": "raw", "tier": "standard", "weight": 1.0, "cache_salt": "s"}
    with pytest.raises(IntegrityError), db.begin() as connection:
        inserted = connection.execute(
            insert(Tenant).values(status=TenantStatus.ACTIVE, **{**row, **tenant_values})
        )
        assert inserted.inserted_primary_key is not None
        tenant_id = inserted.inserted_primary_key[0]
        if quota_values is not None:
            connection.execute(insert(Quota).values(tenant_id=tenant_id, **quota_values))
