"""Tenant authentication: ``Authorization: Bearer tg-...`` to a tenant, through a TTL cache.

Each process caches resolved keys by their SHA-256 for ``ttl_s`` seconds (5 s by default),
so a hot key costs one hash and one dict lookup, not a database query. A request that finds
its entry in the last fifth of its life is answered from it and starts a reload in the
background (one at a time per key, on the resolver's own thread), so a key in steady use never
waits for the database: only a key unseen for most of ``ttl_s`` does. A revocation or a
tenant change made through this process's admin API calls ``invalidate`` and takes effect
on the next request; one made elsewhere (another replica, the CLI) within ``ttl_s``: no
answer older than that is served while the database answers.

While the database is unreachable, a key this process resolved within the last
``max_stale_s`` seconds keeps its last answer (and the database is tried again every
``ttl_s``), so a database outage does not turn away tenants already known here; an unknown
or long-unseen key gets 503. A lookup a request waits for is waited for at most
``lookup_timeout_s``: a database that accepts and never answers (stopped, partitioned) is an
outage like any other, the lookup left to finish on its thread (its answer still fills the
cache); while MAX_STUCK_LOOKUPS such lookups run, no new one starts. Recording
``last_used_at`` is best effort: a database that answers reads but refuses writes (a locked
SQLite file) does not fail authentication.

Unknown keys cost the database at most one query each per ``ttl_s``: a key that cannot be
one of ours (wrong shape) is refused without a query; a well-formed key the database does
not know is remembered as unknown for ``ttl_s`` (in a bounded table of its own: it never
displaces known keys). Keys this process has no entry for at all wait for one of
``first_sight_lookups`` database lookups at a time, and past ``first_sight_waiting`` such
requests waiting, get 503 ``auth_overloaded`` at once: a flood of random well-formed keys
holds a few database connections, not the pool every tenant's reloads need.

401 for a missing, malformed or unknown key; 403 for a revoked key or a disabled tenant.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import anyio
import anyio.to_thread
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import Request

from gateway.http.errors import (
    AuthenticationError,
    PermissionDeniedError,
    ServiceUnavailableError,
)
from tenants import (
    ApiKey,
    CallTimedOut,
    DeadlineCalls,
    find_api_key,
    hash_key,
    lookup_prefix,
    mark_api_key_used,
)

DEFAULT_KEY_CACHE_TTL_S = 5.0
# How long after its last successful lookup a key is still served while the database is down.
DEFAULT_KEY_MAX_STALE_S = 900.0
DEFAULT_KEY_CACHE_MAX_ENTRIES = 10_000
# Database lookups at once for keys this process has no entry for, and how many such
# requests may wait for one before the rest get 503.
DEFAULT_FIRST_SIGHT_LOOKUPS = 4
DEFAULT_FIRST_SIGHT_WAITING = 256
# Longest a request waits for a key lookup, and how many lookups past it may still run
# before requests stop starting new ones.
DEFAULT_LOOKUP_TIMEOUT_S = 1.0
MAX_STUCK_LOOKUPS = 4
# The last part of an entry's life (a fraction of ttl_s) in which the next request using it
# reloads it in the background.
_REFRESH_AHEAD_FRACTION_OF_TTL = 0.2

logger = logging.getLogger(__name__)


class MissingApiKeyError(AuthenticationError):
    default_code = "missing_api_key"


class InvalidApiKeyError(AuthenticationError):
    default_code = "invalid_api_key"


class RevokedApiKeyError(PermissionDeniedError):
    default_code = "api_key_revoked"


class ExpiredApiKeyError(AuthenticationError):
    default_code = "api_key_expired"


class TenantDisabledError(PermissionDeniedError):
    default_code = "tenant_disabled"


@dataclass(frozen=True)
class TenantQuota:
    """The tenant's limits at resolution time; None means unlimited."""

    requests_per_minute: int | None
    tokens_per_minute: int | None
    # Bucket capacities; None: one minute's worth of the rate.
    burst_requests: int | None
    burst_tokens: int | None
    max_concurrent_requests: int | None
    max_queued_requests: int | None
    # Share of the KV block pool, in (0, 1].
    kv_cap_share: float | None
    monthly_token_budget: int | None
    monthly_spend_budget_usd_micros: int | None


