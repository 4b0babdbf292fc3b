"""The database goes away under load and comes back: no request fails because of it, the
ledger spools what finishes meanwhile, and the spool is replayed (by the running replica, or
at the next start after a kill -9) with no loss and no duplicate.

PostgreSQL: the shared server keeps running; the test's own database refuses connections
(ALLOW_CONNECTIONS false) and its sessions are terminated. SQLite: another process holds the
database's write lock (BEGIN EXCLUSIVE), which is how a SQLite file becomes unavailable to a
running replica. Renaming its folder away, as the ledger's own tests do, fails only new
connections, and a replica's pooled ones keep writing to the moved file.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.billing.conftest import DatabaseOutage
from tests.gateway.serve_harness import (
    Traffic,
    TrafficMix,
    assert_billed_exactly_once,
    billing_periods,
    detail_export,
    start_replica,
)
from tests.serve_process import ServeProcess
from tests.tenants.conftest import BACKENDS, scratch_database

NUM_CLIENTS = 6
MIX = TrafficMix(stream_fraction=0.5, multi_sample_fraction=0.25, max_max_tokens=24)
# Over twice the key cache's 5 s: the clients' key is looked up again during the outage.
OUTAGE_S = 12.0
# Traffic before the outage, and after the database is back.
BEFORE_S, AFTER_S = 1.5, 3.0
POLL_S = 0.25


class SqliteWriteLock:
    """Makes a SQLite database unavailable to writers: this process holds its write lock.
    stop() and resume() run in worker threads (asyncio.to_thread), not always the same one,
    so the connection is not tied to the thread that opened it; they never overlap."""

    def __init__(self, url: str) -> None:
        self._path = str(make_url(url).database)
        self._connection: sqlite3.Connection | None = None

    def stop(self) -> None:
        self._connection = sqlite3.connect(
            self._path, timeout=30.0, isolation_level=None, check_same_thread=False
        )
        self._connection.execute("BEGIN EXCLUSIVE")

    def resume(self) -> None:
        if self._connection is not None:
            self._connection.execute("ROLLBACK")
            self._connection.close()
            self._connection = None


Outage = SqliteWriteLock | DatabaseOutage


def _outage(backend: str, url: str) -> Outage:
    return SqliteWriteLock(url) if backend == "sqlite" else DatabaseOutage(url)


@dataclass
class OutageLog:
    """What the test saw while the database was away."""

    ready_codes: list[int] = field(default_factory=list)  # GET /health/ready answers
    spool_peak_bytes: int = 0


def _spool_bytes(data_dir: Path) -> int:
    spool = data_dir / "usage-spool.jsonl"
    return spool.stat().st_size if spool.exists() else 0


async def _watch(server: ServeProcess, data_dir: Path, until_s: float, log: OutageLog) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as client:
        while time.monotonic() < until_s:
            log.ready_codes.append((await client.get("/health/ready")).status_code)
            log.spool_peak_bytes = max(log.spool_peak_bytes, _spool_bytes(data_dir))
            await asyncio.sleep(POLL_S)


async def _through_outage(
    traffic: Traffic,
    server: ServeProcess,
    data_dir: Path,
    outage: Outage,
    *,
    kill_in_outage: bool,
) -> OutageLog:
    """Traffic before, during and (unless the replica is killed in the outage) after it."""
    log = OutageLog()
    stop = asyncio.Event()
    clients = asyncio.create_task(traffic.run(stop))
    await asyncio.sleep(BEFORE_S)
    await asyncio.to_thread(outage.stop)
    await _watch(server, data_dir, time.monotonic() + OUTAGE_S, log)
    if kill_in_outage:
        await asyncio.to_thread(server.kill)
        stop.set()
        await clients
        await asyncio.to_thread(outage.resume)
        return log
    await asyncio.to_thread(outage.resume)
    await asyncio.sleep(AFTER_S)
    stop.set()
    await clients
    return log


def _wait_for_empty_spool(data_dir: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _spool_bytes(data_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _spool_bytes(data_dir) == 0, "the spool was not replayed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_database_outage_under_load_fails_no_request_and_bills_each_once(
    backend: str, tmp_path: Path
) -> None:
    since = datetime.now(UTC)
    data_dir = tmp_path / "data"
    with scratch_database(backend, tmp_path) as database_url:
        outage = _outage(backend, database_url)
        server = start_replica(database_url, data_dir)
        api_key = server.printed_keys()[0]
        try:
            # 1. The database comes back while the replica runs: it replays the spool itself.
            traffic = Traffic(server.base_url, api_key, num_clients=NUM_CLIENTS, seed=1, mix=MIX)
            log = asyncio.run(
                _through_outage(traffic, server, data_dir, outage, kill_in_outage=False)
            )
            failed = [r for r in traffic.requests if not r.is_complete]
            assert not failed, failed  # every request got its 200 and its whole answer
            assert log.spool_peak_bytes > 0  # the ledger really lost its database
            assert set(log.ready_codes) == {200}  # still in service throughout
            _wait_for_empty_spool(data_dir)
            check = assert_billed_exactly_once(
                traffic.requests, detail_export(server, billing_periods(since))
            )
            assert check.num_records == check.num_sent  # each request billed, none twice
            assert httpx.get(f"{server.base_url}/health/ready").status_code == 200
            print(
                f"\n{backend}, database back while running: {check}; spool peaked at "
                f"{log.spool_peak_bytes} bytes; slowest request "
                f"{max(r.latency_s or 0.0 for r in traffic.requests):.1f} s; /health/ready "
                f"during the outage: {sorted(set(log.ready_codes))}"
            )

            # 2. The replica is killed while the database is away: the spool waits for the
            # next start, which replays it.
            second = Traffic(server.base_url, api_key, num_clients=NUM_CLIENTS, seed=2, mix=MIX)
            log = asyncio.run(
                _through_outage(second, server, data_dir, outage, kill_in_outage=True)
            )
            assert all(r.status_code in (None, 200) for r in second.requests), second.requests
            assert set(log.ready_codes) == {200}
            spooled_bytes = _spool_bytes(data_dir)
            assert spooled_bytes > 0
            server = start_replica(database_url, data_dir)
            assert _spool_bytes(data_dir) == 0  # replayed before the replica became ready
            seen = traffic.requests + second.requests
            check = assert_billed_exactly_once(seen, detail_export(server, billing_periods(since)))
            num_before_kill = sum(r.status_code is not None for r in second.requests)
            print(
                f"{backend}, killed in the outage with {spooled_bytes} spool bytes: "
                f"{num_before_kill} requests answered, {check}"
            )
            assert server.stop() == 0, server.output()
        finally:
            server.kill()
            outage.resume()
