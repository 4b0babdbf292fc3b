"""Usage records for tests: realistic defaults, any field overridable."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

import tenants
from billing import RecordStatus, UsageRecord, insert_records
from billing.models import USAGE_RECORDS, record_values
from billing.records import RECORD_FIELDS

# Mid-month, so a few hours either side stays in the same month.
DEFAULT_FINISHED_AT = datetime(2026, 11, 15, 12, 0, tzinfo=UTC)


def make_record(request_id: str, /, **fields: Any) -> UsageRecord:
    finished_at = fields.pop("finished_at", DEFAULT_FINISHED_AT)
    values: dict[str, Any] = {
        "request_id": request_id,
        "tenant_id": 1,
        "api_key_id": 10,
        "model": "tiergate-demo",
        "tier": "standard",
        "endpoint": "chat.completions",
        "status": RecordStatus.COMPLETED,
        "finish_reason": "stop",
        "num_prompt_tokens": 100,
        "num_cached_prompt_tokens": 32,
        "num_completion_tokens": 20,
        "gpu_seconds": 0.25,
        "recompute_gpu_seconds": 0.0,
        "recompute_charged_tenant_id": None,
        "num_preemptions": 0,
        "queue_time_s": 0.01,
        "ttft_s": 0.05,
        "e2e_time_s": 0.8,
        "created_at": finished_at - timedelta(seconds=1),
        "finished_at": finished_at,
        "amount_usd_micros": 134,
        "recompute_amount_usd_micros": 0,
        "weight_format": "float32",
    }
    values.update(fields)
    return UsageRecord(**values)


@dataclass(frozen=True)
class SeededMonth:
    """November 2026 with two live tenants, a deleted one, cross-tenant recompute charges,
    records on the very edges of days and of the month, and two just outside it."""

    acme_id: int  # premium tenant; preempts globex on Nov 1, is preempted by it on Nov 3
    globex_id: int  # batch tenant
    deleted_id: int  # a tenant id with records but no tenant row any more
    records: list[UsageRecord]  # the records that finished in November, in no particular order


def seed_month(session: Session) -> SeededMonth:
    """Create the tenants and store the records of SeededMonth (plus the two outside it)."""
    acme = tenants.create_tenant(session, name="acme", tier="premium", actor="test")
    globex = tenants.create_tenant(session, name="globex", tier="batch", actor="test")
    session.flush()
    a, g, d = acme.id, globex.id, max(acme.id, globex.id) + 1000

    def at(day: int, hour: int = 12, minute: int = 0, second: int = 0, us: int = 0) -> datetime:
        return datetime(2026, 11, day, hour, minute, second, us, tzinfo=UTC)

    november = [
        make_record("a1", tenant_id=a, tier="premium", finished_at=at(1, 0),
                    num_prompt_tokens=100, num_cached_prompt_tokens=0, num_completion_tokens=10,
                    gpu_seconds=1.0, amount_usd_micros=1000),
        make_record("a2", tenant_id=a, tier="premium", finished_at=at(1, 23, 59, 59, 999_999),
                    num_prompt_tokens=50, num_cached_prompt_tokens=10, num_completion_tokens=5,
                    gpu_seconds=0.5, amount_usd_micros=500),
        make_record("g1", tenant_id=g, tier="batch", finished_at=at(1),
                    num_prompt_tokens=200, num_cached_prompt_tokens=0, num_completion_tokens=40,
                    gpu_seconds=2.0, amount_usd_micros=300, num_preemptions=1,
                    recompute_gpu_seconds=0.25, recompute_charged_tenant_id=a,
                    recompute_amount_usd_micros=100),
        make_record("g2", tenant_id=g, tier="batch", finished_at=at(2, 8),
                    status=RecordStatus.ABORTED, finish_reason=None,
                    num_prompt_tokens=30, num_cached_prompt_tokens=16, num_completion_tokens=3,
                    gpu_seconds=0.125, amount_usd_micros=250),
        make_record("g3", tenant_id=g, tier="batch", finished_at=at(2, 9),
                    status=RecordStatus.REFUSED, finish_reason=None, api_key_id=None,
                    num_prompt_tokens=0, num_cached_prompt_tokens=0, num_completion_tokens=0,
                    gpu_seconds=0.0, amount_usd_micros=0, queue_time_s=None, ttft_s=None,
                    e2e_time_s=None, num_requests=3,
                    weight_format=None),  # three refusals, folded: no weights ran
        make_record("a3", tenant_id=a, tier="premium", finished_at=at(3),
                    weight_format="gguf-q4_1+q8_0",
                    num_prompt_tokens=10, num_cached_prompt_tokens=0, num_completion_tokens=1,
                    gpu_seconds=0.0625, amount_usd_micros=40, num_preemptions=2,
                    recompute_gpu_seconds=1.5, recompute_charged_tenant_id=g,
                    recompute_amount_usd_micros=600),
        make_record("d1", tenant_id=d, finished_at=at(30, 23, 59, 59),
                    num_prompt_tokens=7, num_cached_prompt_tokens=0, num_completion_tokens=7,
                    gpu_seconds=0.25, amount_usd_micros=70),
    ]  # fmt: skip
    last_instant_of_october = datetime(2026, 10, 31, 23, 59, 59, 999_999, tzinfo=UTC)
    outside = [
        make_record("before", tenant_id=a, finished_at=last_instant_of_october),
        make_record("after", tenant_id=a, finished_at=datetime(2026, 12, 1, tzinfo=UTC)),
    ]
    insert_records(session, november + outside)
    return SeededMonth(a, g, d, november)


def bulk_insert(session: Session, records: Sequence[UsageRecord]) -> None:
    """Store many records fast (a test tool for large months): COPY on PostgreSQL, one
    executemany on SQLite. The ledger's own path, insert_records, is tested elsewhere."""
    rows = [record_values(record) for record in records]
    if session.get_bind().dialect.name != "postgresql":
        session.execute(insert(USAGE_RECORDS), rows)
        return
    columns = ", ".join(RECORD_FIELDS)
    cursor = session.connection().connection.cursor()
    with cursor.copy(f"COPY usage_records ({columns}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(
                [str(row[name]) if name == "status" else row[name] for name in RECORD_FIELDS]
            )
