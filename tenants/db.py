"""Engines and sessions for SQLite and PostgreSQL from one URL; the same code serves both."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from tenants.settings import DatabaseSettings


def create_db_engine(settings: DatabaseSettings, *, pooled: bool = True) -> Engine:
    """An engine for settings.url. pooled=False opens one connection per use (CLI, migrations)."""
    url = make_url(settings.url)
    kwargs: dict[str, Any] = {}
    is_postgresql = url.get_backend_name() == "postgresql"
    if is_postgresql:
        kwargs["connect_args"] = _postgresql_timeouts(settings, with_statement_limits=pooled)
    if not pooled:
        kwargs["poolclass"] = NullPool
    elif is_postgresql:
        kwargs.update(
            pool_size=settings.pool_size,
            max_overflow=settings.max_overflow,
            pool_recycle=settings.pool_recycle_s,
            pool_timeout=settings.pool_timeout_s,
            pool_pre_ping=True,
        )
    engine = create_engine(url, **kwargs)
    if url.get_backend_name() == "sqlite":
        _configure_sqlite(engine, busy_timeout_s=settings.sqlite_busy_timeout_s)
    return engine


def _postgresql_timeouts(
    settings: DatabaseSettings, *, with_statement_limits: bool
) -> dict[str, Any]:
    # libpq counts connect_timeout in whole seconds (and uses at least 2).
    connect_args: dict[str, Any] = {
        "connect_timeout": max(2, math.ceil(settings.connect_timeout_s)),
        # A peer that vanished is found by the kernel, not waited for (DatabaseSettings).
        "keepalives": 1,
        "keepalives_idle": settings.keepalive_idle_s,
        "keepalives_interval": settings.keepalive_interval_s,
        "keepalives_count": settings.keepalive_count,
        "tcp_user_timeout": _ms(settings.tcp_user_timeout_s),
    }
    if with_statement_limits:
        connect_args["options"] = (
            f"-c lock_timeout={_ms(settings.lock_timeout_s)}"
            f" -c statement_timeout={_ms(settings.statement_timeout_s)}"
        )
    return connect_args


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _configure_sqlite(engine: Engine, *, busy_timeout_s: float) -> None:
    # WAL lets readers (key lookups) proceed while a writer (ledger, admin) commits;
    # SQLite enforces foreign keys (ON DELETE CASCADE) only when asked, per connection.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        finally:
            cursor.close()


def create_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes readable after commit (rows are then serialised)."""
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(settings: DatabaseSettings) -> Iterator[Session]:
    """One transaction on a short-lived engine: commit on success, roll back on error."""
    engine = create_db_engine(settings, pooled=False)
    try:
        with create_session_factory(engine).begin() as session:
            yield session
    finally:
        engine.dispose()
