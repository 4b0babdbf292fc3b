"""Databases for the tenants and gateway tests: every test runs on SQLite and on PostgreSQL.

Each backend gets one scratch database per session (a file; a fresh PostgreSQL database
named tiergate_test_*) migrated with the real Alembic migrations, and each test leaves it
empty. PostgreSQL is TIERGATE_TEST_POSTGRES_URL, default the local server's `test`
database; when it is unreachable the tests fail: they never skip.

tests/gateway/conftest.py re-exports these fixtures, so both folders share them.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import Engine, MetaData, create_engine, delete, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

import migrations
from tenants import Base, DatabaseSettings, create_db_engine, create_session_factory

BACKENDS = ("sqlite", "postgresql")
POSTGRES_URL = os.environ.get(
    "TIERGATE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@contextmanager
def scratch_database(backend: str, directory: Path) -> Iterator[str]:
    """The URL of a new, empty database of backend, dropped afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{directory / f'tiergate-{secrets.token_hex(4)}.db'}"
        return
    name = f"tiergate_test_{os.getpid()}_{secrets.token_hex(4)}"
    server = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
        finally:
            with server.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        server.dispose()


@pytest.fixture(scope="session", params=BACKENDS)
def database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A database migrated to head, shared by the session's tests of one backend."""
    with scratch_database(request.param, tmp_path_factory.mktemp("db")) as url:
        migrations.upgrade_head(url)
        yield url


@pytest.fixture(params=BACKENDS)
def fresh_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty, unmigrated database for one test (migration tests)."""
    with scratch_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture(scope="session")
def engine(database_url: str) -> Iterator[Engine]:
    engine = create_db_engine(DatabaseSettings(url=database_url))
    yield engine
    engine.dispose()


@pytest.fixture
def db(engine: Engine) -> Iterator[Engine]:
    """The migrated engine; every row a test wrote (through any connection) is deleted after."""
    yield engine
    with engine.begin() as connection:
        for table in reversed(Base.metadata.sorted_tables):
            connection.execute(delete(table))


@pytest.fixture
def session_factory(db: Engine) -> sessionmaker[Session]:
    return create_session_factory(db)


@pytest.fixture
def session(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    with session_factory() as session:
        yield session


# (table, column, value rendered as text) for every value in the database.
StoredValues = Callable[[], list[tuple[str, str, str]]]


@pytest.fixture
def stored_values(db: Engine) -> StoredValues:
    """Reads every column of every table (reflected, so alembic_version too) as text."""

    def read() -> list[tuple[str, str, str]]:
        metadata = MetaData()
        metadata.reflect(db)
        values = []
        with db.connect() as connection:
            for table in metadata.sorted_tables:
                for row in connection.execute(select(table)).mappings():
                    for column, value in row.items():
                        text_value = (
                            value if isinstance(value, str) else json.dumps(value, default=str)
                        )
                        values.append((table.name, column, text_value))
        return values

    return read
