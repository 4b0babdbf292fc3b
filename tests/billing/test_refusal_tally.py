"""The refusal tally over a real ledger (SQLite and PostgreSQL): refusals folded into one record
per key, model and endpoint a flush, counted exactly in the rollups, written on close, and a
failing write that loses only its own fold."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, event, select
from sqlalchemy.orm import Session, sessionmaker

from billing import (
    InvalidSettingError,
    LedgerWriteError,
    RecordStatus,
    RefusalTally,
    UsageLedger,
    UsageRecord,
    UsageRecordRow,
    interval_totals,
)
from tests.billing.factories import make_record

START = datetime(2026, 11, 20, 9, 30, tzinfo=UTC)


def _refusal(i: int, *, tenant_id: int = 1, api_key_id: int = 10) -> UsageRecord:
    at = START + timedelta(milliseconds=i)
    return make_record(
        f"chatcmpl-{tenant_id}-{i}", tenant_id=tenant_id, api_key_id=api_key_id,
        status=RecordStatus.REFUSED, finish_reason=None, num_prompt_tokens=0,
        num_cached_prompt_tokens=0, num_completion_tokens=0, gpu_seconds=0.0,
        amount_usd_micros=0, queue_time_s=None, ttft_s=None, e2e_time_s=0.001,
        created_at=at, finished_at=at,
    )


def _stored(session_factory: sessionmaker[Session]) -> list[UsageRecordRow]:
    with session_factory() as session:
        return list(session.scalars(select(UsageRecordRow).order_by(UsageRecordRow.tenant_id)))


def test_a_flood_of_refusals_is_one_row_per_key(
    engine: Engine, session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    commits: list[object] = []

    def on_commit(connection: object) -> None:
        commits.append(connection)

    async def scenario() -> None:
        ledger = UsageLedger(session_factory, tmp_path / "spool.jsonl")
        await ledger.start()
        tally = RefusalTally(ledger.record, interval_s=3600)  # flushed by hand below
        event.listen(engine, "commit", on_commit)
        try:
            for i in range(5_000):
                tally.add(_refusal(i))
                tally.add(_refusal(i, tenant_id=2, api_key_id=20))
            tally.add(_refusal(0, api_key_id=11))  # the same tenant's other key
            assert tally.num_pending == 10_001
            await tally.flush()
            assert tally.num_pending == 0
        finally:
            event.remove(engine, "commit", on_commit)
        await tally.close()
        await ledger.close()

    asyncio.run(scenario())
    rows = _stored(session_factory)
    assert sorted((r.tenant_id, r.api_key_id, r.num_requests) for r in rows) == [
        (1, 10, 5_000), (1, 11, 1), (2, 20, 5_000)
    ]
    assert len(commits) == 1  # one group commit for the three
    folded = next(r for r in rows if r.num_requests == 5_000 and r.tenant_id == 1)
    assert folded.created_at == START
    assert folded.finished_at == START + timedelta(milliseconds=4_999)
    assert folded.status is RecordStatus.REFUSED and folded.e2e_time_s is None
    assert folded.request_id.startswith("refusals-")
    with session_factory() as session:
        totals = interval_totals(session, START, START + timedelta(days=1), tenant_id=1)
    assert totals.num_requests == 5_001
    assert totals.num_prompt_tokens == totals.amount_usd_micros == 0


def test_refusals_are_written_every_interval_and_on_close(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        ledger = UsageLedger(session_factory, tmp_path / "spool.jsonl")
        await ledger.start()
        tally = RefusalTally(ledger.record, interval_s=0.05)
        await tally.start()
        for i in range(3):
            tally.add(_refusal(i))
        deadline = asyncio.get_running_loop().time() + 10
        while not (written := await asyncio.to_thread(_stored, session_factory)):
            assert asyncio.get_running_loop().time() < deadline, "never flushed"
            await asyncio.sleep(0.01)
        for i in range(3, 5):
            tally.add(_refusal(i))
        await tally.close()  # the two since the last flush are written now
        await ledger.close()
        return [r.num_requests for r in written], [
            r.num_requests for r in await asyncio.to_thread(_stored, session_factory)
        ]

    first, final = asyncio.run(scenario())
    assert first == [3]
    assert sorted(final) == [2, 3]


def test_a_failed_write_loses_its_fold_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    written: list[UsageRecord] = []

    async def write(record: UsageRecord) -> None:
        if record.tenant_id == 2:
            raise LedgerWriteError("the spool is unwritable")
        written.append(record)

    async def scenario() -> None:
        tally = RefusalTally(write, interval_s=3600)
        for i in range(4):
            tally.add(_refusal(i))
            tally.add(_refusal(i, tenant_id=2, api_key_id=20))
        with caplog.at_level(logging.ERROR, logger="billing.refusal_tally"):
            await tally.flush()
        await tally.close()

    asyncio.run(scenario())
    assert [(r.tenant_id, r.num_requests) for r in written] == [(1, 4)]
    assert "a record of 4 refusal(s) of tenant 2 was lost" in caplog.text


def test_only_refusals_are_folded() -> None:
    tally = RefusalTally(lambda record: asyncio.sleep(0))
    with pytest.raises(ValueError, match="only refusals"):
        tally.add(make_record("ran"))
    with pytest.raises(InvalidSettingError):
        RefusalTally(lambda record: asyncio.sleep(0), interval_s=0)


def test_refusals_on_different_adapters_are_kept_apart() -> None:
    written: list[UsageRecord] = []

    async def write(record: UsageRecord) -> None:
        written.append(record)

    async def scenario() -> None:
        tally = RefusalTally(write, interval_s=3600)
        for i, adapter in enumerate([None, "french", "french", "german", None]):
            tally.add(dataclasses.replace(_refusal(i), adapter=adapter))
        await tally.flush()

    asyncio.run(scenario())
    counts = {record.adapter: record.num_requests for record in written}
    assert counts == {None: 2, "french": 2, "german": 1}
