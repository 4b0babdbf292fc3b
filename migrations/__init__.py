"""Alembic migrations, the only source of schema, and helpers to run them from code.

``upgrade_head`` is what ``tiergate serve`` calls at start. On PostgreSQL it holds a
transaction-scoped advisory lock for the whole upgrade, so replicas that start together
migrate once: the first upgrades, the others wait, then find the schema at head.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, func, select

from tenants import DatabaseSettings, create_db_engine

__all__ = [
    "current_revision",
    "downgrade_base",
    "downgrade_to",
    "head_revision",
    "upgrade_head",
    "upgrade_to",
]

SCRIPT_LOCATION = Path(__file__).resolve().parent
# pg_advisory_xact_lock key: the bytes of "tiergate" as a signed 64-bit integer.
ADVISORY_LOCK_KEY = int.from_bytes(b"tiergate", "big", signed=True)


def upgrade_head(url: str) -> None:
    """Bring the database at url to the newest revision (a no-op when already there)."""
    _run(url, lambda config: command.upgrade(config, "head"))


def downgrade_base(url: str) -> None:
    """Undo every migration: the database is left without tiergate tables."""
    _run(url, lambda config: command.downgrade(config, "base"))


def upgrade_to(url: str, revision: str) -> None:
    """Bring the database at url up to revision (a test of one migration starts there)."""
    _run(url, lambda config: command.upgrade(config, revision))


def downgrade_to(url: str, revision: str) -> None:
    """Undo the migrations after revision."""
    _run(url, lambda config: command.downgrade(config, revision))


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None, "migrations/versions has no revisions"
    return head


def current_revision(url: str) -> str | None:
    """The revision the database is at, or None before the first upgrade."""
    engine = create_db_engine(DatabaseSettings(url=url), pooled=False)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def _config(connection: Connection | None = None) -> Config:
    # Built in code rather than read from alembic.ini: no logging.fileConfig, which would
    # silence the application's loggers, and no URL interpolation through configparser.
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    config.attributes["connection"] = connection
    return config


def _run(url: str, action: Callable[[Config], None]) -> None:
    engine = create_db_engine(DatabaseSettings(url=url), pooled=False)
    try:
        # One transaction around everything; env.py joins it rather than opening its own.
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(select(func.pg_advisory_xact_lock(ADVISORY_LOCK_KEY)))
            action(_config(connection))
    finally:
        engine.dispose()
