"""The real Alembic migrations on SQLite and PostgreSQL: round trip, parity with the models,
several replicas upgrading at once, and the SQLite connection settings."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, insert, inspect, select, text

import migrations
from billing import UsageRecordRow, insert_records
from billing.models import USAGE_RECORDS, record_values
from tenants import Base, DatabaseSettings, create_db_engine, create_session_factory
from tests.billing.factories import make_record

# Importing billing puts usage_records on Base.metadata, which the parity test compares.
TIERGATE_TABLES = {
    "tenants",
    "tenant_quotas",
    "api_keys",
    "audit_log",
    UsageRecordRow.__tablename__,
}


def _tables(url: str) -> set[str]:
    engine = create_db_engine(DatabaseSettings(url=url), pooled=False)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_round_trip(fresh_database_url: str) -> None:
    url = fresh_database_url
    assert migrations.current_revision(url) is None

    migrations.upgrade_head(url)
    assert migrations.current_revision(url) == migrations.head_revision()
    assert _tables(url) >= TIERGATE_TABLES

    migrations.downgrade_base(url)
    assert migrations.current_revision(url) is None
    assert not TIERGATE_TABLES & _tables(url)

    migrations.upgrade_head(url)
    assert migrations.current_revision(url) == migrations.head_revision()
    assert _tables(url) >= TIERGATE_TABLES


def test_upgrade_head_twice_is_a_no_op(fresh_database_url: str) -> None:
    migrations.upgrade_head(fresh_database_url)
    migrations.upgrade_head(fresh_database_url)
    assert migrations.current_revision(fresh_database_url) == migrations.head_revision()


def test_models_match_the_migrated_schema(engine: Engine) -> None:
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def _columns(url: str, table: str) -> set[str]:
    engine = create_db_engine(DatabaseSettings(url=url), pooled=False)
    try:
        return {column["name"] for column in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def test_the_weight_format_column_leaves_old_records_null(fresh_database_url: str) -> None:
    url = fresh_database_url
    migrations.upgrade_to(url, "0014")
    assert "weight_format" not in _columns(url, "usage_records")
    old = {k: v for k, v in record_values(make_record("old")).items() if k != "weight_format"}
    engine = create_db_engine(DatabaseSettings(url=url), pooled=False)
    try:
        with engine.begin() as connection:
            connection.execute(insert(USAGE_RECORDS), [old])

        migrations.upgrade_to(url, "0015")
        with create_session_factory(engine)() as session, session.begin():
            assert insert_records(session, [make_record("new", weight_format="gguf-q4_1")])
        with engine.connect() as connection:
            stored = dict(connection.execute(
                select(USAGE_RECORDS.c.request_id, USAGE_RECORDS.c.weight_format)).all())
        assert stored == {"old": None, "new": "gguf-q4_1"}  # not recorded before 0015

        migrations.downgrade_to(url, "0014")
        assert "weight_format" not in _columns(url, "usage_records")
        with engine.connect() as connection:
            ids = connection.execute(text("SELECT request_id FROM usage_records")).scalars()
            assert sorted(ids) == ["new", "old"]  # the records stay, without their format
    finally:
        engine.dispose()
    migrations.upgrade_head(url)
    assert migrations.current_revision(url) == migrations.head_revision()


def test_version_files_carry_a_date_prefix() -> None:
    names = [p.name for p in (migrations.SCRIPT_LOCATION / "versions").glob("*.py")]
    assert names
    for name in names:
        year, month, day, *_ = name.split("_")
        assert (len(year), len(month), len(day)) == (4, 2, 2) and (year + month + day).isdigit()


# Each replica process sleeps until the same instant, then runs upgrade_head.
_REPLICA = """
import sys, time
import migrations
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
migrations.upgrade_head(sys.argv[1])
"""


@pytest.mark.parametrize("fresh_database_url", ["postgresql"], indirect=True)
def test_replicas_starting_together_migrate_once(fresh_database_url: str) -> None:
    # Without the advisory lock, concurrent CREATE TABLEs collide on PostgreSQL's catalog
    # ("relation already exists") and all but one replica fail to start.
    start_at = str(time.time() + 2.0)
    replicas = [
        subprocess.Popen(
            [sys.executable, "-c", _REPLICA, fresh_database_url, start_at],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [replica.communicate(timeout=60)[0] for replica in replicas]
    assert [r.returncode for r in replicas] == [0, 0, 0], outputs
    assert migrations.current_revision(fresh_database_url) == migrations.head_revision()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_sqlite_connections_use_wal_and_foreign_keys(engine: Engine) -> None:
    with engine.connect() as connection:
        assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert connection.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert connection.execute(text("PRAGMA busy_timeout")).scalar() == 5000
