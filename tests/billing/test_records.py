"""Usage records: invariants checked at construction, the JSON form the spool and the detail
export use, and billing months."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from billing import InvalidPeriodError, InvalidRecordError, Period, RecordStatus, UsageRecord
from billing.period import day_range, parse_day
from billing.records import MAX_WEIGHT_FORMAT_LENGTH
from engine.worker.weight_format import MAX_WEIGHT_FORMAT_LABEL_LENGTH
from tests.billing.factories import make_record


def test_json_round_trip_is_exact() -> None:
    record = make_record(
        "chatcmpl-1",
        status=RecordStatus.ABORTED,
        finish_reason=None,
        gpu_seconds=0.1 + 0.2,  # a float with no short decimal form
        recompute_gpu_seconds=1e-7,
        recompute_charged_tenant_id=3,
        ttft_s=None,
        finished_at=datetime(2026, 11, 30, 23, 59, 59, 999_999, tzinfo=UTC),
    )
    line = json.dumps(record.to_json())
    assert UsageRecord.from_json(json.loads(line)) == record
    assert json.loads(line)["status"] == "aborted"


def test_timestamps_are_kept_in_utc() -> None:
    local = datetime(2026, 11, 15, 9, 0, tzinfo=timezone(timedelta(hours=-5)))
    record = make_record("r", finished_at=local)
    assert record.to_json()["finished_at"] == "2026-11-15T14:00:00+00:00"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"request_id": ""}, "request_id"),
        ({"request_id": "x" * 129}, "request_id"),
        ({"endpoint": "embeddings"}, "endpoint"),
        ({"num_prompt_tokens": -1, "num_cached_prompt_tokens": 0}, "num_prompt_tokens"),
        ({"num_cached_prompt_tokens": 101}, "num_cached_prompt_tokens exceeds"),
        ({"gpu_seconds": float("nan")}, "gpu_seconds"),
        ({"ttft_s": -0.1}, "ttft_s"),
        ({"amount_usd_micros": -5}, "amount_usd_micros"),
        ({"finished_at": datetime(2026, 11, 15)}, "timezone-aware"),
        ({"num_requests": 0}, "at least 1"),
        ({"num_requests": 2}, "only refusals"),  # a request that ran is one record
        ({"weight_format": ""}, "weight_format"),
        ({"weight_format": "gguf-" + "q4_k+" * 6}, "weight_format"),  # past its column
    ],
)
def test_invalid_records_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRecordError, match=message):
        make_record("r", **fields)


def test_a_spool_line_from_before_folded_refusals_stands_for_one_request() -> None:
    line = make_record("r").to_json()
    del line["num_requests"]
    assert UsageRecord.from_json(line).num_requests == 1


def test_a_spool_line_from_before_the_weight_format_names_none() -> None:
    line = make_record("r", weight_format="gguf-q4_1").to_json()
    assert line["weight_format"] == "gguf-q4_1"
    assert UsageRecord.from_json(line).weight_format == "gguf-q4_1"
    del line["weight_format"]
    assert UsageRecord.from_json(line).weight_format is None


def test_the_weight_format_column_holds_every_engine_label() -> None:
    assert MAX_WEIGHT_FORMAT_LABEL_LENGTH <= MAX_WEIGHT_FORMAT_LENGTH


def test_unreadable_json_is_an_invalid_record() -> None:
    good = make_record("r").to_json()
    for broken in (
        {k: v for k, v in good.items() if k != "tenant_id"},
        {**good, "status": "exploded"},
        {**good, "finished_at": "yesterday"},
        {**good, "extra": 1},
        {**good, "tenant_id": "7"},
        {**good, "num_prompt_tokens": True},
        {**good, "gpu_seconds": "0.5"},
        {**good, "num_requests": 1.5},
        {**good, "model": None},
        {**good, "weight_format": 4},
    ):
        with pytest.raises(InvalidRecordError):
            UsageRecord.from_json(broken)


def test_num_tokens_counts_prompt_and_completion() -> None:
    record = make_record("r", num_prompt_tokens=100, num_cached_prompt_tokens=90)
    assert record.num_tokens == 120
    assert dataclasses.replace(record, num_completion_tokens=0).num_tokens == 100


def test_periods() -> None:
    november = Period.parse("2026-11")
    assert (november.start, november.end) == (
        datetime(2026, 11, 1, tzinfo=UTC),
        datetime(2026, 12, 1, tzinfo=UTC),
    )
    assert Period.parse("2026-12").end == datetime(2027, 1, 1, tzinfo=UTC)
    assert str(november) == "2026-11"
    late_local = datetime(2026, 11, 30, 22, 0, tzinfo=timezone(timedelta(hours=-5)))
    assert Period.containing(late_local) == Period(2026, 12)
    for text in ("2026-13", "2026-1", "26-11", "november", "9999-12"):
        with pytest.raises(InvalidPeriodError):
            Period.parse(text)


def test_day_ranges_include_both_days() -> None:
    start, end = day_range(
        parse_day("2026-11-01", "start"), parse_day("2026-11-03", "end"), max_days=31
    )
    assert (start, end) == (datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 11, 4, tzinfo=UTC))
    with pytest.raises(InvalidPeriodError) as caught:
        day_range(parse_day("2026-11-03", "start"), parse_day("2026-11-01", "end"), max_days=31)
    assert caught.value.param == "end"
    with pytest.raises(InvalidPeriodError):
        day_range(parse_day("2026-01-01", "start"), parse_day("2026-12-31", "end"), max_days=31)
    with pytest.raises(InvalidPeriodError) as caught:
        parse_day("2026-02-30", "start")
    assert caught.value.param == "start"
