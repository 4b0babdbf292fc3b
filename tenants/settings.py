"""Database settings, read once from the environment into a typed object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from tenants.errors import InvalidFieldError

DATABASE_URL_ENV = "TIERGATE_DATABASE_URL"
# A file next to where the process runs: the zero-configuration default.
DEFAULT_DATABASE_URL = "sqlite:///./tiergate.db"


@dataclass(frozen=True)
class DatabaseSettings:
    """How to reach the tenants (and ledger) database."""

    # SQLAlchemy URL, e.g. sqlite:///./tiergate.db or postgresql+psycopg://user@host/db.
    url: str = DEFAULT_DATABASE_URL
    # Connections kept open per process (PostgreSQL only; SQLite files use SQLAlchemy's default).
    pool_size: int = 5
    # Extra connections allowed above pool_size under bursts (PostgreSQL only).
    max_overflow: int = 10
    # Seconds after which a pooled connection is replaced, so idle-killing proxies do no harm.
    pool_recycle_s: int = 1800
    # Seconds a SQLite writer waits for another writer's lock before failing.
    sqlite_busy_timeout_s: float = 5.0
    # PostgreSQL: seconds to open a connection, to wait for a pooled one, to wait for a lock
    # (a locked table), and the longest statement, before the call fails. What a failure
    # means is the caller's: a key lookup answers from the cache or 503, the ledger spools.
    # Statement and lock limits hold on serving (pooled) engines; migrations have none.
    connect_timeout_s: float = 5.0
    pool_timeout_s: float = 10.0
    lock_timeout_s: float = 5.0
    statement_timeout_s: float = 60.0
    # PostgreSQL: TCP keepalives on every connection (idle seconds before the first probe,
    # seconds between probes, probes lost before the connection is dropped) and the longest
    # time sent data may stay unacknowledged (tcp_user_timeout). A server gone without a
    # word (a host down, a network cut, a failover) leaves a half-open connection that would
    # otherwise hold a ledger write or a key lookup until the process restarts.
    keepalive_idle_s: int = 30
    keepalive_interval_s: int = 10
    keepalive_count: int = 3
    tcp_user_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        try:
            make_url(self.url)
        except ArgumentError as exc:
            raise InvalidFieldError(f"not a database URL: {exc}", "database_url") from None
        if self.pool_size < 1:
            raise InvalidFieldError("pool_size must be at least 1", "pool_size")
        if self.max_overflow < 0:
            raise InvalidFieldError("max_overflow must not be negative", "max_overflow")
        for name in ("connect_timeout_s", "pool_timeout_s", "lock_timeout_s",
                     "statement_timeout_s", "keepalive_idle_s", "keepalive_interval_s",
                     "keepalive_count", "tcp_user_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidFieldError(f"{name} must be positive", name)

    @property
    def is_sqlite(self) -> bool:
        return make_url(self.url).get_backend_name() == "sqlite"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DatabaseSettings:
        """TIERGATE_DATABASE_URL if set, else a SQLite file in the working directory."""
        env = os.environ if environ is None else environ
        return cls(url=env.get(DATABASE_URL_ENV) or DEFAULT_DATABASE_URL)
