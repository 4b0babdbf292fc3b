"""Alembic environment: runs on a connection handed over by migrations.upgrade_head, or on
TIERGATE_DATABASE_URL (default: ./tiergate.db) when run as ``alembic -c migrations/alembic.ini``.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

import billing  # noqa: F401  (its models put usage_records on Base.metadata)
from tenants import Base, DatabaseSettings, create_db_engine

config = context.config
if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name)

# Autogenerate compares against these tables: tenants' and billing's share one metadata.
target_metadata = Base.metadata


def _database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or DatabaseSettings.from_env().url


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite alters tables by copying them; batch mode does that for later migrations.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=_database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    engine = create_db_engine(DatabaseSettings(url=_database_url()), pooled=False)
    try:
        with engine.begin() as new_connection:
            _configure(new_connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
