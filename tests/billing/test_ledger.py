"""The usage ledger on SQLite and PostgreSQL: group commit, durability before record() returns,
flush on close, a database outage under load (spool, then replay with no loss and no
duplicate), exactly once per request id across replays and crashes, monthly totals."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, event, select
from sqlalchemy.orm import Session, sessionmaker

import migrations
from billing import (
    InvalidSettingError,
    LedgerClosedError,
    LedgerUnavailableError,
    LedgerWriteError,
    MonthlyUsage,
    UsageLedger,
    UsageRecordRow,
    insert_records,
)
from billing.spool import Spool
from tenants import DatabaseSettings, create_db_engine, create_session_factory
from tests.billing.conftest import OwnDatabase
from tests.billing.factories import make_record
from tests.tenants.conftest import scratch_database

T = TypeVar("T")
NOW = datetime(2026, 11, 20, 9, 30, tzinfo=UTC)


def _run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(scenario())


def _stored_ids(session_factory: sessionmaker[Session]) -> list[str]:
    with session_factory() as session:
        return list(session.scalars(select(UsageRecordRow.request_id)))


async def _eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def _ledger(session_factory: sessionmaker[Session], spool: Path, **options: Any) -> UsageLedger:
    return UsageLedger(session_factory, spool, clock=lambda: NOW, **options)


# --- group commit and durability ----------------------------------------------------------------


@pytest.mark.parametrize(("max_batch", "fewest", "most"), [(500, 1, 3), (100, 3, 6)])
def test_concurrent_records_are_committed_in_few_transactions(
    engine: Engine,
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    max_batch: int,
    fewest: int,
    most: int,
) -> None:
    commits: list[object] = []

    def on_commit(connection: object) -> None:
        commits.append(connection)

    async def scenario() -> tuple[int, list[str]]:
        ledger = _ledger(
            session_factory, tmp_path / "spool.jsonl", flush_interval_s=0.02, max_batch=max_batch
        )
        await ledger.start()
        event.listen(engine, "commit", on_commit)
        try:
            await asyncio.gather(*(ledger.record(make_record(f"r{i}")) for i in range(300)))
            # Every record() has returned: each record is committed, before close().
            stored = await asyncio.to_thread(_stored_ids, session_factory)
        finally:
            event.remove(engine, "commit", on_commit)
        await ledger.close()
        return len(commits), stored

    num_commits, stored = _run(scenario)
    print(f"\n300 concurrent records, max_batch {max_batch}: {num_commits} transaction(s)")
    assert sorted(stored) == sorted(f"r{i}" for i in range(300))
    assert fewest <= num_commits <= most


def test_close_writes_everything_queued_then_refuses(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    async def scenario() -> None:
        ledger = _ledger(session_factory, tmp_path / "spool.jsonl", flush_interval_s=0.05)
        await ledger.start()
        pending = [asyncio.create_task(ledger.record(make_record(f"q{i}"))) for i in range(50)]
        await asyncio.sleep(0)  # each task has queued its record; none is committed yet
        await ledger.close()
        await asyncio.gather(*pending)
        with pytest.raises(LedgerClosedError):
            await ledger.record(make_record("late"))

    _run(scenario)
    assert sorted(_stored_ids(session_factory)) == sorted(f"q{i}" for i in range(50))


def test_a_cancelled_waiter_does_not_cancel_the_write(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    async def scenario() -> None:
        ledger = _ledger(session_factory, tmp_path / "spool.jsonl", flush_interval_s=0.05)
        await ledger.start()
        task = asyncio.create_task(ledger.record(make_record("gone")))
        await asyncio.sleep(0)
        task.cancel()  # the client disconnected while its record was being written
        await ledger.close()

    _run(scenario)
    assert _stored_ids(session_factory) == ["gone"]


def test_recording_the_same_request_id_twice_stores_it_once(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    async def scenario() -> MonthlyUsage:
        ledger = _ledger(session_factory, tmp_path / "spool.jsonl")
        await ledger.start()
        await ledger.monthly_usage(1)
        record = make_record("twice", finished_at=NOW)
        await ledger.record(record)
        await ledger.record(record)
        usage = await ledger.monthly_usage(1)
        await ledger.close()
        return usage

    usage = _run(scenario)
    assert _stored_ids(session_factory) == ["twice"]
    assert usage == MonthlyUsage(120, 134)  # counted once


def test_the_weight_format_is_stored_and_read_back(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    formats = {"fp32": "float32", "q4": "gguf-q4_1+q8_0", "awq": "awq-int4", "refused": None}

    async def scenario() -> None:
        ledger = _ledger(session_factory, tmp_path / "spool.jsonl")
        await ledger.start()
        await asyncio.gather(*(
            ledger.record(make_record(request_id, finished_at=NOW, weight_format=weight_format))
            for request_id, weight_format in formats.items()
        ))
        await ledger.close()

    _run(scenario)
    with session_factory() as session:
        stored = dict(session.execute(
            select(UsageRecordRow.request_id, UsageRecordRow.weight_format)).all())
    assert stored == formats


def test_settings_are_validated(session_factory: sessionmaker[Session], tmp_path: Path) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_batch": 0}, "max_batch"),
        ({"flush_interval_s": -1.0}, "flush_interval_s"),
        ({"retry_interval_s": 0.0}, "retry_interval_s"),
    ]
    for options, param in cases:
        with pytest.raises(InvalidSettingError) as caught:
            UsageLedger(session_factory, tmp_path / "spool.jsonl", **options)
        assert caught.value.param == param


# --- database outage -----------------------------------------------------------------------------


def test_database_outage_under_load_loses_nothing_and_duplicates_nothing(
    own_database: OwnDatabase, tmp_path: Path
) -> None:
    spool = tmp_path / "spool.jsonl"
    acknowledged: list[str] = []
    num_workers, num_per_worker = 8, 40
    largest_spool_bytes = 0

    async def scenario() -> None:
        nonlocal largest_spool_bytes
        ledger = _ledger(
            own_database.session_factory, spool, flush_interval_s=0.002, retry_interval_s=0.05
        )
        await ledger.start()

        async def worker(worker_id: int) -> None:
            for i in range(num_per_worker):
                record = make_record(f"w{worker_id}-{i}")
                await ledger.record(record)
                acknowledged.append(record.request_id)
                await asyncio.sleep(0.002)

        workers = [asyncio.create_task(worker(w)) for w in range(num_workers)]
        await _eventually(lambda: len(acknowledged) >= 60)
        await asyncio.to_thread(own_database.outage.stop)
        await _eventually(lambda: not ledger.is_database_healthy)
        num_before_spooling = len(acknowledged)
        await _eventually(lambda: len(acknowledged) >= num_before_spooling + 60)
        largest_spool_bytes = spool.stat().st_size
        await asyncio.to_thread(own_database.outage.resume)
        await asyncio.gather(*workers)
        await _eventually(lambda: ledger.is_database_healthy and spool.stat().st_size == 0)
        await ledger.close()

    _run(scenario)
    stored = _stored_ids(own_database.session_factory)
    print(
        f"\n{len(acknowledged)} records acknowledged, spool peaked at {largest_spool_bytes} bytes,"
        f" {len(stored)} stored"
    )
    assert largest_spool_bytes > 0  # the outage really sent records to the spool
    assert len(acknowledged) == num_workers * num_per_worker
    assert sorted(stored) == sorted(acknowledged)  # no loss, no duplicate


def test_records_spooled_while_down_are_replayed_by_the_next_process(
    own_database: OwnDatabase, tmp_path: Path
) -> None:
    spool = tmp_path / "spool.jsonl"

    async def first_process() -> None:
        ledger = _ledger(own_database.session_factory, spool, retry_interval_s=60.0)
        await ledger.start()
        await ledger.record(make_record("before"))
        await asyncio.to_thread(own_database.outage.stop)
        await asyncio.gather(*(ledger.record(make_record(f"down{i}")) for i in range(20)))
        assert not ledger.is_database_healthy
        await ledger.close()  # the database is still down: the spool keeps the records

    async def second_process() -> None:
        ledger = _ledger(own_database.session_factory, spool)
        await ledger.start()  # replays the spool
        assert ledger.is_database_healthy
        await ledger.close()

    _run(first_process)
    assert spool.stat().st_size > 0
    own_database.outage.resume()
    _run(second_process)
    assert spool.stat().st_size == 0
    assert sorted(_stored_ids(own_database.session_factory)) == sorted(
        ["before", *(f"down{i}" for i in range(20))]
    )


def test_spool_unwritable_while_database_down_is_an_error(
    own_database: OwnDatabase, tmp_path: Path
) -> None:
    async def scenario() -> None:
        spool = tmp_path / "missing-folder" / "spool.jsonl"
        ledger = _ledger(own_database.session_factory, spool, retry_interval_s=60.0)
        await ledger.start()
        await asyncio.to_thread(own_database.outage.stop)
        with pytest.raises(LedgerWriteError):
            await ledger.record(make_record("nowhere"))
        await ledger.close()

    _run(scenario)


def test_a_record_the_database_refuses_is_set_aside_and_the_rest_go_in(tmp_path: Path) -> None:
    """A record PostgreSQL refuses for its content (a count past INTEGER's range) fails its
    batch; the batch is spooled, and its replay inserts the others and sets it aside in the
    .rejected file instead of failing every replay (and spooling everything after it)."""
    with scratch_database("postgresql", tmp_path) as url:
        migrations.upgrade_head(url)
        engine = create_db_engine(DatabaseSettings(url=url))
        session_factory = create_session_factory(engine)
        spool = tmp_path / "spool.jsonl"

        async def scenario() -> None:
            ledger = _ledger(session_factory, spool, retry_interval_s=0.05)
            await ledger.start()
            poison = make_record("poison", num_completion_tokens=2**31)
            await asyncio.gather(
                *(ledger.record(make_record(f"ok{i}")) for i in range(5)), ledger.record(poison)
            )
            await _eventually(lambda: ledger.is_database_healthy and ledger.spool_bytes == 0)
            await ledger.record(make_record("after"))  # straight to the database again
            assert ledger.spool_bytes == 0
            await ledger.close()

        try:
            _run(scenario)
            stored = _stored_ids(session_factory)
        finally:
            engine.dispose()
    assert sorted(stored) == sorted([f"ok{i}" for i in range(5)] + ["after"])
    rejected = spool.with_name("spool.jsonl.rejected").read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in rejected] == ["poison"]


# --- exactly once across replays and crashes -----------------------------------------------------


# A gateway-like process: four tasks record records as fast as the ledger takes them and
# print each request id once record() has returned (acknowledged: durable).
_RECORDING_PROCESS = """
import asyncio, sys
from billing import UsageLedger
from tenants import DatabaseSettings, create_db_engine, create_session_factory
from tests.billing.factories import make_record

async def main(url, spool):
    settings = DatabaseSettings(url=url)
    engine = create_db_engine(settings, pooled=not settings.is_sqlite)
    ledger = UsageLedger(
        create_session_factory(engine), spool, flush_interval_s=0.002, retry_interval_s=0.05
    )
    await ledger.start()

    async def worker(worker_id):
        for i in range(10**9):
            record = make_record(f"k{worker_id}-{i}")
            await ledger.record(record)
            print(record.request_id, flush=True)

    await asyncio.gather(*(worker(w) for w in range(4)))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_a_process_killed_mid_batch_during_an_outage_loses_no_acknowledged_record(
    own_database: OwnDatabase, tmp_path: Path
) -> None:
    spool = tmp_path / "spool.jsonl"
    with subprocess.Popen(
        [sys.executable, "-c", _RECORDING_PROCESS, own_database.url, str(spool)],
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        try:
            acknowledged = [process.stdout.readline().strip() for _ in range(100)]
            own_database.outage.stop()
            # Until something was acknowledged while the database was down (the pipe may
            # still hold many acknowledgements from before), and 200 more.
            deadline_s = time.monotonic() + 60
            while not (spool.exists() and spool.stat().st_size > 0):
                assert time.monotonic() < deadline_s, "nothing spooled during the outage"
                acknowledged.append(process.stdout.readline().strip())
            acknowledged += [process.stdout.readline().strip() for _ in range(200)]
            process.send_signal(signal.SIGKILL)  # mid-batch: no close(), no flush
            acknowledged += process.stdout.read().split()
        finally:
            process.kill()
    own_database.outage.resume()

    async def restart() -> None:
        ledger = _ledger(own_database.session_factory, spool)
        await ledger.start()  # replays what the killed process spooled
        await ledger.close()

    _run(restart)
    stored = _stored_ids(own_database.session_factory)
    print(f"\n{len(acknowledged)} acknowledged before the kill, {len(stored)} stored")
    assert set(acknowledged) <= set(stored)  # nothing acknowledged is lost
    assert len(stored) == len(set(stored))
    assert all(request_id.startswith("k") for request_id in stored)


def test_replaying_the_same_spool_twice_inserts_each_record_once(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    spool_path = tmp_path / "spool.jsonl"
    Spool(spool_path).append([make_record(f"s{i}") for i in range(30)])
    copy = tmp_path / "spool-copy.jsonl"
    shutil.copyfile(spool_path, copy)
    ledger = _ledger(session_factory, spool_path)

    first = ledger.replay_spool()
    shutil.copyfile(copy, spool_path)  # the same spool again
    second = ledger.replay_spool()

    assert (first.num_read, first.num_inserted) == (30, 30)
    assert (second.num_read, second.num_inserted) == (30, 0)
    assert sorted(_stored_ids(session_factory)) == sorted(f"s{i}" for i in range(30))
    assert spool_path.stat().st_size == 0


def test_crash_between_commit_and_spool_truncation_replays_without_duplicates(
    session_factory: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool_path = tmp_path / "spool.jsonl"
    records = [make_record(f"c{i}") for i in range(40)]
    # Mid-batch kill: the first 15 reached the database, all 40 are in the spool.
    with session_factory.begin() as session:
        insert_records(session, records[:15])
    Spool(spool_path).append(records)

    def crash(_spool: Spool) -> None:
        raise OSError("simulated crash after the commit, before the truncation")

    monkeypatch.setattr(Spool, "truncate", crash)
    with pytest.raises(OSError, match="simulated crash"):
        _ledger(session_factory, spool_path).replay_spool()
    assert spool_path.stat().st_size > 0  # the spool survived the "crash"
    assert len(_stored_ids(session_factory)) == 40
    monkeypatch.undo()

    async def restart() -> None:
        ledger = _ledger(session_factory, spool_path)
        await ledger.start()
        await ledger.close()

    _run(restart)
    assert spool_path.stat().st_size == 0
    assert sorted(_stored_ids(session_factory)) == sorted(r.request_id for r in records)


# --- monthly totals ------------------------------------------------------------------------------


def test_a_large_spool_is_replayed_in_chunks_between_new_records(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    """20 chunks left by an earlier process: start() returns without replaying them, a new
    record is committed while most of them are still waiting (one chunk at a time between
    batches, not the whole spool in front of it), and a monthly total that needs them all
    waits for them while records go on being written."""
    spool_path = tmp_path / "spool.jsonl"
    old = [make_record(f"old{i}", finished_at=NOW) for i in range(2_000)]
    Spool(spool_path).append(old)
    full_size = spool_path.stat().st_size

    async def scenario() -> tuple[int, int, MonthlyUsage]:
        ledger = _ledger(session_factory, spool_path, max_batch=100)
        await ledger.start()
        at_start = ledger.spool_bytes
        await ledger.record(make_record("new", finished_at=NOW))
        after_new = ledger.spool_bytes
        totals = ledger.monthly_usage(1)
        await ledger.record(make_record("newer", finished_at=NOW))
        usage = await totals
        await ledger.close()
        return at_start, after_new, usage

    at_start, after_new, usage = _run(scenario)
    assert at_start == full_size  # nothing replayed before the writer started
    assert after_new > 0  # the new record did not wait for the whole spool
    stored = _stored_ids(session_factory)
    assert len(stored) == 2_002 and len(set(stored)) == 2_002
    assert spool_path.stat().st_size == 0
    # Every old record and the first new one, each counted once (the second new one too if
    # it was written before the total was read).
    assert usage.num_tokens in (2_001 * 120, 2_002 * 120)


def test_monthly_usage_loads_once_then_counts_new_records(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    with session_factory.begin() as session:
        insert_records(
            session,
            [
                make_record("old-1", finished_at=NOW, amount_usd_micros=1_000),
                make_record("old-2", finished_at=NOW, num_completion_tokens=80),
                make_record("last-month", finished_at=datetime(2026, 10, 31, 23, 59, tzinfo=UTC)),
                make_record("other-tenant", tenant_id=2, finished_at=NOW),
            ],
        )

    async def scenario() -> list[MonthlyUsage]:
        ledger = _ledger(session_factory, tmp_path / "spool.jsonl")
        await ledger.start()
        seen = [await ledger.monthly_usage(1)]
        # Written behind the ledger's back: the running total is served from memory.
        with session_factory.begin() as session:
            insert_records(session, [make_record("elsewhere", finished_at=NOW)])
        seen.append(await ledger.monthly_usage(1))
        await ledger.record(make_record("new", finished_at=NOW, amount_usd_micros=500))
        # Tenant 2's request was preempted by tenant 1's: tenant 1 pays its recompute.
        await ledger.record(
            make_record(
                "preempted",
                tenant_id=2,
                finished_at=NOW,
                recompute_gpu_seconds=0.5,
                recompute_charged_tenant_id=1,
                recompute_amount_usd_micros=200,
            )
        )
        seen.append(await ledger.monthly_usage(1))
        seen.append(await ledger.monthly_usage(2))
        await ledger.close()
        return seen

    loaded, unchanged, after, tenant_2 = _run(scenario)
    assert loaded == MonthlyUsage(120 + 180, 1_000 + 134)
    assert unchanged == loaded
    assert after == MonthlyUsage(loaded.num_tokens + 120, loaded.spend_usd_micros + 500 + 200)
    assert tenant_2 == MonthlyUsage(120 + 120, 134 + 134)  # no recompute charge for tenant 2


def test_key_monthly_usage_counts_only_the_keys_own_records(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    """An API key's total (its own budgets): its records' tokens and charges this month,
    loaded once then kept current; recompute charged to its tenant is not the key's."""
    with session_factory.begin() as session:
        insert_records(
            session,
            [
                make_record("key-10", finished_at=NOW, amount_usd_micros=1_000),
                make_record("key-11", api_key_id=11, finished_at=NOW),
                make_record("last-month", finished_at=datetime(2026, 10, 31, 23, 59, tzinfo=UTC)),
            ],
        )

    async def scenario() -> list[MonthlyUsage]:
        ledger = _ledger(session_factory, tmp_path / "spool.jsonl")
        await ledger.start()
        seen = [await ledger.key_monthly_usage(10), await ledger.monthly_usage(1)]
        await ledger.record(make_record("new", finished_at=NOW, amount_usd_micros=500))
        await ledger.record(make_record("other-key", api_key_id=11, finished_at=NOW))
        await ledger.record(make_record(
            "preempted", tenant_id=2, api_key_id=20, finished_at=NOW,
            recompute_gpu_seconds=0.5, recompute_charged_tenant_id=1,
            recompute_amount_usd_micros=200,
        ))
        seen += [await ledger.key_monthly_usage(10), await ledger.key_monthly_usage(11),
                 await ledger.monthly_usage(1)]
        await ledger.close()
        return seen

    key_loaded, tenant_loaded, key_after, other_key, tenant_after = _run(scenario)
    assert key_loaded == MonthlyUsage(120, 1_000)
    assert tenant_loaded == MonthlyUsage(240, 1_000 + 134)
    assert key_after == MonthlyUsage(240, 1_500)
    assert other_key == MonthlyUsage(240, 268)
    assert tenant_after == MonthlyUsage(480, 1_134 + 500 + 134 + 200)


def test_monthly_usage_counts_spooled_records_once(
    own_database: OwnDatabase, tmp_path: Path
) -> None:
    spool = tmp_path / "spool.jsonl"

    async def scenario() -> tuple[MonthlyUsage, MonthlyUsage, MonthlyUsage]:
        ledger = _ledger(own_database.session_factory, spool, retry_interval_s=0.05)
        await ledger.start()
        await ledger.record(make_record("up", finished_at=NOW))
        await ledger.monthly_usage(1)
        await asyncio.to_thread(own_database.outage.stop)
        await ledger.record(make_record("spooled", finished_at=NOW))
        while_down = await ledger.monthly_usage(1)
        await asyncio.to_thread(own_database.outage.resume)
        await _eventually(lambda: ledger.is_database_healthy and spool.stat().st_size == 0)
        after_replay = await ledger.monthly_usage(1)
        await ledger.close()

        fresh = _ledger(own_database.session_factory, spool)
        await fresh.start()
        from_database = await fresh.monthly_usage(1)
        await fresh.close()
        return while_down, after_replay, from_database

    while_down, after_replay, from_database = _run(scenario)
    assert while_down == MonthlyUsage(240, 268)
    assert after_replay == while_down
    assert from_database == while_down


def test_monthly_usage_needs_the_database_the_first_time(
    own_database: OwnDatabase, tmp_path: Path
) -> None:
    async def scenario() -> None:
        ledger = _ledger(own_database.session_factory, tmp_path / "spool.jsonl")
        await ledger.start()
        await asyncio.to_thread(own_database.outage.stop)
        with pytest.raises(LedgerUnavailableError):
            await ledger.monthly_usage(7)
        await ledger.close()

    _run(scenario)
