"""Tenant authentication: ``Authorization: Bearer tg-...`` to a tenant, through a TTL cache.

Each process caches resolved keys by their SHA-256 for ``ttl_s`` seconds (5 s by default),
so a hot key costs one hash and one dict lookup, not a database query. A revocation or a
tenant change made through this process's admin API calls ``invalidate`` and takes effect
on the next request; one made elsewhere (another replica, the CLI) within ``ttl_s``.

401 for a missing, malformed or unknown key; 403 for a revoked key or a disabled tenant.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import anyio.to_thread
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import Request

from gateway.errors import (
    AuthenticationError,
    PermissionDeniedError,
    ServiceUnavailableError,
)
from tenants import ApiKey, find_api_key, hash_key, mark_api_key_used

DEFAULT_KEY_CACHE_TTL_S = 5.0
DEFAULT_KEY_CACHE_MAX_ENTRIES = 10_000


class MissingApiKeyError(AuthenticationError):
    default_code = "missing_api_key"


class InvalidApiKeyError(AuthenticationError):
    default_code = "invalid_api_key"


class RevokedApiKeyError(PermissionDeniedError):
    default_code = "api_key_revoked"


class TenantDisabledError(PermissionDeniedError):
    default_code = "tenant_disabled"


@dataclass(frozen=True)
class TenantQuota:
    """The tenant's limits at resolution time; None means unlimited."""

    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent_requests: int | None
    max_queued_requests: int | None
    # Share of the KV block pool, in (0, 1].
    kv_cap_share: float | None
    monthly_token_budget: int | None
    monthly_spend_budget_usd_micros: int | None


@dataclass(frozen=True)
class TenantPrincipal:
    """Who is calling: what admission and the engine need, with no database behind it."""

    tenant_id: int
    tenant_name: str
    tier: str
    # Fair-share weight inside the tier.
    weight: float
    # Mixed into prefix-cache block hashes.
    cache_salt: str
    api_key_id: int
    quota: TenantQuota


@dataclass(frozen=True)
class _CacheEntry:
    principal: TenantPrincipal
    is_revoked: bool
    is_tenant_disabled: bool
    # clock() value after which the entry is reloaded.
    expires_at: float


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class TenantKeyResolver:
    """Resolves tenant API keys, caching results per process for ttl_s seconds."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        *,
        ttl_s: float = DEFAULT_KEY_CACHE_TTL_S,
        max_entries: int = DEFAULT_KEY_CACHE_MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session_factory = session_factory
        self.ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, _CacheEntry] = OrderedDict()
        # Bumped by invalidate(): a load that started before it must not refill the cache.
        self._generation = 0
        self._lock = threading.Lock()

    async def authenticate(self, request: Request) -> TenantPrincipal:
        """The caller of request; a cache miss queries the database off the event loop."""
        plaintext, key_hash = _presented_key(request.headers.get("authorization"))
        entry = self._cached(key_hash)
        if entry is None:
            entry = await anyio.to_thread.run_sync(self._load, plaintext, key_hash)
        return _admit(entry)

    def resolve(self, authorization: str | None) -> TenantPrincipal:
        """Blocking form of authenticate, for code already off the event loop."""
        plaintext, key_hash = _presented_key(authorization)
        entry = self._cached(key_hash) or self._load(plaintext, key_hash)
        return _admit(entry)

    def invalidate(self, *, api_key_id: int | None = None, tenant_id: int | None = None) -> None:
        """Forget cached entries of a key or of all a tenant's keys (after an admin change)."""
        with self._lock:
            self._generation += 1
            stale = [
                key_hash
                for key_hash, entry in self._entries.items()
                if entry.principal.api_key_id == api_key_id
                or entry.principal.tenant_id == tenant_id
            ]
            for key_hash in stale:
                del self._entries[key_hash]

    def clear(self) -> None:
        with self._lock:
            self._generation += 1
            self._entries.clear()

    def _cached(self, key_hash: str) -> _CacheEntry | None:
        with self._lock:
            entry = self._entries.get(key_hash)
            if entry is None:
                return None
            if entry.expires_at <= self._clock():
                del self._entries[key_hash]
                return None
            self._entries.move_to_end(key_hash)
            return entry

    def _load(self, plaintext: str, key_hash: str) -> _CacheEntry:
        with self._lock:
            generation = self._generation
        try:
            with self._session_factory.begin() as session:
                api_key = find_api_key(session, plaintext)
                if api_key is None:
                    # Unknown keys are not cached: they would let anyone fill the cache.
                    raise InvalidApiKeyError("invalid API key")
                is_tenant_disabled = not api_key.tenant.is_active
                if not api_key.is_revoked and not is_tenant_disabled:
                    mark_api_key_used(session, api_key)
                entry = _CacheEntry(
                    principal=_principal(api_key),
                    is_revoked=api_key.is_revoked,
                    is_tenant_disabled=is_tenant_disabled,
                    expires_at=self._clock() + self.ttl_s,
                )
        except DBAPIError as exc:
            raise ServiceUnavailableError(
                "the tenant database is unavailable", code="database_unavailable"
            ) from exc
        with self._lock:
            if generation == self._generation:
                self._entries[key_hash] = entry
                while len(self._entries) > self._max_entries:
                    self._entries.popitem(last=False)
        return entry


def _presented_key(authorization: str | None) -> tuple[str, str]:
    plaintext = bearer_token(authorization)
    if plaintext is None:
        raise MissingApiKeyError("missing API key: send it as 'Authorization: Bearer <key>'")
    return plaintext, hash_key(plaintext)


def _admit(entry: _CacheEntry) -> TenantPrincipal:
    if entry.is_revoked:
        raise RevokedApiKeyError("this API key has been revoked")
    if entry.is_tenant_disabled:
        raise TenantDisabledError("this tenant is disabled")
    return entry.principal


def _principal(api_key: ApiKey) -> TenantPrincipal:
    tenant, quota = api_key.tenant, api_key.tenant.quota
    return TenantPrincipal(
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        tier=tenant.tier,
        weight=tenant.weight,
        cache_salt=tenant.cache_salt,
        api_key_id=api_key.id,
        quota=TenantQuota(
            requests_per_minute=quota.requests_per_minute,
            tokens_per_minute=quota.tokens_per_minute,
            max_concurrent_requests=quota.max_concurrent_requests,
            max_queued_requests=quota.max_queued_requests,
            kv_cap_share=quota.kv_cap_share,
            monthly_token_budget=quota.monthly_token_budget,
            monthly_spend_budget_usd_micros=quota.monthly_spend_budget_usd_micros,
        ),
    )