@dataclass(frozen=True)
class KeyQuota:
    """The API key's own limits at resolution time, inside its tenant's; None: only the
    tenant's limit applies."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    monthly_token_budget: int | None = None
    monthly_spend_budget_usd_micros: int | None = None


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
    # The served models its requests may name (adapters of them included); None: every one.
    allowed_models: frozenset[str] | None = None
    # The key's own limits, binding before the tenant's (both apply).
    key_quota: KeyQuota = KeyQuota()

    def may_use(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


@dataclass(frozen=True)
class _CacheEntry:
    principal: TenantPrincipal
    is_revoked: bool
    is_tenant_disabled: bool
    # When the presented secret stops working (wall time, UTC): the key's expiry, or the end
    # of the grace of a secret replaced by a rotation; None: never.
    key_expires_at: datetime | None
    is_previous_secret: bool
    # clock() value after which the entry is not used (but kept for a database outage).
    expires_at: float
    # clock() value of the database lookup it came from (bounds its use during an outage).
    loaded_at: float


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
        max_stale_s: float = DEFAULT_KEY_MAX_STALE_S,
        max_entries: int = DEFAULT_KEY_CACHE_MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
        first_sight_lookups: int = DEFAULT_FIRST_SIGHT_LOOKUPS,
        first_sight_waiting: int = DEFAULT_FIRST_SIGHT_WAITING,
        lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
    ) -> None:
        self._session_factory = session_factory
        self._lookup_timeout_s = lookup_timeout_s
        self._lookups = DeadlineCalls("key-lookup", MAX_STUCK_LOOKUPS)
        self.ttl_s = ttl_s
        self.max_stale_s = max_stale_s
        self._max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, _CacheEntry] = OrderedDict()
        # Bumped by invalidate(): a load that started before it must not refill the cache.
        self._generation = 0
        self._lock = threading.Lock()
        # Background reloads by key hash, while they run; one thread does them in turn.
        self._refreshes: dict[str, Future[None]] = {}
        self._refresher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="key-refresh")
        self._closed = False
        # Well-formed keys the database did not know: key hash -> clock() until which that
        # answer stands (bounded like the entries, oldest dropped first).
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self._first_sight_lookups = first_sight_lookups
        self._first_sight_waiting = first_sight_waiting
        self._first_sight_limiter: anyio.CapacityLimiter | None = None  # made in the loop
        self._num_first_sight_waiting = 0  # touched on the event loop only

    @property
    def num_lookups_stuck(self) -> int:
        """Key lookups still running after their request stopped waiting for them."""
        return self._lookups.num_stuck

    async def authenticate(self, request: Request) -> TenantPrincipal:
        """The caller of request; a cache miss queries the database off the event loop."""
        plaintext, key_hash = _presented_key(request.headers.get("authorization"))
        entry = self._cached(plaintext, key_hash)
        if entry is None:
            self._refuse_known_unknown(plaintext, key_hash)
            with self._lock:
                seen = key_hash in self._entries  # expired: a key known here, reloaded
            if seen:
                entry = await self._load_in_time(plaintext, key_hash)
            else:
                entry = await self._first_sight(plaintext, key_hash)
        return _admit(entry)

    async def _first_sight(self, plaintext: str, key_hash: str) -> _CacheEntry:
        """A key with no entry here: looked up among a bounded few at a time."""
        if self._num_first_sight_waiting >= self._first_sight_waiting:
            raise ServiceUnavailableError(
                "too many requests with API keys this server has not seen yet; retry shortly",
                code="auth_overloaded", headers={"retry-after": "1"},
            )
        if self._first_sight_limiter is None:
            self._first_sight_limiter = anyio.CapacityLimiter(self._first_sight_lookups)
        self._num_first_sight_waiting += 1
        try:
            async with self._first_sight_limiter:
                # Another request with the same key may have answered it meanwhile.
                entry = self._cached(plaintext, key_hash)
                if entry is not None:
                    return entry
                self._refuse_known_unknown(plaintext, key_hash)
                return await self._load_in_time(plaintext, key_hash)
        finally:
            self._num_first_sight_waiting -= 1

    async def _load_in_time(self, plaintext: str, key_hash: str) -> _CacheEntry:
        """_load waited for at most lookup_timeout_s (tenants.DeadlineCalls); past it, the
        key's last answer or 503 (the lookup goes on, counted stuck until it returns)."""
        try:
            return await self._lookups.acall(
                lambda _abandoned: self._load(plaintext, key_hash), self._lookup_timeout_s
            )
        except CallTimedOut as timed_out:
            entry = self._cached(plaintext, key_hash)  # it may have ended as the wait did
            return entry if entry is not None else self._stale_fallback(key_hash, timed_out)

    def _refuse_known_unknown(self, plaintext: str, key_hash: str) -> None:
        """401 without a query for a key that cannot be ours or that the database did not
        know within ttl_s."""
        if lookup_prefix(plaintext) is None:
            raise InvalidApiKeyError("invalid API key")
        with self._lock:
            until = self._unknown.get(key_hash)
            if until is not None and until > self._clock():
                raise InvalidApiKeyError("invalid API key")

    def resolve(self, authorization: str | None) -> TenantPrincipal:
        """Blocking form of authenticate, for code already off the event loop."""
        plaintext, key_hash = _presented_key(authorization)
        entry = self._cached(plaintext, key_hash)
        if entry is None:
            self._refuse_known_unknown(plaintext, key_hash)
            entry = self._load(plaintext, key_hash)
        return _admit(entry)

    def principal_of_key(self, api_key_id: int) -> TenantPrincipal:
        """The principal of a key by its id, read from the database now (blocking): what a
        batch its key created runs as. A key revoked or expired since, or whose tenant is
        disabled, raises as authenticate would; a deleted one is an InvalidApiKeyError."""
        with self._session_factory() as session:
            api_key = session.get(ApiKey, api_key_id)
            if api_key is None:
                raise InvalidApiKeyError("the API key no longer exists")
            entry = _CacheEntry(
                principal=_principal(api_key), is_revoked=api_key.is_revoked,
                is_tenant_disabled=not api_key.tenant.is_active,
                key_expires_at=api_key.expires_at, is_previous_secret=False,
                expires_at=0.0, loaded_at=0.0)
        return _admit(entry)

    def wait_for_refreshes(self, timeout_s: float | None = None) -> None:
        """Block until the background reloads started so far have ended."""
        with self._lock:
            pending = list(self._refreshes.values())
        for future in pending:
            future.exception(timeout=timeout_s)

    def close(self) -> None:
        """Stop the background reloads (those already started finish first); the cache still
        answers, a due entry is then reloaded only when it expires."""
        with self._lock:
            self._closed = True
        self._refresher.shutdown(wait=True)

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
            self._unknown.clear()

    def _cached(self, plaintext: str, key_hash: str) -> _CacheEntry | None:
        """The entry if it has not expired, reloading it in the background when it is due.
        Expired entries stay (until replaced or evicted) as the fallback of a lookup the
        database cannot answer."""
        with self._lock:
            entry = self._entries.get(key_hash)
            now = self._clock()
            if entry is None or entry.expires_at <= now:
                return None
            self._entries.move_to_end(key_hash)
            is_due = entry.expires_at - now <= self.ttl_s * _REFRESH_AHEAD_FRACTION_OF_TTL
            if is_due and not self._closed and key_hash not in self._refreshes:
                # _refresh takes the lock to end: it cannot end before this line is done.
                self._refreshes[key_hash] = self._refresher.submit(
                    self._refresh, plaintext, key_hash
                )
            return entry

    def _refresh(self, plaintext: str, key_hash: str) -> None:
        """A background reload: its answer replaces the entry (`_load`). A key that no longer
        exists loses its entry, so its next request is refused at once."""
        try:
            self._load(plaintext, key_hash)
        except InvalidApiKeyError:
            with self._lock:
                self._entries.pop(key_hash, None)
        except ServiceUnavailableError:
            pass  # the entry stays until it expires; the next lookup after that answers 503
        except Exception:
            logger.exception("background reload of an API key failed")
        finally:
            with self._lock:
                self._refreshes.pop(key_hash, None)

    def _load(self, plaintext: str, key_hash: str) -> _CacheEntry:
        with self._lock:
            generation = self._generation
        try:
            entry = self._lookup(plaintext)
        except DBAPIError as exc:
            entry = self._stale_fallback(key_hash, exc)
        except InvalidApiKeyError:
            with self._lock:
                self._unknown[key_hash] = self._clock() + self.ttl_s
                self._unknown.move_to_end(key_hash)
                while len(self._unknown) > self._max_entries:
                    self._unknown.popitem(last=False)
            raise
        with self._lock:
            if generation == self._generation:
                self._entries[key_hash] = entry
                self._entries.move_to_end(key_hash)
                while len(self._entries) > self._max_entries:
                    self._entries.popitem(last=False)
        return entry

    def _lookup(self, plaintext: str) -> _CacheEntry:
        with self._session_factory() as session:
            match = find_api_key(session, plaintext)
            if match is None:
                # Remembered apart (_unknown, by _load): never among the known keys.
                raise InvalidApiKeyError("invalid API key")
            api_key, now = match.api_key, self._clock()
            entry = _CacheEntry(
                principal=_principal(api_key),
                is_revoked=api_key.is_revoked,
                is_tenant_disabled=not api_key.tenant.is_active,
                key_expires_at=match.expires_at,
                is_previous_secret=match.is_previous,
                expires_at=now + self.ttl_s,
                loaded_at=now,
            )
            if not (entry.is_revoked or entry.is_tenant_disabled or (
                    match.expires_at is not None and datetime.now(UTC) >= match.expires_at)):
                try:
                    mark_api_key_used(session, api_key)
                    session.commit()
                except DBAPIError as exc:
                    session.rollback()
                    logger.warning(
                        "last_used_at of API key %d not recorded: %s",
                        api_key.id,
                        type(exc).__name__,
                    )
        return entry

    def _stale_fallback(self, key_hash: str, error: Exception) -> _CacheEntry:
        """The key's last answer while the database cannot give one, or 503."""
        now = self._clock()
        with self._lock:
            stale = self._entries.get(key_hash)
        if stale is None or now - stale.loaded_at > self.max_stale_s:
            raise ServiceUnavailableError(
                "the tenant database is unavailable", code="database_unavailable"
            ) from error
        logger.warning(
            "tenant database unavailable (%s): API key %d keeps its answer from %.0f s ago",
            type(error).__name__,
            stale.principal.api_key_id,
            now - stale.loaded_at,
        )
        # Ask the database again after another ttl_s (from a request near the end of it, in
        # the background), not on every request.
        return replace(stale, expires_at=now + self.ttl_s)


