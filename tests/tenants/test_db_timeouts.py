"""Every PostgreSQL call of a serving process ends within its limit: a locked table, a
statement that runs too long, a server that never answers the connection, an exhausted pool.
And what the ledger does with a locked usage_records table, or a server that stops answering
on an open connection: it spools after the lock timeout, or its own deadline, instead of
waiting for ever, and the spool is replayed once the database is back.

Against the local PostgreSQL server, each test on a scratch database of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

import migrations
from billing import UsageLedger, UsageRecordRow
from tenants import DatabaseSettings, create_db_engine, create_session_factory
from tenants.errors import InvalidFieldError
from tests.billing.factories import make_record
from tests.tenants.conftest import scratch_database

LIMIT_S = 0.5


@pytest.fixture
def postgresql_url(tmp_path: Path) -> Iterator[str]:
    with scratch_database("postgresql", tmp_path) as url:
        migrations.upgrade_head(url)
        yield url


def _settings(url: str) -> DatabaseSettings:
    return DatabaseSettings(
        url=url, lock_timeout_s=LIMIT_S, statement_timeout_s=2 * LIMIT_S, pool_timeout_s=LIMIT_S,
        pool_size=1, max_overflow=0,
    )


async def _replayed_and_closed(ledger: UsageLedger, spool: Path) -> None:
    """Wait until the ledger has replayed its spool (30 s at most), then close it."""
    deadline = time.monotonic() + 30
    while spool.stat().st_size:
        assert time.monotonic() < deadline, "the spool was not replayed"
        await asyncio.sleep(0.05)
    await ledger.close()


def _timed_failure(call: object) -> float:
    assert callable(call)
    started = time.monotonic()
    with pytest.raises((OperationalError, PoolTimeoutError)):
        call()
    return time.monotonic() - started


def test_a_locked_table_fails_the_query_after_the_lock_timeout(postgresql_url: str) -> None:
    engine = create_db_engine(_settings(postgresql_url))
    holder = create_engine(postgresql_url)
    try:
        with holder.connect() as locking:
            locking.execute(text("LOCK TABLE tenants IN ACCESS EXCLUSIVE MODE"))

            def query() -> None:
                with engine.connect() as connection:
                    connection.execute(text("SELECT count(*) FROM tenants"))

            waited_s = _timed_failure(query)
            locking.rollback()
    finally:
        holder.dispose()
        engine.dispose()
    assert LIMIT_S <= waited_s < LIMIT_S + 2.0


def test_a_statement_past_its_limit_is_cancelled(postgresql_url: str) -> None:
    engine = create_db_engine(_settings(postgresql_url))
    try:
        def query() -> None:
            with engine.connect() as connection:
                connection.execute(text("SELECT pg_sleep(30)"))

        waited_s = _timed_failure(query)
    finally:
        engine.dispose()
    assert 2 * LIMIT_S <= waited_s < 2 * LIMIT_S + 2.0


def test_an_exhausted_pool_fails_after_the_pool_timeout(postgresql_url: str) -> None:
    engine = create_db_engine(_settings(postgresql_url))
    try:
        with engine.connect():  # the pool's only connection

            def query() -> None:
                with engine.connect() as connection:
                    connection.execute(text("SELECT 1"))

            waited_s = _timed_failure(query)
    finally:
        engine.dispose()
    assert LIMIT_S <= waited_s < LIMIT_S + 2.0


def test_a_server_that_never_answers_fails_the_connection_in_seconds() -> None:
    # A listening socket nobody accepts from: the handshake completes, no greeting follows.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        url = make_url("postgresql+psycopg://postgres@127.0.0.1/test").set(port=port)
        engine = create_db_engine(DatabaseSettings(url=url.render_as_string(), connect_timeout_s=2))
        try:
            def connect() -> None:
                with engine.connect():
                    pass

            waited_s = _timed_failure(connect)
        finally:
            engine.dispose()
    assert 2.0 <= waited_s < 10.0


def test_migrations_and_the_cli_run_without_statement_limits(postgresql_url: str) -> None:
    unpooled = create_db_engine(_settings(postgresql_url), pooled=False)
    serving = create_db_engine(_settings(postgresql_url))
    try:
        with unpooled.connect() as connection:
            assert connection.scalar(text("SHOW statement_timeout")) == "0"
        with serving.connect() as connection:
            assert connection.scalar(text("SHOW statement_timeout")) == "1s"
            assert connection.scalar(text("SHOW lock_timeout")) == "500ms"
    finally:
        unpooled.dispose()
        serving.dispose()


def test_limits_must_be_positive() -> None:
    with pytest.raises(InvalidFieldError, match="lock_timeout_s"):
        DatabaseSettings(lock_timeout_s=0)


def test_the_ledger_spools_past_a_locked_usage_table_and_replays_after(
    postgresql_url: str, tmp_path: Path
) -> None:
    engine = create_db_engine(_settings(postgresql_url))
    session_factory = create_session_factory(engine)
    holder = create_engine(postgresql_url)
    spool = tmp_path / "spool.jsonl"

    async def scenario() -> float:
        ledger = UsageLedger(session_factory, spool, retry_interval_s=0.2)
        await ledger.start()
        with holder.connect() as locking:
            locking.execute(text("LOCK TABLE usage_records IN ACCESS EXCLUSIVE MODE"))
            started = time.monotonic()
            await asyncio.gather(*(ledger.record(make_record(f"r{i}")) for i in range(20)))
            durable_s = time.monotonic() - started
            assert spool.stat().st_size > 0  # spooled, not committed
            locking.rollback()
        await _replayed_and_closed(ledger, spool)
        return durable_s

    try:
        durable_s = asyncio.run(scenario())
        with session_factory() as session:
            stored = set(session.scalars(select(UsageRecordRow.request_id)))
    finally:
        holder.dispose()
        engine.dispose()
    print(f"\n20 records with usage_records locked: durable (spooled) after {durable_s:.2f} s "
          f"(lock timeout {LIMIT_S} s), all replayed once the lock was gone")
    assert stored == {f"r{i}" for i in range(20)}
    assert durable_s < LIMIT_S + 2.0


def test_the_ledger_spools_past_a_database_that_never_answers(
    postgresql_url: str, tmp_path: Path
) -> None:
    """The backend of the ledger's pooled connection SIGSTOPped, as a stopped or partitioned
    server looks to it: a commit waits for no server-side limit, only for the ledger's own
    deadline, then spools; the call left waiting rolls back when the backend resumes, and
    the spool is replayed once (each record stored once)."""
    settings = dataclasses.replace(_settings(postgresql_url), pool_size=1, max_overflow=4)
    engine = create_db_engine(settings)
    session_factory = create_session_factory(engine)
    spool = tmp_path / "spool.jsonl"
    call_timeout_s = 1.0
    with session_factory() as session:  # the pool's one connection, and its backend
        backend_pid = int(session.scalar(text("SELECT pg_backend_pid()")))

    async def scenario() -> float:
        ledger = UsageLedger(session_factory, spool, retry_interval_s=0.2,
                             call_timeout_s=call_timeout_s)
        await ledger.start()
        os.kill(backend_pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            # without a deadline of its own the ledger would wait until SIGCONT
            await asyncio.wait_for(
                asyncio.gather(*(ledger.record(make_record(f"r{i}")) for i in range(20))),
                timeout=call_timeout_s + 10,
            )
            durable_s = time.monotonic() - started
            assert spool.stat().st_size > 0  # spooled, not committed
        finally:
            os.kill(backend_pid, signal.SIGCONT)
        await _replayed_and_closed(ledger, spool)
        return durable_s

    try:
        durable_s = asyncio.run(scenario())
        with session_factory() as session:
            stored = list(session.scalars(select(UsageRecordRow.request_id)))
    finally:
        engine.dispose()
    print(f"\n20 records with the ledger's database backend stopped: durable (spooled) after "
          f"{durable_s:.2f} s (the ledger's deadline {call_timeout_s} s), replayed after")
    assert sorted(stored) == sorted(f"r{i}" for i in range(20))  # each once
    assert durable_s < call_timeout_s + 1.0


@pytest.mark.parametrize("pooled", [True, False], ids=["serving", "cli"])
def test_every_connection_has_keepalives_and_a_user_timeout(
    postgresql_url: str, pooled: bool
) -> None:
    """Read back from the connection's own socket: a server that vanishes is noticed by
    the kernel in keepalive_idle + interval x count seconds (sent data unacknowledged for
    tcp_user_timeout), instead of holding the connection's caller until a restart."""
    settings = dataclasses.replace(_settings(postgresql_url), keepalive_idle_s=7,
                                   keepalive_interval_s=3, keepalive_count=4,
                                   tcp_user_timeout_s=9.5)
    engine = create_db_engine(settings, pooled=pooled)
    try:
        with engine.connect() as connection:
            raw = connection.connection.dbapi_connection
            assert raw is not None
            probe = socket.socket(fileno=os.dup(raw.fileno()))
            try:
                options = {
                    name: probe.getsockopt(level, option)
                    for name, level, option in [
                        ("keepalive", socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                        ("idle", socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                        ("interval", socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                        ("count", socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                        ("user_timeout_ms", socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
                    ]
                }
            finally:
                probe.close()  # the duplicate only
    finally:
        engine.dispose()
    assert options == {"keepalive": 1, "idle": 7, "interval": 3, "count": 4,
                       "user_timeout_ms": 9500}
