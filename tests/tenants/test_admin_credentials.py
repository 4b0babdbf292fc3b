"""Admin credentials in the database (SQLite and PostgreSQL): the secret's shape, only its
prefix and hash stored, lookup by secret, revocation, validation, audit entries."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy.orm import Session

import tenants
from tenants import AdminRole

_PREFIX_LENGTH = len("tga-") + 8


def test_a_credential_stores_its_prefix_and_hash_never_its_secret(
    session: Session, stored_values: Callable[[], list[tuple[str, str, str]]]
) -> None:
    created = tenants.create_admin_credential(session, name="alice", role="operator",
                                              actor="cli:root")
    session.commit()
    secret, credential = created.plaintext, created.credential
    assert secret.startswith("tga-") and not tenants.looks_like_key(secret)
    assert tenants.looks_like_admin_secret(secret)
    assert credential.prefix == secret[:_PREFIX_LENGTH] == tenants.admin_secret_prefix(secret)
    assert (credential.name, credential.role) == ("alice", AdminRole.OPERATOR)
    assert credential.key_hash == tenants.hash_key(secret)
    values = stored_values()
    assert any(credential.prefix == v for t, _, v in values if t == "admin_credentials")
    tail = secret[_PREFIX_LENGTH + 1:]
    assert [(t, c) for t, c, v in values if secret in v or tail in v] == []


def test_find_by_secret(session: Session) -> None:
    created = tenants.create_admin_credential(session, name="ci", role="read-only", actor="t")
    secret = created.plaintext
    assert tenants.find_admin_credential(session, secret) is created.credential
    wrong_tail = secret[:-1] + ("a" if secret[-1] != "a" else "b")
    for presented in (wrong_tail, "tga-short", "tg-abcdefgh_" + "x" * 43, secret.upper()):
        assert tenants.find_admin_credential(session, presented) is None


def test_revoke_is_idempotent_and_audited(session: Session) -> None:
    assert not tenants.has_active_admin_credentials(session)
    credential = tenants.create_admin_credential(session, name="bob", role="owner",
                                                 actor="cli:root").credential
    assert tenants.has_active_admin_credentials(session)
    revoked = tenants.revoke_admin_credential(session, credential, actor="cli:root")
    first_revoked_at = revoked.revoked_at
    assert first_revoked_at is not None and not tenants.has_active_admin_credentials(session)
    tenants.revoke_admin_credential(session, credential, actor="cli:root")
    assert credential.revoked_at == first_revoked_at
    entries = tenants.list_audit_entries(session, target_type="admin_credential")
    assert [e.action for e in entries] == ["admin_credential.revoke", "admin_credential.create"]
    assert entries[0].before is not None and entries[0].before["revoked_at"] is None
    assert entries[0].after is not None and entries[0].after["revoked_at"] is not None
    assert all("key_hash" not in (e.after or {}) for e in entries)
    assert [c.id for c in tenants.list_admin_credentials(session, include_revoked=False)] == []
    assert [c.id for c in tenants.list_admin_credentials(session)] == [credential.id]


@pytest.mark.parametrize(("fields", "param"), [
    ({"name": "x", "role": "admin"}, "role"),
    ({"name": "x", "role": None}, "role"),
    ({"name": "", "role": "owner"}, "name"),
    ({"name": "a\nb", "role": "owner"}, "name"),
    ({"name": "x" * 129, "role": "owner"}, "name"),
])
def test_invalid_fields_are_refused(session: Session, fields: dict[str, object],
                                    param: str) -> None:
    with pytest.raises(tenants.InvalidFieldError) as raised:
        tenants.create_admin_credential(session, actor="t", **fields)  # type: ignore[arg-type]
    assert raised.value.param == param


def test_an_unknown_id_is_not_found(session: Session) -> None:
    with pytest.raises(tenants.AdminCredentialNotFoundError):
        tenants.get_admin_credential(session, 424242)
