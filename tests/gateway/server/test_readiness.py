"""Readiness: a flood of unauthenticated /health/ready polls costs the database a query every
2 s, not one a poll; a database that stops answering is reported without taking the replica
out of service, and no poll waits for it.

The replica runs in this process (tests/gateway/app_harness.py) over SQLite, or over a
PostgreSQL database of the test's that stops accepting connections.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event

from gateway.server.health import DATABASE_PROBE_INTERVAL_S, DatabaseProbe
from tests.billing.conftest import DatabaseOutage
from tests.gateway.app_harness import start_gateway
from tests.tenants.conftest import scratch_database

NUM_POLLS = 300


def test_a_flood_of_readiness_polls_is_a_database_query_every_interval(
    tmp_path: Path,
) -> None:
    gateway = start_gateway(tmp_path)
    queries: list[str] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        queries.append(statement)

    try:
        event.listen(gateway.runtime.db_engine, "before_cursor_execute", on_execute)
        started = time.monotonic()
        with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
            answers = [client.get("/health/ready") for _ in range(NUM_POLLS)]
        elapsed_s = time.monotonic() - started
        event.remove(gateway.runtime.db_engine, "before_cursor_execute", on_execute)
    finally:
        gateway.stop()
    assert {a.status_code for a in answers} == {200}
    assert all(a.json()["database"] is True for a in answers)
    print(f"\n{NUM_POLLS} polls in {elapsed_s:.2f} s: {len(queries)} database queries")
    assert len(queries) <= elapsed_s / DATABASE_PROBE_INTERVAL_S + 1


def test_a_database_that_stops_answering_is_reported_but_keeps_the_replica_ready(
    tmp_path: Path,
) -> None:
    with scratch_database("postgresql", tmp_path) as url:
        gateway = start_gateway(tmp_path, database_url=url)
        outage = DatabaseOutage(url)
        polls: list[float] = []
        try:
            outage.stop()
            try:
                deadline = time.monotonic() + 30
                while True:
                    started = time.monotonic()
                    ready = httpx.get(f"{gateway.base_url}/health/ready", timeout=30)
                    polls.append(time.monotonic() - started)
                    if not ready.json()["database"]:
                        break
                    assert time.monotonic() < deadline, ready.json()
                    time.sleep(0.2)
            finally:
                outage.resume()
            assert ready.status_code == 200, ready.json()
            assert ready.json()["checks"] == {"model_loaded": True, "not_draining": True}
            assert max(polls) < 1.0, polls  # the probe runs in the background
        finally:
            gateway.stop()


def test_a_probe_that_never_returns_reads_as_no_answer() -> None:
    """A database that accepts and never answers (SIGSTOPped, partitioned) holds the probe's
    thread: past the probe interval readiness says the database does not answer, no poll
    waits longer than the interval, and the next answer after it returns is the truth."""
    released = threading.Event()

    def answers() -> bool:
        released.wait(30)
        return True

    async def scenario() -> tuple[list[bool], float, bool]:
        probe = DatabaseProbe(answers, interval_s=0.2)
        started = time.monotonic()
        during = [await probe.answers() for _ in range(3)]
        waited_s = time.monotonic() - started
        released.set()
        await asyncio.sleep(0.1)
        return during, waited_s, await probe.answers()

    during, waited_s, after = asyncio.run(scenario())
    assert during == [False, False, False]
    assert waited_s < 0.2 + 0.5  # the first poll waited out one interval, the others nothing
    assert after is True
