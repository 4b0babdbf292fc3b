"""Admin credentials: their secret's format, and every read and write of them.

A secret reads ``tga-<8 lowercase letters/digits>_<43 urlsafe characters>``: "tga-" keeps it
apart from tenant keys ("tg-"), which never open admin routes; the part up to the underscore
is the public lookup prefix (shown in listings). As for tenant keys, only the prefix and the
SHA-256 of the whole secret are stored: 256 random bits need no slow hash.

Functions flush but never commit (the caller owns the transaction); creating and revoking
record an audit entry (target_type "admin_credential") in the same transaction.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tenants.errors import AdminCredentialNotFoundError, InvalidFieldError
from tenants.keys import hash_key, verify_key
from tenants.models import AdminCredential, AdminRole, AuditEntry, utc_now
from tenants.validation import validate_row_id

ADMIN_SECRET_PREFIX = "tga-"
_LOOKUP_ID_LENGTH = 8
_SECRET_NUM_BYTES = 32
_LOOKUP_ALPHABET = string.ascii_lowercase + string.digits
_SEPARATOR = "_"
_PREFIX_LENGTH = len(ADMIN_SECRET_PREFIX) + _LOOKUP_ID_LENGTH
_MAX_NAME_LENGTH = 128
_MAX_PREFIX_ATTEMPTS = 5


@dataclass(frozen=True)
class CreatedAdminCredential:
    """A new credential row and its secret, which exists only here and is never stored."""

    credential: AdminCredential
    plaintext: str


def looks_like_admin_secret(value: str) -> bool:
    """True for anything shaped like an admin credential's secret (as opposed to the
    deployment's TIERGATE_ADMIN_TOKEN)."""
    return value.startswith(ADMIN_SECRET_PREFIX)


def admin_secret_prefix(plaintext: str) -> str | None:
    """The stored prefix of a well-formed admin secret, or None when it cannot be one."""
    if not plaintext.startswith(ADMIN_SECRET_PREFIX) or len(plaintext) <= _PREFIX_LENGTH + 1:
        return None
    prefix = plaintext[:_PREFIX_LENGTH]
    lookup_id = prefix[len(ADMIN_SECRET_PREFIX):]
    if plaintext[_PREFIX_LENGTH] != _SEPARATOR or any(
            c not in _LOOKUP_ALPHABET for c in lookup_id):
        return None
    return prefix


def create_admin_credential(session: Session, *, name: object, role: object,
                            actor: str) -> CreatedAdminCredential:
    """A new credential; the caller shows CreatedAdminCredential.plaintext once and drops it."""
    if not isinstance(name, str) or not 1 <= len(name) <= _MAX_NAME_LENGTH or (
            not name.isprintable()):
        raise InvalidFieldError(
            f"name must be 1-{_MAX_NAME_LENGTH} printable characters", "name")
    if role not in {r.value for r in AdminRole}:
        choices = ", ".join(r.value for r in AdminRole)
        raise InvalidFieldError(f"role must be one of: {choices}", "role")
    clean_role = AdminRole(str(role))
    prefix, plaintext = _free_secret(session)
    credential = AdminCredential(name=name, role=clean_role, prefix=prefix,
                                 key_hash=hash_key(plaintext))
    session.add(credential)
    session.flush()
    _audit(session, credential, actor=actor, action="admin_credential.create", before=None)
    return CreatedAdminCredential(credential=credential, plaintext=plaintext)


def get_admin_credential(session: Session, credential_id: int) -> AdminCredential:
    credential = session.get(AdminCredential, validate_row_id(credential_id, "credential_id"))
    if credential is None:
        raise AdminCredentialNotFoundError(f"no admin credential with id {credential_id}")
    return credential


def list_admin_credentials(session: Session, *,
                           include_revoked: bool = True) -> list[AdminCredential]:
    query = select(AdminCredential).order_by(AdminCredential.id)
    if not include_revoked:
        query = query.where(AdminCredential.revoked_at.is_(None))
    return list(session.scalars(query))


def has_active_admin_credentials(session: Session) -> bool:
    """Whether any credential is unrevoked: the admin API is on while one is (or while the
    deployment's admin token is set)."""
    query = select(AdminCredential.id).where(AdminCredential.revoked_at.is_(None)).limit(1)
    return session.scalars(query).first() is not None


def revoke_admin_credential(session: Session, credential: AdminCredential, *,
                            actor: str) -> AdminCredential:
    """Revoke a credential; revoking a revoked one changes nothing and records nothing."""
    if credential.is_revoked:
        return credential
    before = admin_credential_snapshot(credential)
    credential.revoked_at = utc_now()
    session.flush()
    _audit(session, credential, actor=actor, action="admin_credential.revoke", before=before)
    return credential


def find_admin_credential(session: Session, plaintext: str) -> AdminCredential | None:
    """The credential (revoked or not) whose secret this is, or None. Looks up by the public
    prefix, then compares hashes in constant time: the secret never reaches the database."""
    prefix = admin_secret_prefix(plaintext)
    if prefix is None:
        return None
    query = select(AdminCredential).where(AdminCredential.prefix == prefix)
    credential = session.scalars(query).one_or_none()
    if credential is None or not verify_key(plaintext, credential.key_hash):
        return None
    return credential


def mark_admin_credential_used(session: Session, credential: AdminCredential) -> None:
    credential.last_used_at = utc_now()
    session.flush()


def admin_credential_snapshot(credential: AdminCredential) -> dict[str, Any]:
    """The JSON-ready view (listings, audit before/after); never the hash."""
    return {
        "id": credential.id,
        "name": credential.name,
        "role": credential.role.value,
        "prefix": credential.prefix,
        "created_at": _iso(credential.created_at),
        "revoked_at": _iso(credential.revoked_at),
        "last_used_at": _iso(credential.last_used_at),
    }


def _iso(value: Any) -> str | None:
    return None if value is None else str(value.isoformat())


def _free_secret(session: Session) -> tuple[str, str]:
    """(prefix, plaintext) of a new secret whose prefix no credential uses."""
    for _ in range(_MAX_PREFIX_ATTEMPTS):
        lookup_id = "".join(secrets.choice(_LOOKUP_ALPHABET) for _ in range(_LOOKUP_ID_LENGTH))
        prefix = ADMIN_SECRET_PREFIX + lookup_id
        taken = session.scalars(
            select(AdminCredential.id).where(AdminCredential.prefix == prefix)).first()
        if taken is None:
            return prefix, prefix + _SEPARATOR + secrets.token_urlsafe(_SECRET_NUM_BYTES)
    # 36**8 prefixes: reaching this means the random source is broken.
    raise AssertionError("could not find a free admin credential prefix")


def _audit(session: Session, credential: AdminCredential, *, actor: str, action: str,
           before: dict[str, Any] | None) -> None:
    session.add(AuditEntry(actor=actor, action=action, target_type="admin_credential",
                           target_id=str(credential.id), before=before,
                           after=admin_credential_snapshot(credential)))
    session.flush()