def _presented_key(authorization: str | None) -> tuple[str, str]:
    plaintext = bearer_token(authorization)
    if plaintext is None:
        raise MissingApiKeyError("missing API key: send it as 'Authorization: Bearer <key>'")
    return plaintext, hash_key(plaintext)


def _admit(entry: _CacheEntry) -> TenantPrincipal:
    if entry.is_revoked:
        raise RevokedApiKeyError("this API key has been revoked")
    expiry = entry.key_expires_at
    if expiry is not None and datetime.now(UTC) >= expiry:
        when = expiry.isoformat(timespec="seconds")
        if entry.is_previous_secret:
            raise ExpiredApiKeyError(
                f"this API key was rotated and its old secret expired at {when}; use the new "
                "one")
        raise ExpiredApiKeyError(f"this API key expired at {when}; ask for a new one")
    if entry.is_tenant_disabled:
        raise TenantDisabledError("this tenant is disabled")
    return entry.principal


def _allowed_models(tenant_models: list[str] | None,
                    key_models: list[str] | None) -> frozenset[str] | None:
    """What a key may use: its own list within its tenant's (None, either: no limit there)."""
    if tenant_models is None:
        return None if key_models is None else frozenset(key_models)
    if key_models is None:
        return frozenset(tenant_models)
    return frozenset(tenant_models) & frozenset(key_models)


def _principal(api_key: ApiKey) -> TenantPrincipal:
    tenant, quota = api_key.tenant, api_key.tenant.quota
    return TenantPrincipal(
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        tier=tenant.tier,
        weight=tenant.weight,
        cache_salt=tenant.cache_salt,
        api_key_id=api_key.id,
        allowed_models=_allowed_models(tenant.allowed_models, api_key.allowed_models),
        key_quota=KeyQuota(
            requests_per_minute=api_key.requests_per_minute,
            tokens_per_minute=api_key.tokens_per_minute,
            monthly_token_budget=api_key.monthly_token_budget,
            monthly_spend_budget_usd_micros=api_key.monthly_spend_budget_usd_micros,
        ),
        quota=TenantQuota(
            requests_per_minute=quota.requests_per_minute,
            tokens_per_minute=quota.tokens_per_minute,
            burst_requests=quota.burst_requests,
            burst_tokens=quota.burst_tokens,
            max_concurrent_requests=quota.max_concurrent_requests,
            max_queued_requests=quota.max_queued_requests,
            kv_cap_share=quota.kv_cap_share,
            monthly_token_budget=quota.monthly_token_budget,
            monthly_spend_budget_usd_micros=quota.monthly_spend_budget_usd_micros,
        ),
    )
