"""Billing test fixtures: the database fixtures of tests/tenants/conftest.py (SQLite and
PostgreSQL, real migrations), plus a database of one test's own that the test can take down.

pytest shares conftest fixtures only down a folder tree, so this re-exports those fixtures
rather than keeping a second copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

import migrations
from tenants import DatabaseSettings, create_db_engine, create_session_factory
from tests.tenants.conftest import (
    BACKENDS,
    POSTGRES_URL,
    database_url,
    db,
    engine,
    fresh_database_url,
    scratch_database,
    session,
    session_factory,
)

__all__ = [
    "database_url",
    "db",
    "engine",
    "fresh_database_url",
    "session",
    "session_factory",
]


class DatabaseOutage:
    """Makes a real database unreachable and reachable again, for the ledger's clients.

    SQLite: the database's folder is renamed away, so opening it fails ("unable to open
    database file"), and renamed back. PostgreSQL: the database stops accepting connections
    (ALLOW_CONNECTIONS false, which binds superusers too) and its open sessions are
    terminated; then it accepts them again. The shared server itself keeps running.
    """

    def __init__(self, url: str) -> None:
        self._url = make_url(url)
        self.is_down = False

    def stop(self) -> None:
        if self._url.get_backend_name() == "sqlite":
            folder = Path(str(self._url.database)).parent
            folder.rename(folder.with_name(folder.name + "-away"))
        else:
            name = self._url.database
            self._admin(
                f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false',
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                f" WHERE datname = '{name}' AND pid <> pg_backend_pid()",
            )
        self.is_down = True

    def resume(self) -> None:
        if self._url.get_backend_name() == "sqlite":
            folder = Path(str(self._url.database)).parent
            folder.with_name(folder.name + "-away").rename(folder)
        else:
            self._admin(f'ALTER DATABASE "{self._url.database}" ALLOW_CONNECTIONS true')
        self.is_down = False

    def _admin(self, *statements: str) -> None:
        server = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
        try:
            with server.connect() as connection:
                for statement in statements:
                    connection.execute(text(statement))
        finally:
            server.dispose()


@dataclass
class OwnDatabase:
    """A migrated database for one test: its URL, an engine on it, and its outage switch."""

    url: str
    engine: Engine
    session_factory: sessionmaker[Session]
    outage: DatabaseOutage


@pytest.fixture(params=BACKENDS)
def own_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OwnDatabase]:
    """A fresh migrated database; on SQLite in a folder of its own (the outage renames it).

    The SQLite engine opens a connection per transaction (no pool), as a pooled connection
    would keep the renamed file open and hide the outage; PostgreSQL keeps its usual pool.
    """
    folder = tmp_path / "database"
    folder.mkdir()
    with scratch_database(request.param, folder) as url:
        migrations.upgrade_head(url)
        is_sqlite = request.param == "sqlite"
        engine = create_db_engine(DatabaseSettings(url=url), pooled=not is_sqlite)
        outage = DatabaseOutage(url)
        try:
            yield OwnDatabase(url, engine, create_session_factory(engine), outage)
        finally:
            if outage.is_down:
                outage.resume()
            engine.dispose()
