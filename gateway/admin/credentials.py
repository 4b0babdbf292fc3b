"""Admin credentials as the admin API sees them: who is asking (AdminPrincipal), and a short
per-process cache of the database's credentials.

Replicas share the database, so a credential minted or revoked with the CLI (or on another
replica) reaches this one through its cache: each lookup is kept ``ttl_s`` seconds (5 s by
default), and a revocation takes effect on every replica within that time. Entries are keyed
by the SHA-256 of the secret presented, never by the secret; the secret itself never reaches
the database (tenants.find_admin_credential looks up by the public prefix, compares hashes)
and is never logged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeVar

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

import tenants
from gateway.http.errors import ServiceUnavailableError
from tenants import AdminRole

__all__ = [
    "DEFAULT_ADMIN_CACHE_TTL_S",
    "ENV_CREDENTIAL_NAME",
    "AdminCredentialCache",
    "AdminPrincipal",
    "CredentialLookup",
]

DEFAULT_ADMIN_CACHE_TTL_S = 5.0
# The name the deployment's TIERGATE_ADMIN_TOKEN goes by: an owner credential with no row.
ENV_CREDENTIAL_NAME: Final = "env"
# Secrets remembered at once (known and unknown); past this, expired entries are dropped,
# and if none has expired the table starts over (a flood of made-up secrets cannot grow it).
_MAX_ENTRIES = 4096


@dataclass(frozen=True)
class AdminPrincipal:
    """The admin credential a request was authenticated with."""

    # The admin_credentials row; None for the deployment's TIERGATE_ADMIN_TOKEN.
    credential_id: int | None
    # The credential's name ("env" for the token).
    name: str
    role: AdminRole

    def actor(self, client_host: str) -> str:
        """The audit log's actor: "admin:<id>:<name>" for a credential; the token names no
        one, so its changes keep naming the client's address ("admin-api:<address>")."""
        if self.credential_id is None:
            return f"admin-api:{client_host}"
        return f"admin:{self.credential_id}:{self.name}"


@dataclass(frozen=True)
class CredentialLookup:
    """What the database says of a presented secret."""

    # The credential if it exists and is not revoked.
    principal: AdminPrincipal | None
    # The secret is a credential's, revoked.
    is_revoked: bool


_UNKNOWN = CredentialLookup(principal=None, is_revoked=False)
T = TypeVar("T")


@dataclass(frozen=True)
class _Entry:
    lookup: CredentialLookup
    expires_at: float


@dataclass(frozen=True)
class _Existence:
    has_credentials: bool
    expires_at: float


class AdminCredentialCache:
    """Looks admin secrets up in the database, remembering each answer for ttl_s seconds."""

    def __init__(self, session_factory: sessionmaker[Session], *,
                 ttl_s: float = DEFAULT_ADMIN_CACHE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._session_factory = session_factory
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._existence: _Existence | None = None

    async def lookup(self, secret: str) -> CredentialLookup:
        secret_hash = tenants.hash_key(secret)
        now = self._clock()
        entry = self._entries.get(secret_hash)
        if entry is None or entry.expires_at <= now:
            lookup = await run_in_threadpool(self._load, secret)
            self._remember(secret_hash, _Entry(lookup, self._clock() + self.ttl_s))
            return lookup
        return entry.lookup

    async def has_credentials(self) -> bool:
        """Whether any unrevoked credential exists (as of at most ttl_s ago)."""
        existence = self._existence
        if existence is None or existence.expires_at <= self._clock():
            exists = await run_in_threadpool(self._query, tenants.has_active_admin_credentials)
            existence = _Existence(exists, self._clock() + self.ttl_s)
            self._existence = existence
        return existence.has_credentials

    def clear(self) -> None:
        """Forget every answer (tests; a process that just revoked a credential)."""
        self._entries.clear()
        self._existence = None

    def _load(self, secret: str) -> CredentialLookup:
        def work(session: Session) -> CredentialLookup:
            credential = tenants.find_admin_credential(session, secret)
            if credential is None:
                return _UNKNOWN
            if credential.is_revoked:
                return CredentialLookup(principal=None, is_revoked=True)
            tenants.mark_admin_credential_used(session, credential)
            return CredentialLookup(
                AdminPrincipal(credential.id, credential.name, credential.role),
                is_revoked=False)

        return self._query(work, write=True)

    def _query(self, work: Callable[[Session], T], *, write: bool = False) -> T:
        try:
            if write:
                with self._session_factory.begin() as session:
                    return work(session)
            with self._session_factory() as session:
                return work(session)
        except SQLAlchemyError as exc:
            raise ServiceUnavailableError(
                f"the database is unavailable: {exc.__class__.__name__}",
                code="database_unavailable") from exc

    def _remember(self, secret_hash: str, entry: _Entry) -> None:
        if len(self._entries) >= _MAX_ENTRIES:
            now = self._clock()
            self._entries = {k: e for k, e in self._entries.items() if e.expires_at > now}
            if len(self._entries) >= _MAX_ENTRIES:
                self._entries.clear()
        self._entries[secret_hash] = entry
