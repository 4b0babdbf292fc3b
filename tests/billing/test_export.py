"""Daily rollups and exports on SQLite and PostgreSQL: UTC day and month edges, recompute
charged to the tenant that caused it, deleted tenants, CSV and JSONL, totals that reconcile
with the records, and a month of 100,000 records."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from billing import (
    DAILY_COLUMNS,
    DETAIL_COLUMNS,
    ExportFormat,
    ExportRequest,
    Period,
    RecordStatus,
    UsageRecord,
    UsageTotals,
    count_records,
    daily_usage,
    export_lines,
    insert_records,
    interval_totals,
)
from tests.billing.factories import SeededMonth, bulk_insert, make_record, seed_month

NOVEMBER = Period(2026, 11)


@pytest.fixture
def month(session: Session) -> SeededMonth:
    seeded = seed_month(session)
    session.commit()
    return seeded


def _summary(totals: UsageTotals) -> tuple[Any, ...]:
    return (
        totals.num_requests,
        totals.num_prompt_tokens,
        totals.num_cached_prompt_tokens,
        totals.num_completion_tokens,
        totals.gpu_seconds,
        totals.recompute_gpu_seconds_charged,
        totals.amount_usd_micros,
    )


def test_daily_rows_per_tenant_per_utc_day(session: Session, month: SeededMonth) -> None:
    a, g, d = month.acme_id, month.globex_id, month.deleted_id
    rows = daily_usage(session, NOVEMBER.start, NOVEMBER.end)
    assert [(r.date, r.tenant_id, r.tenant_name, _summary(r.totals)) for r in rows] == [
        # a1 and a2 (the last microsecond of the day), plus g1's recompute that acme caused.
        ("2026-11-01", a, "acme", (2, 150, 10, 15, 1.5, 0.25, 1000 + 500 + 100)),
        ("2026-11-01", g, "globex", (1, 200, 0, 40, 2.0, 0.0, 300)),
        # g2 aborted, and g3 folding three refusals: four requests.
        ("2026-11-02", g, "globex", (4, 30, 16, 3, 0.125, 0.0, 250)),
        ("2026-11-03", a, "acme", (1, 10, 0, 1, 0.0625, 0.0, 40)),  # its recompute: globex's
        ("2026-11-03", g, "globex", (0, 0, 0, 0, 0.0, 1.5, 600)),  # pays, sent nothing that day
        ("2026-11-30", d, None, (1, 7, 0, 7, 0.25, 0.0, 70)),  # tenant deleted, records kept
    ]
    only_globex = daily_usage(session, NOVEMBER.start, NOVEMBER.end, g)
    assert [r for r in rows if r.tenant_id == g] == only_globex


def test_totals_reconcile_with_the_records(session: Session, month: SeededMonth) -> None:
    for tenant_id in (None, month.acme_id, month.globex_id, month.deleted_id, 999_999):
        rows = daily_usage(session, NOVEMBER.start, NOVEMBER.end, tenant_id)
        from_rows = sum((r.totals for r in rows), UsageTotals())
        from_sql = interval_totals(session, NOVEMBER.start, NOVEMBER.end, tenant_id)
        from_records = UsageTotals.of_records(month.records, tenant_id)
        assert from_rows == from_sql == from_records, tenant_id
    everyone = interval_totals(session, NOVEMBER.start, NOVEMBER.end)
    assert everyone.num_requests == len(month.records) + 2 == 9  # g3 folds three refusals
    assert everyone.amount_usd_micros == 1000 + 500 + 300 + 100 + 250 + 40 + 600 + 70


def _text(session: Session, request: ExportRequest) -> str:
    return "".join(export_lines(session, request))


def test_daily_csv(session: Session, month: SeededMonth) -> None:
    text = _text(session, ExportRequest(NOVEMBER, ExportFormat.CSV))
    lines = list(csv.DictReader(io.StringIO(text)))
    assert text.splitlines()[0] == ",".join(DAILY_COLUMNS)
    assert len(lines) == 6
    first = lines[0]
    assert first == {
        "date": "2026-11-01",
        "tenant_id": str(month.acme_id),
        "tenant_name": "acme",
        "num_requests": "2",
        "num_prompt_tokens": "150",
        "num_cached_prompt_tokens": "10",
        "num_completion_tokens": "15",
        "gpu_seconds": "1.5",
        "recompute_gpu_seconds_charged": "0.25",
        "amount_usd_micros": "1600",
        "amount_usd": "0.001600",
    }
    assert lines[-1]["tenant_name"] == ""  # deleted tenant


def test_daily_jsonl_for_one_tenant(session: Session, month: SeededMonth) -> None:
    request = ExportRequest(NOVEMBER, ExportFormat.JSONL, tenant_id=month.globex_id)
    rows = [json.loads(line) for line in export_lines(session, request)]
    assert [(r["date"], r["num_requests"], r["amount_usd_micros"]) for r in rows] == [
        ("2026-11-01", 1, 300),
        ("2026-11-02", 4, 250),
        ("2026-11-03", 0, 600),
    ]
    assert set(rows[0]) == set(DAILY_COLUMNS)
    assert rows[2]["amount_usd"] == "0.000600"
    assert request.filename == f"tiergate-usage-2026-11-tenant-{month.globex_id}-daily.jsonl"


def test_detail_jsonl_is_every_record_of_the_month(session: Session, month: SeededMonth) -> None:
    request = ExportRequest(NOVEMBER, ExportFormat.JSONL, is_detail=True)
    records = [UsageRecord.from_json(json.loads(line)) for line in export_lines(session, request)]
    assert sorted(records, key=lambda r: r.request_id) == sorted(
        month.records, key=lambda r: r.request_id
    )
    assert [r.finished_at for r in records] == sorted(r.finished_at for r in records)
    assert count_records(session, NOVEMBER) == 7
    by_id = {r.request_id: r for r in records}
    assert (by_id["a3"].weight_format, by_id["g3"].weight_format) == ("gguf-q4_1+q8_0", None)


def test_detail_of_a_tenant_includes_the_recompute_it_paid(
    session: Session, month: SeededMonth
) -> None:
    request = ExportRequest(NOVEMBER, ExportFormat.CSV, month.acme_id, is_detail=True)
    lines = list(csv.DictReader(io.StringIO(_text(session, request))))
    assert tuple(lines[0]) == DETAIL_COLUMNS
    assert DETAIL_COLUMNS[-2:] == ("adapter", "weight_format")  # the record's field order
    assert sorted(line["request_id"] for line in lines) == ["a1", "a2", "a3", "g1"]
    formats = {line["request_id"]: line["weight_format"] for line in lines}
    assert formats == {"a1": "float32", "a2": "float32", "a3": "gguf-q4_1+q8_0",
                       "g1": "float32"}
    assert count_records(session, NOVEMBER, month.acme_id) == 4
    refused = ExportRequest(NOVEMBER, ExportFormat.CSV, month.globex_id, is_detail=True)
    g3 = next(
        x for x in csv.DictReader(io.StringIO(_text(session, refused))) if x["request_id"] == "g3"
    )
    assert (g3["status"], g3["api_key_id"], g3["ttft_s"]) == ("refused", "", "")
    assert g3["weight_format"] == ""  # a refusal ran on no weights


def test_an_empty_month_exports_only_a_header(session: Session) -> None:
    assert _text(session, ExportRequest(Period(2020, 2), ExportFormat.CSV)) == (
        ",".join(DAILY_COLUMNS) + "\n"
    )
    assert _text(session, ExportRequest(Period(2020, 2), ExportFormat.JSONL, is_detail=True)) == ""


def _random_month(num_records: int, num_tenants: int, seed: int) -> list[UsageRecord]:
    rng = random.Random(seed)
    month_s = (NOVEMBER.end - NOVEMBER.start).total_seconds()
    records = []
    for i in range(num_records):
        finished_at = NOVEMBER.start + timedelta(seconds=rng.random() * month_s)
        prompt = rng.randint(1, 4000)
        preempted = rng.random() < 0.05
        records.append(
            make_record(
                f"bulk-{i}",
                tenant_id=rng.randint(1, num_tenants),
                finished_at=finished_at,
                status=RecordStatus.COMPLETED if rng.random() < 0.95 else RecordStatus.ABORTED,
                num_prompt_tokens=prompt,
                num_cached_prompt_tokens=rng.randint(0, prompt),
                num_completion_tokens=rng.randint(0, 1000),
                gpu_seconds=rng.random() * 2,
                amount_usd_micros=rng.randint(0, 50_000),
                num_preemptions=int(preempted),
                recompute_gpu_seconds=rng.random() if preempted else 0.0,
                recompute_charged_tenant_id=rng.randint(1, num_tenants) if preempted else None,
                recompute_amount_usd_micros=rng.randint(0, 500) if preempted else 0,
            )
        )
    return records


@pytest.fixture(scope="module")
def random_month() -> list[UsageRecord]:
    """100,000 records over November, 50 tenants, 5 % of them preempted (both backends)."""
    return _random_month(100_000, num_tenants=50, seed=7)


@pytest.mark.slow
def test_a_month_of_100k_records_exports_in_seconds(
    session: Session, random_month: list[UsageRecord]
) -> None:
    records = random_month
    started = time.perf_counter()
    bulk_insert(session, records)
    session.commit()
    inserted_s = time.perf_counter() - started

    started = time.perf_counter()
    daily_text = _text(session, ExportRequest(NOVEMBER, ExportFormat.CSV))
    daily_s = time.perf_counter() - started
    started = time.perf_counter()
    detail_text = _text(session, ExportRequest(NOVEMBER, ExportFormat.JSONL, is_detail=True))
    detail_s = time.perf_counter() - started

    print(
        f"\n{session.get_bind().dialect.name}: 100,000 records: bulk insert {inserted_s:.2f} s,"
        f" daily export {daily_s:.2f} s, detail export {detail_s:.2f} s"
    )
    daily_rows = list(csv.DictReader(io.StringIO(daily_text)))
    assert len({row["tenant_id"] for row in daily_rows}) == 50
    assert len({row["date"] for row in daily_rows}) == 30
    from_daily = UsageTotals(
        *(
            sum(parse(row[column]) for row in daily_rows)
            for column, parse in _TOTALS_COLUMNS.items()
        )
    )
    from_detail = UsageTotals.of_records(
        UsageRecord.from_json(json.loads(line)) for line in detail_text.splitlines()
    )
    expected = UsageTotals.of_records(records)
    _assert_reconciled(from_daily, expected)
    _assert_reconciled(from_detail, expected)


# Daily CSV columns in UsageTotals field order, with their types.
_TOTALS_COLUMNS: dict[str, Callable[[str], Any]] = {
    "num_requests": int,
    "num_prompt_tokens": int,
    "num_cached_prompt_tokens": int,
    "num_completion_tokens": int,
    "gpu_seconds": float,
    "recompute_gpu_seconds_charged": float,
    "amount_usd_micros": int,
}


def _assert_reconciled(actual: UsageTotals, expected: UsageTotals) -> None:
    """Counts and money exactly; float seconds to rounding (summed in another order)."""
    for name in ("gpu_seconds", "recompute_gpu_seconds_charged"):
        assert getattr(actual, name) == pytest.approx(getattr(expected, name), rel=1e-9)
    assert dataclasses.replace(actual, gpu_seconds=0.0, recompute_gpu_seconds_charged=0.0) == (
        dataclasses.replace(expected, gpu_seconds=0.0, recompute_gpu_seconds_charged=0.0)
    )


def test_day_boundaries_are_utc_whatever_the_session_time_zone(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET TIME ZONE 'America/New_York'"))
    insert_records(
        session, [make_record("late", finished_at=datetime(2026, 11, 5, 23, 30, tzinfo=UTC))]
    )
    rows = daily_usage(session, NOVEMBER.start, NOVEMBER.end)
    assert [row.date for row in rows] == ["2026-11-05"]
